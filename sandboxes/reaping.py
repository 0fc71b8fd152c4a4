"""What sandboxes of dead owners leave behind, removed: processes, cgroups, mounts, run folders.

A harness killed with SIGKILL cannot close its sandboxes: their processes, cgroups, mounts and run
folders stay. A run folder is ``$POSTTRAIN_SANDBOX_RUN_DIR/<cache>/pt-<id>`` (:mod:`sandboxes.rootfs`),
and its owner holds the folder's ``lock`` (``flock``) for the sandbox's whole life; the lock file
appears only once it is held (:class:`sandboxes.runtimes.Sandbox` locks it under another name, then
renames it), so a ``lock`` that can be taken belongs to a dead process. A folder with no ``lock``
is one being made, or debris of a start that died before it: it is reaped once older than
``min_age_s``.

For each dead run folder, :func:`reap_stale_sandboxes` kills what is left in its cgroup, unmounts
every mount under it (read from ``/proc/self/mountinfo``, deepest first, lazily: ``MNT_DETACH``
takes a mount out of the tree even while a process still has a file open on it) and only then
removes the folder, and only when the mount table shows nothing mounted under it any more:
removing files through a mount would delete what the mount shows (a layer, a bind of the host's).
Mounts outside the run folders (the toolchain's binds under ``toolchain/``) are never touched.

:func:`sandboxes.runtimes.start` reaps its cache's run folders once per process and cache; a
harness killed while using a cache that no process uses again (a test's temporary one) leaves
debris only the whole run base's sweep finds: ``posttrain sandbox reap`` (``reap_stale_sandboxes(None)``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
import warnings
from pathlib import Path

from sandboxes.cache import LayerCache
from sandboxes.cgroups import Cgroup, remove_stale_empty_cgroups
from sandboxes.rootfs import run_base, run_root, umount

_CACHE_FOLDER = re.compile(r"[0-9a-f]{12}")  # run_root's name: a hash of the cache folder
_RUN_FOLDER = re.compile(r"pt-[0-9a-f]+")  # a sandbox's id
_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mount points of this process's mount namespace, as ``/proc/self/mountinfo`` lists them
    (its fifth field, with the kernel's octal escapes of space, tab, newline and backslash undone)."""
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        return [_MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ", 5)[4])
                for line in f if line.count(" ") >= 5]


def _mounts_under(folder: Path, points: list[str]) -> list[str]:
    real = os.path.realpath(folder)  # the mount table names real paths (a run base named through a link)
    prefix = real.rstrip("/") + "/"
    return [p for p in points if p == real or p.startswith(prefix)]


def _reap_folder(run_dir: Path, min_age_s: float) -> int | None:
    """Clear one run folder if its owner is gone (see the module docstring): how many mounts it
    took down, or None where it left the folder."""
    try:
        fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        try:  # a folder being made has no lock yet; only old ones are debris
            if time.time() - run_dir.lstat().st_mtime < min_age_s:
                return None
        except FileNotFoundError:
            return None
        fd = None
    except OSError:  # not a file we can open: not a run folder of ours
        return None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # alive
        Cgroup.existing(run_dir.name).remove()  # its processes first: nothing keeps using the mounts
        # deepest first (a mount's path is longer than that of any mount it sits in); each one lazily
        points = sorted(_mounts_under(run_dir, mount_points()), key=len, reverse=True)
        for point in points:
            umount(Path(point))
        left = _mounts_under(run_dir, mount_points())
        if left:  # never remove files through a mount: they would be the mount's
            warnings.warn(f"reaping: {run_dir} still has mounts ({', '.join(left)}); left in place")
            return None
        shutil.rmtree(run_dir, ignore_errors=True)
        return len(points)
    finally:
        if fd is not None:
            os.close(fd)


def reap_stale_sandboxes(cache: LayerCache | None = None, min_age_s: float = 60.0, *,
                         unmounted: list | None = None) -> list[str]:
    """Remove what sandboxes of dead owners left: their processes (by cgroup), mounts and run folders,
    in ``cache``'s run folder, or with no cache in every cache's under the run base. A live sandbox
    holds the lock in its run folder, so this is safe while other processes run sandboxes, from the
    same cache or another. Returns the ids of the sandboxes it cleared; ``unmounted``, when given,
    gets how many mounts each of them had."""
    if cache is not None:
        roots = [run_root(cache, create=False)]
    else:
        base = run_base()
        roots = sorted(p for p in (base.iterdir() if base.is_dir() else ()) if _CACHE_FOLDER.fullmatch(p.name))
    reaped = []
    for root in roots:
        try:
            run_dirs = sorted(root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        for run_dir in run_dirs:
            if not _RUN_FOLDER.fullmatch(run_dir.name) or run_dir.is_symlink():
                continue
            mounts = _reap_folder(run_dir, min_age_s)
            if mounts is not None:
                reaped.append(run_dir.name)
                if unmounted is not None:
                    unmounted.append(mounts)
        if cache is None:
            try:
                root.rmdir()  # a cache's run folder with no sandbox left in it
            except OSError:
                pass
    remove_stale_empty_cgroups(min_age_s)
    return reaped
