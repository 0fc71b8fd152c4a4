"""posttrain sandboxes: images, the node-local layer cache, runtimes, the ``pxd`` daemon and placement.

Agent-written code is untrusted: every episode runs in its own sandbox, with no network, limits on
CPU, memory, processes, disk and wall time, and only its workspace writable. This package imports
nothing else from posttrain.

Start a sandbox from a task repository folder (built into a cached image on the fly), an
:class:`Image`, or the name of an image in the store::

    import sandboxes

    with sandboxes.start("/path/to/task/repo", runtime="bwrap",          # or "gvisor"
                         limits=sandboxes.Limits(cpus=1, memory_mib=1024, pids=256,
                                                 disk_mib=1024, wall_s=3600)) as sb:
        r = sb.exec("python3 -m unittest -q", timeout_s=120, output_cap_bytes=65536)
        r.exit_code, r.output, r.truncated, r.timed_out, r.duration_s   # merged stdout+stderr
        sb.write_file("src/fix.py", b"...")        # paths relative to /workspace
        sb.read_file("src/fix.py")                 # -> bytes
        sb.pxd.exec(["git", "log", "-1"], cwd="src", env={"X": "1"},    # argv or shell=...,
                    timeout_s=10, head_bytes=4096, tail_bytes=4096)     # separate stdout/stderr
        sb.pxd.git_status(); sb.pxd.git_diff(); sb.pxd.git_commit("fix the parser")
        with sb.pxd.open_session() as sh:          # a persistent bash: cd and export carry over
            sh.run("cd src && export N=3"); sh.run("echo $N")

The workspace (``/workspace``) starts as the task repository with its ``.git``; it is writable, the
rest of the root is not. The host's ``/usr`` is there (``python3`` with the standard library only,
``git``, coreutils) and nothing of posttrain's own environment: a tool the image lacks is missing,
never borrowed. ``start(..., toolchains=("posttrain-python",))`` (or an image that declares it)
binds the Python that runs posttrain, with pytest, first on ``PATH``; ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``
is set (its unrelated plugins cost ~2.5 s per pytest run). ``sb.id``, ``sb.cache_hit`` and ``sb.start_s`` describe the
start. ``runtime="unisolated"`` runs ``pxd`` as a plain host process and needs
``allow_unisolated=True``: it is for debugging only and nothing falls back to it.

bwrap is the fast default (start ~0.15 s, ``true`` round trip +0.4 ms over a host subprocess).
gVisor (runsc 20240729 from bookworm-backports, ptrace) isolates more and costs more (a start about
0.25 s, a command about 45 ms on 2 cores: ``bench/gvisor_start.py``), and a fork or memory bomb ends
the whole sandbox (``PxdConnectionError`` says so) instead of only the command.

Images and the cache::

    store = sandboxes.ImageStore(root / "images")          # zstd layers + manifests
    cache = sandboxes.LayerCache(root / "cache", budget_bytes=20 * 2**30)   # unpacked, LRU
    report = sandboxes.build_images({"task-1": repo_dir, ...}, store)      # -> BuildReport
    sandboxes.start("task-1", store=store, cache=cache)

Defaults: the store is ``$POSTTRAIN_HOME/images`` (where the ``image_cache`` asset builds, one
image per task id: :func:`image_name` maps an id to its image name), the cache
``$POSTTRAIN_HOME/sandboxes/cache``; ``$POSTTRAIN_SANDBOX_DIR`` moves both. The asset's core is
:func:`build_image_cache` (build every task's image, warm the cache, report sizes and contents).

Errors: :class:`SandboxError` (could not start, died) and its subclasses :class:`ImageError`
(image or layer) and :class:`PxdConnectionError` (the daemon is gone, e.g. the sandbox hit its wall
time or memory limit: the message says which); :class:`PxdError` (the daemon refused a request:
its message names the field or path; ``.status`` is 400/404/409/413).

Kubernetes: :func:`sandboxes.k8s.pod_spec` and :func:`sandboxes.k8s.network_policy`. Placement and
its simulator: :mod:`sandboxes.placement`. The daemon itself: ``sandboxes/pxd.py``.
"""

from sandboxes.cache import LayerCache, Lease, build_image_cache
from sandboxes.client import CommitResult, ExecResult, GitStatus, PxdClient, PxdConnectionError, PxdError, ShellSession
from sandboxes.images import BuildReport, Image, ImageError, ImageStore, Layer, build_image, build_images, image_name
from sandboxes.runtimes import RUNTIMES, Limits, Sandbox, SandboxError, start

__all__ = [
    "RUNTIMES", "BuildReport", "CommitResult", "ExecResult", "GitStatus", "Image", "ImageError", "ImageStore",
    "Layer", "LayerCache", "Lease", "Limits", "PxdClient", "PxdConnectionError", "PxdError", "Sandbox",
    "SandboxError", "ShellSession", "build_image", "build_image_cache", "build_images", "image_name", "start",
]
