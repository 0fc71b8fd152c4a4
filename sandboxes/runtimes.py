"""Local sandbox runtimes: bubblewrap, gVisor (``runsc``), and an unisolated debug mode.

Every runtime starts the same way:

1. the image's layers are taken from the node-local :class:`~sandboxes.cache.LayerCache`
   (unpacked from the store on a miss);
2. the sandbox's root is an overlay of those read-only layers under a per-sandbox writable layer,
   which lives on a tmpfs of ``Limits.disk_mib`` (the disk limit) in the sandbox's run folder
   (:mod:`sandboxes.rootfs`);
3. the host's ``/usr`` is bound read-only into it (git, coreutils, ``python3`` with the standard
   library only), and a host toolchain only where the image or the caller declares one:
   nothing of posttrain's own environment otherwise (:mod:`sandboxes.toolchain`);
4. ``pxd`` starts as the sandbox's first process, on ``/usr/bin/python3``, speaking HTTP over its
   stdin/stdout pipes;
5. CPU, memory and process-count limits are a cgroup per sandbox (:mod:`sandboxes.cgroups`); the
   wall-time limit is a timer that ends the sandbox.

What a sandbox of a dead harness left behind is removed by :mod:`sandboxes.reaping`.

bubblewrap: ``bwrap --unshare-all`` (no network but a private loopback, own PID/IPC/UTS/user
namespaces, no further user namespaces), the root is read-only except ``/workspace``, ``/tmp`` and
``$HOME``. When the harness is root, bwrap itself runs as the sandbox user (uid 1000, no
capabilities, no supplementary groups: :mod:`sandboxes.launcher`, which also puts it in the
sandbox's cgroups before it makes the namespaces), so the sandbox's processes are an unprivileged host user even
outside their namespaces; their run folders live under ``/tmp/posttrain-sandboxes`` (mode 0711)
and a toolchain folder that user cannot reach (a Python under ``/root``) is bind-mounted read-only
there once. The task layer's files belong to uid 1000, so the workspace is the sandbox user's own.
Its ``/dev`` is a folder the host makes on the sandbox's own tmpfs (the devices of bwrap's
``--dev``, a ``shm`` folder held to the disk limit, a devpts instance of its own:
:meth:`sandboxes.rootfs.Rootfs.device_folder`), bound with one ``--dev-bind``; the image root
itself stays bound ``nodev``.

gVisor: an OCI bundle run with ``runsc --platform=ptrace --network=none
--file-access-mounts=exclusive run``: the sandbox's system
calls go to gVisor's user-space kernel, not the host's. The image root is read-only with
``/workspace`` bound writable. The ptrace platform is the one that works on these machines
(``--platform=kvm`` hangs), the sandbox user is uid 1000 too, and pxd's output is read through a
pipe (gVisor can lose output written to a regular file). ``scripts/setup.sh`` installs runsc 20240729
from bookworm-backports on Debian bookworm: against bookworm's own 20221219 a sandbox starts in about
a tenth less wall time and a command runs faster (``bench/gvisor_start.py``), and coreutils' ``ls
PATH``, ``ls -l`` and ``stat`` work (20221219 refused their statx call with "Invalid argument").

The answer channel: the host hands pxd a random key as the first line on its stdin and checks the
MAC on every answer (``sandboxes/pxd.py`` describes the protocol), and no command can reach the
pipes: pxd is the sandbox's PID 1 (bwrap ``--as-pid-1``, so no bwrap process stays inside holding
them) and non-dumpable, which keeps processes of its uid from tracing it, taking its descriptors
(``pidfd_getfd``, ``/proc/1/fd``) or signalling it (PID 1 of a namespace gets no signal from
inside that it has no handler for). Under gVisor, which delivers those signals, pxd runs as
gVisor's root with only the capabilities to start commands as the sandbox user and manage their
files (``PXD_GVISOR_CAPS``); the commands run as uid 1000 as before. bwrap cannot give pxd a uid
of its own cheaply: an unprivileged user namespace maps one uid, and a second one needs a
privileged uid map (bwrap as root), which would give up running bwrap as the unprivileged sandbox
user. :meth:`Sandbox.exec` passes ``results_fd`` (a results channel the command's output cannot
mix into) and ``kill_others`` (nothing the command left behind outlives the answer) to pxd.

A writable root (``writable_root=True``, for Harbor tasks whose verifier installs into the image's
environment: :func:`evals.tasks.needs_writable_root`): the root is left writable where the
sandbox user may write (the image's files it owns: a task's ``/opt/venv``), never the host
toolchain, which stays bound read-only over it. The writes land in the sandbox's own overlay
layer, on the tmpfs of its disk limit, and go with the sandbox: the cached layers and the next
sandbox of the image never see them. Without it (the default, and the bundled suite's path) the
root is read-only except ``/workspace``, ``/tmp`` and ``$HOME``.

How a sandbox's end is read (:meth:`Sandbox.end_cause`): once pxd has answered, a sandbox that
stops answering is either the host's doing (closed, its runtime killed from outside) or its own
(its wall-time, memory or process limit reached, its runtime ending by itself, gVisor's kernel
crashing). Every sandbox has a cgroup the host made, gVisor's too (runsc joins a cgroup that
exists without changing it or removing it), so what the kernel counted against its limits since
pxd last answered (:class:`sandboxes.cgroups.LimitEvents`) can be read after the runtime is gone.
Under gVisor with ``--platform=ptrace`` each process of the sandbox costs about ten host tasks
(gVisor's threads and stub processes; measured with runsc 20240729 on 2 cores: 30 host tasks idle,
167 with 10 sleeping processes, 337 with 30; 20221219 beside it: 37, 163 and 360), so a fork bomb
reaches the host side's ``Limits.pids + GVISOR_PIDS_HEADROOM`` (about 30 processes with the
defaults) long before gVisor's own RLIMIT_NPROC of ``Limits.pids``: gVisor's kernel cannot make a
thread and exits, and ``pids.events`` shows the refused forks. :mod:`evals.sandbox` turns an end of
the sandbox's own doing into an error the harness scores as the agent's.

unisolated: pxd runs as a plain host process on the overlay's workspace. It isolates nothing, so
it runs only with ``allow_unisolated=True``; nothing ever falls back to it.
"""


