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
import stat
import warnings
from pathlib import Path

from sandboxes.cache import LayerCache, Lease
from sandboxes.errors import SandboxError
from sandboxes.images import WORKDIR

# a sandbox's devices (bwrap --dev's list): name, major, minor
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))
DEVICE_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                ("stderr", "/proc/self/fd/2"), ("core", "/proc/kcore"), ("ptmx", "pts/ptmx"))

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
        os.mkdir(f"{rw}")
        if os.geteuid() == 0:
            mount("tmpfs", rw, "tmpfs", f"size={disk_mib}m,mode=0755")
            self.mounted.append(rw)
            os.mkdir(f"{rw}/upper")
            os.mkdir(f"{rw}/work")
            lower = ":".join(str(d) for d in reversed(lease.layer_dirs))  # overlayfs lists the top layer first
            mount("overlay", self.merged, "overlay", f"lowerdir={lower},upperdir={rw}/upper,workdir={rw}/work")
            self.mounted.append(self.merged)
        else:
            warnings.warn("not root: the sandbox root is a copy of its layers and the disk limit is not enforced")
            for d in lease.layer_dirs:
                shutil.copytree(d, self.merged, symlinks=True, dirs_exist_ok=True)

    def device_folder(self) -> Path:
        """The sandbox's ``/dev``, made here on its writable layer's tmpfs (mounted without
        ``nodev``): the character devices bwrap's ``--dev`` binds from the host (null, zero, full,
        random, urandom, tty, made by ``mknod`` with the same numbers), its symbolic links (``fd``,
        ``stdin``, ``stdout``, ``stderr``, ``core``, ``ptmx``), ``shm`` (mode 1777, on the disk
        limit's tmpfs) and ``pts``, a new devpts instance of this sandbox alone. bwrap binds this
        one folder (``--dev-bind``) where ``--dev`` made a tmpfs and mounted seven things in it,
        each bind re-reading the mount table: about 1.5 ms of a start's CPU (docs/benchmarks.md,
        "Issue 55, third session"). Per sandbox, never shared: its ``shm`` and ``pts`` are the
        sandbox's own and go with its layer. Only the devices listed exist here: the sandbox user
        cannot make others (``mknod`` needs a capability of the host's user namespace)."""
        if not self.mounted:
            raise SandboxError("a device folder needs the sandbox's own tmpfs (root rights)")
        dev = f"{self.run_dir}/rw/dev"
        os.mkdir(dev, 0o755)
        fd = os.open(dev, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # os calls on names: 16 of them
        try:
            for name, major, minor in DEVICES:
                os.mknod(name, stat.S_IFCHR | 0o666, os.makedev(major, minor), dir_fd=fd)
                os.chmod(name, 0o666, dir_fd=fd)  # the umask took bits off
            for name, target in DEVICE_LINKS:
                os.symlink(target, name, dir_fd=fd)
            os.mkdir("shm", dir_fd=fd)
            os.chmod("shm", 0o1777, dir_fd=fd)
            os.mkdir("pts", dir_fd=fd)
        finally:
            os.close(fd)
        # bwrap's own options for it; the pty's owner is whoever opens ptmx (the sandbox user)
        mount("devpts", Path(dev, "pts"), "devpts", "newinstance,ptmxmode=0666,mode=620")
        self.mounted.append(Path(dev, "pts"))
        return Path(dev)

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


_cache_hashes: dict[str, str] = {}
_prepared_roots: set[Path] = set()


def run_root(cache: LayerCache, create: bool = True) -> Path:
    """The folder of this cache's running sandboxes: ``$POSTTRAIN_SANDBOX_RUN_DIR`` (default
    ``/tmp/posttrain-sandboxes``) ``/<hash of the cache folder>``, mode 0711, so that bwrap, which runs
    as the sandbox user, can reach a sandbox's root wherever the cache itself lives."""
    base = run_base()
    key = str(cache.root)
    if key not in _cache_hashes:  # resolve() is a system call a component: once per cache folder
        _cache_hashes[key] = hashlib.sha256(str(cache.root.resolve()).encode()).hexdigest()[:12]
    root = base / _cache_hashes[key]
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
    for attempt in range(100):
        root = run_root(cache, create=False)
        if attempt or root not in _prepared_roots:  # made, and its mode set, once a process or when missing
            root = run_root(cache)
            _prepared_roots.add(root)
        folder = root / name
        try:
            folder.mkdir()
            return folder
        except FileNotFoundError:
            continue
    raise OSError(f"could not create the sandbox run folder {folder}: its parent keeps being removed")
