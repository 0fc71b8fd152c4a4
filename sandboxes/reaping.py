"""What sandboxes of dead owners leave behind, removed.

A harness killed with SIGKILL cannot close its sandboxes: their processes, cgroups, mounts and run
folders stay. :func:`reap_stale_sandboxes` finds them by the run folder's lock (a live sandbox holds
it for its whole life) and removes them; :func:`sandboxes.runtimes.start` calls it once per process
and cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time

from sandboxes.cache import LayerCache
from sandboxes.cgroups import Cgroup, remove_stale_empty_cgroups
from sandboxes.rootfs import run_root, umount


def reap_stale_sandboxes(cache: LayerCache, min_age_s: float = 60.0) -> list[str]:
    """Remove what sandboxes of dead owners left (a harness killed with SIGKILL cannot clean up):
    their processes (by cgroup), mounts and run folders. A live sandbox holds the lock in its run
    folder, so this is safe while other processes run sandboxes from the same cache."""
    reaped = []
    root = run_root(cache, create=False)
    for run_dir in (root.iterdir() if root.is_dir() else ()):
        lock = run_dir / "lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            try:  # a folder being created right now has no lock yet; only old ones are debris
                if time.time() - run_dir.stat().st_mtime < min_age_s:
                    continue
            except FileNotFoundError:
                continue
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
            Cgroup.existing(run_dir.name).remove()
            for mount in (run_dir / "root", run_dir / "rw"):
                umount(mount)
            shutil.rmtree(run_dir, ignore_errors=True)
            reaped.append(run_dir.name)
        finally:
            if fd is not None:
                os.close(fd)
    remove_stale_empty_cgroups(min_age_s)
    return reaped