from __future__ import annotations

import fcntl
import hashlib
import json
import os
import py_compile
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from sandboxes.home import default_home
from sandboxes.cache import LayerCache, Lease, cache_budget_bytes, node_cache
from sandboxes.cgroups import Cgroup, LimitEvents, remove_empty_cgroups
from sandboxes.client import ExecResult, PxdClient, PxdConnectionError
from sandboxes.errors import SandboxError
from sandboxes.launcher import launch_argv
from sandboxes.images import SANDBOX_UID, WORKDIR, Image, ImageError, ImageStore, build_image, image_name
from sandboxes.programs import shipped_digest, shipped_source
from sandboxes.reaping import reap_stale_sandboxes
from sandboxes.rootfs import Rootfs, make_run_dir, run_base, run_root
from sandboxes.toolchain import (
    SANDBOX_HOME, SANDBOX_PYTHON, check_toolchains, host_toolchain, reachable_toolchain_source, sandbox_env,
)

RUNTIMES = ("bwrap", "gvisor", "unisolated")
PXD_SOURCE = Path(__file__).with_name("pxd.py")
PXD_COMPILED_IN_SANDBOX = "/opt/pxd/pxd.pyc"  # what the local runtimes write and start (a cluster pod starts
# the image's /opt/pxd/pxd.py: sandboxes.images, sandboxes.k8s)
PXD_SOURCE_IN_SANDBOX = "/opt/pxd/pxd.py"  # the file name a traceback of the compiled daemon shows
_compile_lock = threading.Lock()


_interpreter_tags: dict[str, str] = {}


def _cache_tag(python: str) -> str:
    """``sys.implementation.cache_tag`` of the interpreter ``python`` (asked once per process), with a
    hash of its version line: two builds of one minor version may not share bytecode."""
    if python not in _interpreter_tags:
        if python == sys.executable:
            _interpreter_tags[python] = f"{sys.implementation.cache_tag}-{hashlib.sha256(sys.version.encode()).hexdigest()[:8]}"
        else:
            try:
                out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.implementation.cache_tag); "
                                      "print(sys.version)"], capture_output=True, text=True, timeout=60, check=True)
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxError(f"the sandbox's interpreter {python} does not run ({exc}); it runs pxd, so the "
                                   "host needs Python 3 in /usr (Debian package python3-minimal)") from None
            tag, version = out.stdout.split("\n", 1)
            _interpreter_tags[python] = f"{tag}-{hashlib.sha256(version.strip().encode()).hexdigest()[:8]}"
    return _interpreter_tags[python]


def _source_digest() -> str:
    """The first 16 hex digits of the SHA-256 of pxd as shipped (:func:`sandboxes.programs.shipped_digest`:
    ``pxd.py`` with ``standalone.py`` written into it), hashed again only when either file changed
    (every sandbox's start asks)."""
    return shipped_digest(PXD_SOURCE)[:16]


