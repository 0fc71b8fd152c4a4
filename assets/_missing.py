"""The error an asset raises while the domain code it stands on is not built yet."""

from __future__ import annotations


class NotBuiltError(RuntimeError):
    """Raised by an asset whose domain code does not exist yet; it never returns made-up results."""


def not_built(asset_key: str, missing: str) -> NotBuiltError:
    return NotBuiltError(f"asset {asset_key!r} cannot materialize yet: {missing} is not built")
