"""A baseline commit's tree for the benches that run it beside this checkout."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def baseline_tree(commit: str, prefix: str) -> Path:
    """A detached worktree of ``commit`` under the temporary folder (``PREFIX-<commit>``), made once
    and kept for the next call."""
    path = Path(tempfile.gettempdir()) / f"{prefix}-{commit[:7]}"
    if not (path / ".git").exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path