def compiled_pxd(python: str = SANDBOX_PYTHON) -> Path:
    """pxd as shipped (:func:`sandboxes.programs.shipped_source`) compiled by ``python``, the interpreter the runtime starts it with (the sandbox's
    own ``/usr/bin/python3``; the unisolated mode: this one), kept under
    the run base's ``pxd/`` folder and named by the source's hash. Starting the ``.pyc`` skips
    compiling the daemon's 1,100 lines, about a fifth of the CPU a start costs, and two sandboxes
    start per episode (docs/benchmarks.md, "pxd's start"). Written once per source and interpreter,
    atomically, mode 0644 in folders of mode 0711; a file there that this user did not write, or
    that others may write, is replaced. Each sandbox gets a copy in its own layer (:func:`_install_pxd`)."""
    folder = run_base() / "pxd"
    path = folder / f"pxd-{_source_digest()}.{_cache_tag(python)}.pyc"
    with _compile_lock:
        try:
            st = path.lstat()
            if path.is_file() and not path.is_symlink() and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
                return path
        except FileNotFoundError:
            pass
        for d in (folder.parent, folder):
            d.mkdir(exist_ok=True)
            if d.stat().st_uid == os.geteuid():
                os.chmod(d, 0o711)
        tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}"
        source = tmp.with_name(tmp.name + ".py")  # the one file a sandbox runs, compiled from beside the .pyc
        source.write_bytes(shipped_source(PXD_SOURCE))
        try:
            # the hash in the name ties the file to its source: no check against the source at start
            if python == sys.executable:
                py_compile.compile(str(source), cfile=str(tmp), dfile=PXD_SOURCE_IN_SANDBOX, doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            else:  # bytecode is the interpreter's own: compiled by the one that runs it
                subprocess.run([python, "-I", "-S", "-c", "import py_compile, sys; py_compile.compile(sys.argv[1], "
                                "cfile=sys.argv[2], dfile=sys.argv[3], doraise=True, invalidation_mode="
                                "py_compile.PycInvalidationMode.UNCHECKED_HASH)", str(source), str(tmp),
                                PXD_SOURCE_IN_SANDBOX], check=True, capture_output=True, timeout=120)
        finally:
            source.unlink(missing_ok=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return path
READY_TIMEOUT_S = 30.0
# pxd's capabilities in gVisor (none reach a command: they are dropped when it becomes the
# sandbox user): start commands as that user, signal them (kill_others), and write the sandbox
# user's files and folders (the workspace is theirs) giving new ones to them
PXD_GVISOR_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
GVISOR_OVERHEAD_MIB = 128  # memory for the gVisor sentry and gofer, added to a sandbox's limit
# host processes and threads for gVisor's own threads and, on ptrace, its stub processes, added to a
# sandbox's pids limit (the sandbox's own tasks are held to ``Limits.pids`` by RLIMIT_NPROC inside)
GVISOR_PIDS_HEADROOM = 128
# a runtime's exit status when the sandbox's first process or gVisor's kernel got SIGKILL
_SIGKILLED_STATUS = 128 + signal.SIGKILL


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. Defaults live here and nowhere else."""

    cpus: float = 1.0
    memory_mib: int = 1024
    pids: int = 256
    disk_mib: int = 1024  # the writable layer (workspace changes); /tmp and $HOME count as memory
    tmp_mib: int = 256
    wall_s: float = 3600.0

    def __post_init__(self):
        for name, low in (("cpus", 0.01), ("memory_mib", 16), ("pids", 8), ("disk_mib", 1), ("tmp_mib", 1),
                          ("wall_s", 0.1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ValueError(f"Limits.{name} must be a number >= {low}, got {value!r}")


def _wait_eof(stream, timeout_s: float) -> None:
    """Wait until ``stream`` (a pipe from the runtime) is closed: the runtime has exited."""
    deadline = time.monotonic() + timeout_s
    fd = stream.fileno()
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready and not os.read(fd, 65536):
            return


_pxd_images: dict[tuple[str, str], bytes] = {}  # by pxd.py's digest and the interpreter's tag


def _install_pxd(root: Path) -> None:
    """Write the compiled daemon (:func:`compiled_pxd`) into the sandbox's own layer at
    ``PXD_COMPILED_IN_SANDBOX``, owned by root, mode 0644: the sandbox user can neither change nor
    replace it (``/opt/pxd`` is root's in every image). A write of some 50 KB to the sandbox's
    tmpfs in place of a bind mount: one mount less for bwrap, one gofer mount less for gVisor
    (docs/benchmarks.md, "Issue 55, third session"). Each folder on the way is opened without
    following a symbolic link: the image's tree is not the host's to write through."""
    # the bytes are kept once read: the file is not looked at again while pxd.py stays the same
    key = (_source_digest(), _cache_tag(SANDBOX_PYTHON))
    data = _pxd_images.get(key)
    if data is None:
        data = _pxd_images[key] = compiled_pxd().read_bytes()
    fds = []
    try:
        fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        *folders, name = PXD_COMPILED_IN_SANDBOX.strip("/").split("/")
        for folder in folders:
            try:
                os.mkdir(folder, 0o755, dir_fd=fds[-1])
            except FileExistsError:
                pass
            fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=fds[-1])
        except FileExistsError:  # the image's own file there: replaced
            os.unlink(name, dir_fd=fds[-1])
            fd = os.open(name, flags, 0o644, dir_fd=fds[-1])
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        raise SandboxError(f"cannot write the daemon at {PXD_COMPILED_IN_SANDBOX} in the sandbox's root "
                           f"({exc}); the image's /opt/pxd must be a folder") from None
    finally:
        for fd in fds:
            os.close(fd)


def pxd_argv(python: str) -> list[str]:
    return [python, "-I", "-S", PXD_COMPILED_IN_SANDBOX, "--workspace", WORKDIR, "--stdio"]


# ---------------------------------------------------------------------------------------------
# runtimes


class Runtime(Protocol):
    """How a prepared root becomes a running sandbox with pxd on its stdin/stdout."""

    name: str

    def command(self, sb: "Sandbox") -> list[str]: ...

    def stop(self, sb: "Sandbox") -> None: ...


_found: dict[tuple[str, str | None], str] = {}


def _which(program: str) -> str | None:
    """``shutil.which(program)`` as an absolute path, kept once found for this ``$PATH`` (every start
    asks; one missing is looked for again)."""
    key = (program, os.environ.get("PATH"))
    path = _found.get(key)
    if path is None:
        path = shutil.which(program)
        if path is None:
            return None
        path = _found[key] = os.path.abspath(path)
    return path


class BwrapRuntime:
    name = "bwrap"

    def command(self, sb: "Sandbox") -> list[str]:
        bwrap = _which("bwrap")
        if bwrap is None:
            raise SandboxError("bwrap is not installed (Debian package 'bubblewrap'; scripts/setup.sh installs it)")
        root = sb.rootfs.merged
        argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--hostname", "sandbox", "--new-session", "--disable-userns",
                # pxd is the PID namespace's init: no bwrap process inside holds its pipes, and no
                # signal sent from inside reaches it
                "--as-pid-1",
                # and it dies with bwrap: a pxd whose bwrap was killed would otherwise live on,
                # re-parented to the host's init, answering on the sandbox's pipes
                "--die-with-parent",
                "--bind", str(root), "/", "--bind", str(sb.rootfs.workspace), WORKDIR,
                # the tmpfs folders before the toolchains: a toolchain under /tmp (a clone's venv) is
                # bound onto the sandbox's /tmp, not hidden under it
                "--size", str(sb.limits.tmp_mib * 1024 * 1024), "--tmpfs", "/tmp",
                "--size", str(sb.limits.tmp_mib * 1024 * 1024), "--tmpfs", SANDBOX_HOME]
        for path in host_toolchain(sb.toolchains):
            # mount points made here, in the sandbox's own layer: the sandbox user may not write there
            (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
            argv += ["--ro-bind", reachable_toolchain_source(path), path]
        _install_pxd(root)
        argv += ["--proc", "/proc"]
        # the sandbox's own /dev, made on its tmpfs by the host (Rootfs.device_folder): one bind
        # instead of bwrap's tmpfs and seven mounts; without root (no tmpfs of its own) bwrap's
        argv += ["--dev-bind", str(sb.rootfs.device_folder()), "/dev"] if sb.rootfs.mounted else ["--dev", "/dev"]
        if not sb.writable_root:
            argv += ["--remount-ro", "/"]
        argv += ["--clearenv"]
        for key, value in sb.env.items():
            argv += ["--setenv", key, value]
        return [*argv, "--chdir", WORKDIR, "--", *pxd_argv(SANDBOX_PYTHON)]

    def stop(self, sb: "Sandbox") -> None:
        pass  # the cgroup kill ends every process of the sandbox


class GvisorRuntime:
    name = "gvisor"
    platform = "ptrace"

    def command(self, sb: "Sandbox") -> list[str]:
        if shutil.which("runsc") is None:
            raise SandboxError("runsc is not installed (Debian package 'runsc'; scripts/setup.sh installs it)")
        bundle = sb.run_dir / "bundle"
        bundle.mkdir()
        _install_pxd(sb.rootfs.merged)
        (bundle / "config.json").write_text(json.dumps(self.oci_config(sb), indent=1))
        # --file-access-mounts=exclusive: gVisor caches what it read of the bind mounts (the host's
        # /usr and toolchains, the workspace) instead of asking the gofer again at every lookup; no
        # host process changes them while the sandbox runs (the harness writes the workspace through
        # pxd), and the cache is this sandbox's own. 12-13% of a start's CPU (docs/benchmarks.md,
        # "Issue 55, third session")
        return ["runsc", "--root", str(self.state_dir(sb)), f"--platform={self.platform}", "--network=none",
                "--file-access-mounts=exclusive", "run", "--bundle", str(bundle), sb.id]

    @staticmethod
    def state_dir(sb: "Sandbox") -> Path:
        return sb.run_dir / "runsc-state"

    def oci_config(self, sb: "Sandbox") -> dict:
        def ro(path, dest=None):
            return {"destination": dest or path, "type": "bind", "source": path, "options": ["rbind", "ro"]}

        limits = sb.limits
        tmp_opts = ["nosuid", "nodev", f"size={limits.tmp_mib}m"]
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmp_opts},
            {"destination": SANDBOX_HOME, "type": "tmpfs", "source": "tmpfs", "options": tmp_opts},
            *[ro(p) for p in host_toolchain(sb.toolchains)],
            {"destination": WORKDIR, "type": "bind", "source": str(sb.rootfs.workspace), "options": ["rbind", "rw"]},
        ]
        return {
            "ociVersion": "1.0.2",
            "process": {
                # pxd runs as gVisor's root with only the capabilities it needs to run commands as
                # the sandbox user and manage their files; gVisor delivers signals sent from inside
                # to its PID 1, so a different uid is what keeps commands from killing pxd
                "terminal": False, "user": {"uid": 0, "gid": 0},
                "args": [*pxd_argv(SANDBOX_PYTHON), "--command-uid", str(SANDBOX_UID)],
                "env": [f"{k}={v}" for k, v in sb.env.items()], "cwd": WORKDIR,
                "noNewPrivileges": True,
                "capabilities": {**{k: list(PXD_GVISOR_CAPS) for k in ("bounding", "effective", "permitted")},
                                 "inheritable": [], "ambient": []},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096},
                            {"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids}],
            },
            "root": {"path": str(sb.rootfs.merged), "readonly": not sb.writable_root},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                "cgroupsPath": f"/posttrain/{sb.id}",
                "resources": {
                    # the limit covers gVisor's own kernel too; give it room on top of the task's
                    "memory": {"limit": (limits.memory_mib + GVISOR_OVERHEAD_MIB) * 1024 * 1024},
                    "cpu": {"quota": max(1000, int(limits.cpus * 100_000)), "period": 100_000},
                    # gVisor's own threads and, on ptrace, its stub processes count as host pids. The
                    # host makes this cgroup itself before runsc starts (Sandbox), and runsc joins a
                    # cgroup that exists as it is: these figures are for the controllers it makes alone
                    "pids": {"limit": limits.pids + GVISOR_PIDS_HEADROOM},
                },
            },
        }

    def stop(self, sb: "Sandbox") -> None:
        state = str(self.state_dir(sb))
        subprocess.run(["runsc", "--root", state, "kill", sb.id, "KILL"], capture_output=True, timeout=30)
        subprocess.run(["runsc", "--root", state, "delete", "-force", sb.id], capture_output=True, timeout=30)


class UnisolatedRuntime:
    name = "unisolated"

    def command(self, sb: "Sandbox") -> list[str]:
        return [sys.executable, "-I", "-S", str(compiled_pxd(sys.executable)), "--workspace", str(sb.rootfs.workspace),
                "--stdio"]

    def stop(self, sb: "Sandbox") -> None:
        pass


RUNTIME_CLASSES = {"bwrap": BwrapRuntime, "gvisor": GvisorRuntime, "unisolated": UnisolatedRuntime}


# ---------------------------------------------------------------------------------------------
# the sandbox


def default_store() -> ImageStore:
    """``$POSTTRAIN_SANDBOX_DIR/images``, else ``$POSTTRAIN_HOME/images`` (where ``image_cache`` builds)."""
    if os.environ.get("POSTTRAIN_SANDBOX_DIR"):
        return ImageStore(Path(os.environ["POSTTRAIN_SANDBOX_DIR"]) / "images")
    return ImageStore(default_home() / "images")


def default_cache() -> LayerCache:
    """``$POSTTRAIN_SANDBOX_DIR/cache``, else ``$POSTTRAIN_HOME/sandboxes/cache``; the budget is
    ``$POSTTRAIN_SANDBOX_CACHE_GIB`` (default 20 GiB)."""
    if os.environ.get("POSTTRAIN_SANDBOX_DIR"):
        return LayerCache(Path(os.environ["POSTTRAIN_SANDBOX_DIR"]) / "cache", cache_budget_bytes())
    return node_cache()


@dataclass(frozen=True)
class SandboxEnd:
    """Why a started sandbox stopped answering, or could not start a command, as far as the host can
    tell (:meth:`Sandbox.end_cause`, :meth:`Sandbox.limits_reached`).

    ``cause`` is a stable name: ``wall_time`` (its wall-time limit), ``memory_limit`` (its cgroup's
    OOM killer fired at its memory limit), ``pids_limit`` (forks refused at its process limit),
    ``killed_from_inside`` (its first process or kernel ended by a signal other than SIGKILL),
    ``runtime_exited`` (the runtime ended on its own), ``unresponsive`` (the runtime runs, its
    daemon does not answer), ``killed_from_host`` (the runtime, or the sandbox's first process or
    kernel, got SIGKILL with no OOM kill at the limit: only the host sends that), ``closed`` (the
    host closed it). ``inside``: the sandbox's own processes did it (its limits, its runtime ending
    on its own), so whoever ran code there caused it. ``evidence`` says what the host saw: the
    runtime's exit status and what its cgroup counted (:class:`sandboxes.cgroups.LimitEvents`)."""

    cause: str
    inside: bool
    evidence: str


class Sandbox:
    """A running sandbox. Talk to it through :attr:`pxd` (the full client) or the shortcuts below;
    :meth:`close` (or leaving the ``with`` block) removes it and everything it wrote."""

    def __init__(self, image: Image, runtime: str, limits: Limits, store: ImageStore, cache: LayerCache,
                 env: dict[str, str] | None = None, writable_root: bool = False, toolchains=()):
        self.id = f"pt-{uuid.uuid4().hex[:12]}"
        self.image = image
        self.limits = limits
        self.writable_root = writable_root
        self.runtime = RUNTIME_CLASSES[runtime]()
        # the host toolchains the image declares, and those the caller adds (sandboxes.toolchain)
        self.toolchains = tuple(dict.fromkeys(check_toolchains((*image.toolchains, *toolchains))))
        self.env = sandbox_env(env, self.toolchains)
        self.run_dir = run_root(cache, create=False) / self.id
        self.proc: subprocess.Popen | None = None
        self.cgroup: Cgroup | None = None
        self.rootfs: Rootfs | None = None
        self.closed = False
        self.expired = False
        self._lock = threading.Lock()
        self._removed = threading.Event()
        started = time.perf_counter()
        # CPU seconds of the starting (then closing) thread per step: what a start and a stop cost
        # the harness's process, read by bench/sandbox_start.py
        self.host_cpu_s: dict[str, float] = {}
        self._cpu_mark = time.thread_time()
        # held for the sandbox's life: a run folder whose lock is free belongs to a dead owner. Taken
        # under another name and then renamed, so that no reaper finds a ``lock`` not yet held
        self.run_dir = make_run_dir(cache, self.id)
        self._run_lock = os.open(self.run_dir / "lock.new", os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._run_lock, fcntl.LOCK_EX)
        os.rename(self.run_dir / "lock.new", self.run_dir / "lock")
        self.lease: Lease | None = None
        try:
            self._step("run_dir")
            self.lease = cache.acquire(image, store)
            self.cache_hit = self.lease.hit
            self._step("layers")
            self.rootfs = Rootfs(self.run_dir, self.lease, limits.disk_mib)
            self._step("rootfs")
            argv = self.runtime.command(self)
            self._step("command")
            if runtime == "gvisor":
                # made here, not by runsc: runsc joins a cgroup that exists without changing or
                # removing it, so the host owns it and reads, even after runsc crashed, what its
                # limits stopped (end_cause); runsc puts its sandbox and gofer in it
                self.cgroup = Cgroup(self.id, cpus=limits.cpus, memory_mib=limits.memory_mib + GVISOR_OVERHEAD_MIB,
                                     pids=limits.pids + GVISOR_PIDS_HEADROOM)
            else:
                self.cgroup = Cgroup(self.id, cpus=limits.cpus, memory_mib=limits.memory_mib, pids=limits.pids)
                # started in its cgroups and, bwrap under a root harness, as the sandbox user with no
                # capabilities: so the sandbox's processes are an unprivileged host user too (uid 1000
                # inside maps to uid 1000 outside), not root without capabilities (sandboxes.launcher)
                user = (SANDBOX_UID, SANDBOX_UID) if runtime == "bwrap" and os.geteuid() == 0 else None
                argv = launch_argv(argv, self.cgroup.procs_files, user)
            self._step("cgroup")
            # bwrap stays in the sandbox as its pid 1, whose /proc/1/environ the sandbox can read:
            # start it with the sandbox's variables only, never the host's (tokens, keys).
            host_env = dict(self.env) if runtime == "bwrap" else None
            if runtime == "unisolated":  # the sandbox's variables, with a home folder of its own
                home = self.run_dir / "home"
                home.mkdir()
                host_env = {**self.env, "HOME": str(home), "TMPDIR": str(home)}
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True, close_fds=True, env=host_env)
            try:
                # the key goes out here: a runtime whose set-up failed has closed its stdin already
                self.pxd = PxdClient.over_fds(self.proc.stdout.fileno(), self.proc.stdin.fileno(),
                                              name=f"pxd[{self.id}]")
                self.pxd.explain_loss = self.why_gone
                self._step("spawn")
                self.pxd.wait_ready(READY_TIMEOUT_S)
            except PxdConnectionError as exc:
                raise SandboxError(f"{runtime} sandbox for image {image.name} did not start: {exc}; "
                                   f"stderr: {self._stderr_tail()}") from None
            # what the cgroup had counted when the daemon last answered: end_cause reads what
            # happened after it
            self._answered = self._limit_events()
            self._step("ready")
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - started
        self._timer = threading.Timer(limits.wall_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _step(self, name: str) -> None:
        """Charge the thread's CPU since the last step to ``name`` (:attr:`host_cpu_s`)."""
        now = time.thread_time()
        self.host_cpu_s[name] = self.host_cpu_s.get(name, 0.0) + now - self._cpu_mark
        self._cpu_mark = now

    def _stderr_tail(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.stderr.read()[-2000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def _limit_events(self) -> LimitEvents:
        return self.cgroup.limit_events() if self.cgroup is not None else LimitEvents()

    def why_gone(self) -> str:
        """Why the sandbox stopped answering, as far as the host can tell (:meth:`end_cause`'s evidence)."""
        end = self.end_cause(wait_s=2.0)
        return end.evidence if end is not None else ""

    def limits_reached(self) -> SandboxEnd | None:
        """``memory_limit`` or ``pids_limit`` when, since its daemon last answered, the sandbox's
        cgroup killed a process at its memory limit or refused a fork at its process limit (its
        daemon may then be unable to start a command); None when it counted neither."""
        return self._reached(self._limit_events().since(getattr(self, "_answered", None)))

    def _reached(self, events: LimitEvents) -> SandboxEnd | None:
        gvisor = self.runtime.name == "gvisor"
        if events.memory_limit_kills:
            extra = f" + {GVISOR_OVERHEAD_MIB} MiB for gVisor" if gvisor else ""
            return SandboxEnd("memory_limit", True, f"the sandbox reached its memory limit "
                              f"({self.limits.memory_mib} MiB{extra}); its cgroup counted: {events.describe()}")
        if events.pids_max:
            extra = f" + {GVISOR_PIDS_HEADROOM} host tasks for gVisor's threads and stubs" if gvisor else ""
            return SandboxEnd("pids_limit", True, f"the sandbox reached its process limit "
                              f"({self.limits.pids}{extra}); its cgroup counted: {events.describe()}")
        return None

    def end_cause(self, wait_s: float = 5.0) -> SandboxEnd | None:
        """Why the sandbox stopped answering (:class:`SandboxEnd`); None while its daemon's
        connection is open (it still answers).

        Read in this order: the wall-time limit; a close by the host; then, after waiting up to
        ``wait_s`` for the runtime to exit, what the cgroup counted since the daemon last answered
        (an OOM kill at the memory limit, forks refused at the process limit: the sandbox ran into
        its own limits, whatever the runtime did next, gVisor's kernel crashing included); then the
        runtime's exit. A runtime that ended by a signal, or reports SIGKILL of the sandbox's first
        process or of gVisor's kernel, was killed from the host: nothing inside can signal the
        runtime, pxd (PID 1, or another uid under gVisor) or gVisor's kernel (a host process).
        Any other exit is the sandbox's own doing: pxd ends only when the host closes its stdin.
        A runtime still running with a daemon that does not answer is ``unresponsive``, inside
        when its cgroup was at its CPU quota or memory limit meanwhile (the daemon shares them
        with the sandbox's processes), else the host's (an overloaded machine)."""
        if self.expired:
            self._removed.wait(60)
            return SandboxEnd("wall_time", True,
                              f"the sandbox reached its wall-time limit of {self.limits.wall_s:g} s and was removed")
        if self.closed:
            return SandboxEnd("closed", False, "the sandbox was closed")
        pxd = getattr(self, "pxd", None)
        if self.proc is None or pxd is None or not pxd.closed:
            return None
        try:
            code = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        events = self._limit_events().since(getattr(self, "_answered", None))
        name = self.runtime.name
        status = (f"the {name} runtime exited with code {code}" if code is not None
                  else f"the {name} runtime is still running but its daemon does not answer")
        evidence = f"{status}; since the daemon last answered its cgroup counted: {events.describe()}"
        reached = self._reached(events)
        if reached is not None:
            return SandboxEnd(reached.cause, True, f"{status}; {reached.evidence}")
        if code is None:
            return SandboxEnd("unresponsive", events.cpu_throttled > 0 or events.memory_max > 0, evidence)
        if code < 0:
            return SandboxEnd("killed_from_host", False, f"{evidence} (the runtime itself got signal {-code}: "
                              "sent from the host)")
        if code == _SIGKILLED_STATUS:
            return SandboxEnd("killed_from_host", False, f"{evidence} (SIGKILL of the sandbox's first process or "
                              "kernel with no OOM kill at its limit: sent from the host)")
        if code > 128:
            return SandboxEnd("killed_from_inside", True, f"{evidence} (signal {code - 128} inside the sandbox)")
        return SandboxEnd("runtime_exited", True, f"{evidence} (it ended on its own, not closed by the host)")

    def _expire(self) -> None:
        self.expired = True
        self.close()

    # -- the evals-facing shortcuts ---------------------------------------------------------------

    def exec(self, command: str | list[str], *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
             cwd: str | None = None, env: dict[str, str] | None = None, results_fd: int | None = None,
             kill_others: bool = False) -> ExecResult:
        """Run a shell string (``/bin/sh -c``) or an argv list in the workspace; stdout and stderr are
        merged into ``stdout`` (and ``output``), capped to the first and last ``output_cap_bytes / 2``.

        ``results_fd`` (3..9): what the command writes to that descriptor comes back as ``results``
        (up to 1 MiB, ``results_truncated`` beyond), on a channel the command's output cannot mix
        into. ``kill_others``: after the command ends, every other process of the sandbox is killed
        before the answer is made, so nothing it left behind writes to results or files later."""
        result = self.pxd.run(command, timeout_s=timeout_s, output_cap_bytes=output_cap_bytes, cwd=cwd, env=env,
                              results_fd=results_fd, kill_others=kill_others)
        self._answered = self._limit_events()
        return result

    def read_file(self, path: str) -> bytes:
        data = self.pxd.read_file(path)
        self._answered = self._limit_events()
        return data

    def write_file(self, path: str, data: bytes | str) -> None:
        self.pxd.write_file(path, data)
        self._answered = self._limit_events()

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self.closed:
                self._removed.wait(60)  # another thread (the wall-time timer) is removing it
                return
            self.closed = True
        try:
            self._remove()
        finally:
            self._removed.set()

    def _remove(self) -> None:
        self._cpu_mark = time.thread_time()
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
        proc = self.proc
        if proc is not None:
            if self.cgroup is not None:
                # no grace needed: the sandbox's files go away with it. Killed before its stdin
                # closes, so that pxd does not wake to run the interpreter's exit, nor gVisor's
                # kernel its shut-down, for a sandbox that is thrown away (gVisor: its kernel,
                # gofer and stubs are in the cgroup; `runsc run` is killed below, its state folder
                # goes with the run folder)
                self.cgroup.kill()
            try:
                proc.stdin.close()  # pxd sees EOF and exits (gVisor: the sandbox then shuts down)
            except OSError:
                pass
            if self.runtime.name == "gvisor" and self.cgroup is None:
                _wait_eof(proc.stdout, 3.0)
                if proc.poll() is None:
                    try:
                        self.runtime.stop(self)
                    except (OSError, subprocess.SubprocessError):
                        pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
        self._step("stop")
        if self.cgroup is not None:
            self.cgroup.remove()  # under gVisor too: what a crashed runsc left running in it goes
        if self.runtime.name == "gvisor":
            remove_empty_cgroups(self.id)  # the controllers runsc made itself, left behind when it is killed
        self._step("cgroup_remove")
        if self.rootfs is not None:
            self.rootfs.remove()
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.lease is not None:
            self.lease.release()
        os.close(self._run_lock)
        try:
            self.run_dir.parent.rmdir()  # the cache's run folder, when this was its last sandbox
        except OSError:
            pass
        self._step("rootfs_remove")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<Sandbox {self.id} {self.runtime.name} image={self.image.name} {state}>"


_reaped_caches: set[Path] = set()
_folder_images: "OrderedDict[tuple[str, str], Image]" = OrderedDict()
_folder_images_lock = threading.Lock()


def _folder_signature(path: Path) -> str:
    """What a folder holds, as far as a rebuild would see it changed: every entry's name (relative to
    the folder), device, inode, size, mode and modification and change times (a write changes the
    change time, which no user can set; a copy has new inodes). Not the folder's own path: a folder
    renamed (a suite built in a temporary folder, then moved into place) holds what it held, and
    its entries keep their inodes and times. About an eighth of the CPU of tarring and hashing the
    folder again."""
    digest = hashlib.sha256()
    top = len(str(path))
    for folder, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted((*dirs, *files)):
            st = os.lstat(os.path.join(folder, name))
            digest.update(f"{folder[top:]}/{name}\0{st.st_dev} {st.st_ino} {st.st_size} {st.st_mode} "
                          f"{st.st_mtime_ns} {st.st_ctime_ns}\n".encode())
    return digest.hexdigest()


def _folder_image(path: Path, store: ImageStore) -> Image:
    """The image of a repository folder (built on the fly, content addressed), built again only when
    the folder's files changed since this process last built it (:func:`_folder_signature`): an
    episode and its grading start from the same task folder many times, and a folder renamed
    keeps its image (named anew for its path)."""
    name = "dir-" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    key = (_folder_signature(path), str(store.root))
    with _folder_images_lock:
        known = _folder_images.get(key)
        if known is not None and all(store.blob_path(l).exists() for l in known.layers):
            _folder_images.move_to_end(key)
            if known.name == name:
                return known
    if known is not None and all(store.blob_path(l).exists() for l in known.layers):
        image = replace(known, name=name)  # the same layers under the name of the folder's new path
        store.save_image(image)
    else:
        image = build_image(name, path, store)
    with _folder_images_lock:
        _folder_images[key] = image
        while len(_folder_images) > 4096:
            _folder_images.popitem(last=False)
    return image


def start(source: Image | str | os.PathLike, *, runtime: str = "bwrap", limits: Limits | None = None,
          store: ImageStore | None = None, cache: LayerCache | None = None, env: dict[str, str] | None = None,
          allow_unisolated: bool = False, writable_root: bool = False, toolchains=()) -> Sandbox:
    """Start a sandbox from an :class:`Image`, a task id or image name in ``store``, or a repository folder.

    A folder is built into an image on the fly (content addressed: the same files reuse the cached
    layer). ``runtime="unisolated"`` needs ``allow_unisolated=True``; nothing falls back to it.
    ``writable_root``: the image's files the sandbox user owns are writable outside ``/workspace``
    too, in the sandbox's own layer (the module docstring says what stays read-only). ``toolchains``:
    host toolchains to bind besides the image's own (:data:`sandboxes.toolchain.HOST_TOOLCHAINS`;
    without one a sandbox sees only the host's ``/usr``)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if runtime == "unisolated" and not allow_unisolated:
        raise SandboxError("runtime 'unisolated' isolates nothing; pass allow_unisolated=True to use it for debugging")
    limits = limits or Limits()
    store = store or default_store()
    cache = cache or default_cache()
    if cache.root not in _reaped_caches:  # once per process and cache: debris of crashed harnesses
        _reaped_caches.add(cache.root)
        reap_stale_sandboxes(cache)
    if isinstance(source, Image):
        image = source
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.isdir(source)):
        path = Path(source).resolve()
        if not path.is_dir():
            raise ImageError(f"{path}: not a folder")
        image = _folder_image(path, store)
    elif isinstance(source, str):
        image = store.load_image(image_name(source))  # a task id or an image name
    else:
        raise TypeError(f"start() takes an Image, an image name or a folder, not {type(source).__name__}")
    return Sandbox(image, runtime, limits, store, cache, env, writable_root=writable_root, toolchains=toolchains)
