"""How a local sandbox's first host process joins its cgroups and drops to the sandbox user.

A bwrap sandbox's runtime must start inside the sandbox's cgroups (bwrap makes the sandbox's cgroup
namespace when it clones, so the cgroups it is in then are the namespace's root) and, when the
harness is root, as the sandbox user with no capabilities (so that the sandbox's processes are an
unprivileged host user even outside their namespaces). Both happen between the harness's fork and
bwrap's exec, where Python cannot run without a fork of the whole harness.

``sandboxes/launch.c`` does both in one small static program: it writes its pid into each
``cgroup.procs``, empties the capability bounding and inheritable sets, clears the supplementary
groups, sets the real, effective and saved gid and uid, and becomes bwrap. It stands for a shell
(``sh -c 'echo $$ > .../cgroup.procs; exec "$@"'``) and ``setpriv --reuid --regid --clear-groups
--inh-caps=-all --bounding-set=-all``, whose two execs cost about 2 ms of CPU a start more
(docs/benchmarks.md, "Issue 55, fifth session"); the process it leaves is the same (uid, gids,
groups, every capability set: ``tests/sandboxes/test_launcher.py``). It is compiled once per
source on the host (``cc -O2 -static``, then without ``-static``) into the run base's ``pxd/``
folder beside the compiled daemon, root's and mode 0755 in folders of mode 0711. A host with no C
compiler starts through the shell and ``setpriv`` as before (:func:`launch_argv`), and says so once.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import threading
import warnings
from pathlib import Path

from sandboxes.rootfs import run_base

LAUNCH_SOURCE = Path(__file__).with_name("launch.c")
_lock = threading.Lock()
# by the source's inode, size and time and the run base: the path, or None where none can be built
_built: dict[tuple[int, int, int, str], str | None] = {}


def _usable(path: str) -> bool:
    """A launcher this user wrote and no one else may change (a regular file, not a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def launcher() -> str | None:
    """The compiled ``launch.c`` (named by its source's hash), built on first use; None where no C
    compiler builds it (then :func:`launch_argv` falls back to a shell and ``setpriv``)."""
    st = os.stat(LAUNCH_SOURCE)
    base = run_base()
    key = (st.st_ino, st.st_size, st.st_mtime_ns, str(base))
    path = _built.get(key)
    if (path is not None and _usable(path)) or (key in _built and path is None):  # every start asks
        return path
    with _lock:  # first use, or the file went (a cleaner of /tmp): built again
        folder = base / "pxd"
        path = f"{folder}/launch-{hashlib.sha256(LAUNCH_SOURCE.read_bytes()).hexdigest()[:16]}"
        if not _usable(path):
            built = _compile(folder, Path(path))
            path = str(built) if built is not None else None
        _built[key] = path
        return path


def _compile(folder: Path, path: Path) -> Path | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler (cc): bwrap sandboxes start through sh and setpriv, about 2 ms of CPU "
                      "a start more (Debian package gcc builds sandboxes/launch.c)")
        return None
    for d in (folder.parent, folder):
        d.mkdir(exist_ok=True)
        if d.stat().st_uid == os.geteuid():
            os.chmod(d, 0o711)
    tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}"
    errors = []
    for static in (["-static"], []):  # static: no dynamic loader at each start
        try:
            done = subprocess.run([compiler, "-O2", *static, "-o", str(tmp), str(LAUNCH_SOURCE)],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if done.returncode == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
            return path
        errors.append(done.stderr.strip()[-500:])
    warnings.warn(f"{compiler} could not build {LAUNCH_SOURCE} ({' / '.join(errors)}): bwrap sandboxes start "
                  "through sh and setpriv, about 2 ms of CPU a start more")
    return None


def launch_argv(argv: list[str], procs_files: list[str], user: tuple[int, int] | None) -> list[str]:
    """``argv`` (its first item a path) run in the cgroups whose ``cgroup.procs`` are
    ``procs_files`` and, with ``user`` (uid, gid), as that user with no capabilities and no
    supplementary groups: through the launcher, or a shell and ``setpriv`` where it cannot be built."""
    path = launcher()
    if path is not None:
        ids = ["-u", str(user[0]), "-g", str(user[1])] if user is not None else []
        return [path, *ids, *procs_files, "--", *argv]
    if user is not None:
        argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--", *argv]
    files = " ".join(shlex.quote(f) for f in procs_files)
    return ["/bin/sh", "-c", f'for f in {files}; do echo $$ > "$f" || exit 125; done; exec "$@"', "sh", *argv]
