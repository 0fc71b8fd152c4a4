"""``posttrain`` commands of the sandboxes package."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the ``posttrain`` parser."""
