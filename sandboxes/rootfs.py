"""A sandbox's root on the host: its run folder, and the overlay of its image's layers.

Each running sandbox has a run folder under :func:`run_root`; :class:`Rootfs` mounts there an
overlay of the image's cached, read-only layers under a writable layer on a tmpfs of the sandbox's
disk limit. :func:`mount`, :func:`umount` and :func:`bind_read_only` are the mount calls the
sandboxes make (``mount(2)`` through libc: no ``mount`` binary needed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import warnings
from pathlib import Path

from sandboxes.cache import LayerCache, Lease
from sandboxes.errors import SandboxError
from sandboxes.images import WORKDIR

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MNT_DETACH = 2


def mount(source: str, target: Path, fstype: str, options: str) -> None:
    if _LIBC.mount(source.encode(), str(target).encode(), fstype.encode(), 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"mount {fstype} on {target} failed: {os.strerror(err)} (options {options})")


def umount(target: Path) -> None:
    if _LIBC.umount2(str(target).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise SandboxError(f"umount {target} failed: {os.strerror(err)}")


def bind_read_only(source: str, target: Path) -> None:
    """Bind ``source`` at ``target`` (an existing folder), then make that mount read-only."""
    MS_BIND, MS_REMOUNT, MS_RDONLY = 4096, 32, 1
    if _LIBC.mount(source.encode(), str(target).encode(), None, MS_BIND, None) != 0:
        raise SandboxError(f"cannot bind {source} at {target}: {os.strerror(ctypes.get_errno())}")
    if _LIBC.mount(b"none", str(target).encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None) != 0:
        raise SandboxError(f"cannot make {target} read-only: {os.strerror(ctypes.get_errno())}")


class Rootfs:
    """The per-sandbox root: an overlay of the image's cached layers under a size-limited tmpfs.

    Without root rights (no mounts) the layers are copied instead and the disk limit is not enforced."""

    def __init__(self, run_dir: Path, lease: Lease, disk_mib: int):
        self.run_dir = run_dir
        self.merged = run_dir / "root"
        self.mounted: list[Path] = []
        rw = run_dir / "rw"
        self.merged.mkdir(parents=True)
        rw.mkdir()
        if os.geteuid() == 0:
            mount("tmpfs", rw, "tmpfs", f"size={disk_mib}m,mode=0755")
            self.mounted.append(rw)
            (rw / "upper").mkdir()
            (rw / "work").mkdir()
            lower = ":".join(str(d) for d in reversed(lease.layer_dirs))  # overlayfs lists the top layer first
            mount("overlay", self.merged, "overlay", f"lowerdir={lower},upperdir={rw}/upper,workdir={rw}/work")
            self.mounted.append(self.merged)
        else:
            warnings.warn("not root: the sandbox root is a copy of its layers and the disk limit is not enforced")
            for d in lease.layer_dirs:
                shutil.copytree(d, self.merged, symlinks=True, dirs_exist_ok=True)

    @property
    def workspace(self) -> Path:
        return self.merged / WORKDIR.lstrip("/")

    def remove(self) -> None:
        for m in reversed(self.mounted):
            umount(m)
        self.mounted = []
        shutil.rmtree(self.run_dir, ignore_errors=True)


def run_base() -> Path:
    """``$POSTTRAIN_SANDBOX_RUN_DIR``, default ``/tmp/posttrain-sandboxes``: where every sandbox's run
    folder and the toolchain's bind mounts live on this host."""
    return Path(os.environ.get("POSTTRAIN_SANDBOX_RUN_DIR", "/tmp/posttrain-sandboxes"))


def run_root(cache: LayerCache, create: bool = True) -> Path:
    """The folder of this cache's running sandboxes: ``$POSTTRAIN_SANDBOX_RUN_DIR`` (default
    ``/tmp/posttrain-sandboxes``) ``/<hash of the cache folder>``, mode 0711, so that bwrap, which runs
    as the sandbox user, can reach a sandbox's root wherever the cache itself lives."""
    base = run_base()
    root = base / hashlib.sha256(str(cache.root.resolve()).encode()).hexdigest()[:12]
    if not create:
        return root
    for d in (base, root):
        try:
            d.mkdir(parents=True)
        except FileExistsError:
            pass
        if os.geteuid() == 0:
            try:
                os.chmod(d, 0o711)
            except FileNotFoundError:
                pass  # removed meanwhile by the close of its last sandbox: make_run_dir makes it again
    return root


def make_run_dir(cache: LayerCache, name: str) -> Path:
    """Create the run folder ``name`` of a new sandbox under :func:`run_root`. The close of a cache's
    last sandbox removes the root when it is empty, so it can vanish between its creation and the
    new folder's: then it is made again."""
    for _ in range(100):
        folder = run_root(cache) / name
        try:
            folder.mkdir()
            return folder
        except FileNotFoundError:
            continue
    raise OSError(f"could not create the sandbox run folder {folder}: its parent keeps being removed")
