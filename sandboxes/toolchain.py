"""The host toolchain every sandbox sees: ``/usr`` and the project's Python, read-only, and its environment.

:func:`host_toolchain` lists the host folders bound into a sandbox (git, coreutils and ``python3``
under ``/usr``; ``sys.base_prefix`` and the virtual environment, so ``python -m pytest`` works);
:func:`reachable_toolchain_source` gives a folder the sandbox user cannot walk to (a Python under
``/root``) a read-only bind mount it can; :func:`sandbox_env` is the environment commands start with.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

from sandboxes.images import SANDBOX_UID
from sandboxes.rootfs import bind_read_only, run_base

SANDBOX_HOME = "/home/sandbox"


def reachable_by(uid: int, path: Path) -> bool:
    """Whether ``uid`` (not in any group that matters) can walk down to ``path``."""
    p = Path(path).resolve()
    for d in [*reversed(p.parents), p] if p.is_dir() else reversed(p.parents):
        st = os.stat(d)
        bit = 0o100 if st.st_uid == uid else 0o001
        if not st.st_mode & bit:
            return False
    return True


_toolchain_lock = threading.Lock()
_toolchain_sources: dict[str, str] = {}  # host path -> where bwrap binds it from (this process)


def reachable_toolchain_source(path: str) -> str:
    """``path`` itself when the sandbox user can reach it, else a read-only bind mount of it under
    the run root's ``toolchain/`` folder (made once, kept for later sandboxes); e.g. a Python
    installed under ``/root``."""
    if path in _toolchain_sources:
        return _toolchain_sources[path]
    if os.geteuid() != 0 or reachable_by(SANDBOX_UID, Path(path)):
        _toolchain_sources[path] = path
        return path
    base = run_base()
    target = base / "toolchain" / hashlib.sha256(path.encode()).hexdigest()[:12]
    with _toolchain_lock:
        mounts = Path("/proc/self/mounts").read_text().split("\n")
        if not any(line.split(" ")[1:2] == [str(target)] for line in mounts):
            base.mkdir(parents=True, exist_ok=True)
            os.chmod(base, 0o711)
            target.parent.mkdir(exist_ok=True)
            os.chmod(target.parent, 0o711)
            target.mkdir(exist_ok=True)
            bind_read_only(path, target)
    _toolchain_sources[path] = str(target)
    return str(target)


def host_toolchain() -> list[str]:
    """Host folders bound read-only into every sandbox: ``/usr`` and this Python (base and venv)."""
    paths = ["/usr"]
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        if not prefix.startswith("/usr/"):
            paths.append(prefix)
    return sorted(paths)


def sandbox_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = [str(Path(sys.prefix) / "bin")] if sys.prefix != sys.base_prefix else []
    path += [str(Path(sys.base_prefix) / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
    env = {"PATH": ":".join(path), "HOME": SANDBOX_HOME, "LANG": "C.UTF-8", "TMPDIR": "/tmp",
           "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb",
           # the project's venv carries pytest plugins no task needs; loading them costs ~2.5 s a run
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.update(extra or {})
    return env
