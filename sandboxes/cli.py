"""``posttrain sandbox`` commands.

- ``posttrain sandbox exec --task TASK_ID [--runtime gvisor|bwrap] -- CMD...``: start a sandbox for
  a task of the built bundled suite, run the command in its workspace, print
  ``{"exit_code", "stdout", "stderr", "truncated", "duration_s"}`` (and ``timed_out``) as JSON and
  remove the sandbox. Exits with the command's exit code.
- ``posttrain sandbox images``: the images in the store and the node cache's contents.
- ``posttrain sandbox reap``: clear what sandboxes of dead harnesses left under the run base, every
  cache's (:mod:`sandboxes.reaping`; a start reaps only its own cache's), and say what went.
- ``posttrain sandbox shipped PROGRAM``: the one file a sandbox runs of ``sandboxes/pxd.py`` or
  ``evals/call_probe.py`` (:func:`sandboxes.programs.shipped_source`), to stdout: for an image built
  by hand, or to run pxd on a folder.

The task is looked up in a built bundled suite folder (``suite.json`` and ``tasks/<id>/task.json``,
the format ``posttrain tasks build`` writes), by default ``$POSTTRAIN_HOME/datasets/bundled``;
``--repo DIR`` runs on any repository folder instead, ``--image NAME`` on an image in the store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sandboxes
from sandboxes.files import read_regular_bytes
from sandboxes.home import default_suite_dir
from sandboxes.runtimes import default_cache, default_store
from sandboxes.toolchain import HOST_TOOLCHAINS


def task_repo(suite: Path, task_id: str) -> tuple[Path, dict]:
    """The repository folder of ``task_id`` in a built suite, and its ``task.json``."""
    index = suite / "suite.json"
    if not index.is_file():
        raise LookupError(f"{suite}: no suite.json; build the bundled suite with `posttrain tasks build {suite}` "
                          "or pass --suite, --repo or --image")
    try:
        known = json.loads(read_regular_bytes(index)).get("tasks", [])  # a FIFO is refused, never waited on
    except OSError as exc:
        raise LookupError(f"{index}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise LookupError(f"{index}: not JSON ({exc})") from None
    if task_id not in known:
        sample = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
        raise LookupError(f"{index}: no task {task_id!r} (tasks: {sample or 'none'})")
    path = suite / "tasks" / task_id / "task.json"
    try:
        meta = json.loads(read_regular_bytes(path))
        repo = (path.parent / meta["repo"]).resolve()
    except (OSError, ValueError) as exc:
        raise LookupError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    except KeyError:
        raise LookupError(f"{path}: missing key 'repo'") from None
    if not repo.is_dir():
        raise LookupError(f"{path}: repo {meta['repo']!r} resolves to {repo}, which is not a folder")
    return repo, meta


def cmd_exec(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("posttrain sandbox exec: give the command after --, e.g. -- python -m pytest -q", file=sys.stderr)
        return 2
    limits = sandboxes.Limits(cpus=args.cpus, memory_mib=args.memory_mib, wall_s=args.timeout + 60)
    cwd = None
    try:
        if args.repo:
            source = Path(args.repo)
        elif args.image:
            source = args.image
        else:
            source, meta = task_repo(Path(args.suite) if args.suite else default_suite_dir(), args.task)
            lim = meta.get("limits", {})
            limits = sandboxes.Limits(cpus=float(lim.get("cpus", args.cpus)),
                                      memory_mib=int(lim.get("memory_mb", args.memory_mib)),
                                      wall_s=args.timeout + 60)
            cwd = meta.get("workdir") if meta.get("workdir") not in (None, ".", "") else None
        with sandboxes.start(source, runtime=args.runtime, limits=limits, allow_unisolated=args.allow_unisolated,
                             toolchains=args.toolchain) as sb:
            argv = ["/bin/sh", "-c", command[0]] if args.shell else command
            r = sb.pxd.exec(argv, cwd=cwd, timeout_s=args.timeout, head_bytes=args.cap_bytes // 2,
                            tail_bytes=args.cap_bytes - args.cap_bytes // 2)
    except (LookupError, sandboxes.SandboxError, ValueError) as exc:
        print(f"posttrain sandbox exec: {exc}", file=sys.stderr)
        return 2
    except sandboxes.PxdError as exc:
        print(f"posttrain sandbox exec: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(r.to_json(), indent=1))
    return r.exit_code


def cmd_images(args: argparse.Namespace) -> int:
    store, cache = default_store(), default_cache()
    out = {"store": str(store.root), "images": {}, "cache": str(cache.root), "cache_budget_bytes": cache.budget_bytes,
           "cached_layers": cache.contents()}
    for name in store.image_names():
        image = store.load_image(name)
        out["images"][name] = {"size_bytes": image.size_bytes, "layers": [l.digest for l in image.layers]}
    print(json.dumps(out, indent=1))
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    from sandboxes.reaping import reap_stale_sandboxes
    from sandboxes.rootfs import run_base

    unmounted: list[int] = []
    reaped = reap_stale_sandboxes(None, unmounted=unmounted)
    print(f"reaped {len(reaped)} run folders under {run_base()}, {sum(unmounted)} mounts taken down")
    for name, mounts in zip(reaped, unmounted):
        print(f"  {name}: {mounts} mounts")
    return 0


def cmd_shipped(args: argparse.Namespace) -> int:
    from sandboxes.programs import shipped_source

    try:
        data = shipped_source(Path(args.program))
    except (OSError, ValueError) as exc:
        print(f"posttrain sandbox shipped: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(data)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the ``posttrain`` parser."""
    sandbox = sub.add_parser("sandbox", help="run commands in task sandboxes",
                             description="Sandboxes: bubblewrap or gVisor, with the pxd daemon inside.")
    ssub = sandbox.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")
    ex = ssub.add_parser(
        "exec", help="run one command in a fresh sandbox of a task and print the result as JSON",
        description="Start a sandbox for a task, run CMD in its workspace, print {exit_code, stdout, stderr, "
        "truncated, duration_s} as JSON, remove the sandbox. Exits with CMD's exit code.",
    )
    which = ex.add_mutually_exclusive_group(required=True)
    which.add_argument("--task", help="task id in the built bundled suite")
    which.add_argument("--repo", help="a repository folder instead of a task")
    which.add_argument("--image", help="an image name in the image store instead of a task")
    ex.add_argument("--suite", help="built bundled suite folder (default: $POSTTRAIN_HOME/datasets/bundled)")
    ex.add_argument("--runtime", choices=["bwrap", "gvisor", "unisolated"], default="bwrap")
    ex.add_argument("--allow-unisolated", action="store_true", help="permit --runtime unisolated (debugging only)")
    ex.add_argument("--timeout", type=float, default=600.0, help="seconds the command may run (default 600)")
    ex.add_argument("--cap-bytes", type=int, default=65536, help="output kept per stream: first and last halves")
    ex.add_argument("--cpus", type=float, default=1.0)
    ex.add_argument("--memory-mib", type=int, default=2048)
    ex.add_argument("--shell", action="store_true", help="run CMD (one string) with /bin/sh -c")
    ex.add_argument("--toolchain", action="append", default=[], choices=HOST_TOOLCHAINS,
                    help="a host toolchain to bind besides /usr (posttrain-python: the Python that runs posttrain, "
                    "with pytest); repeat for several")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    ex.set_defaults(func=cmd_exec)
    im = ssub.add_parser("images", help="list the image store and the node cache (JSON)")
    im.set_defaults(func=cmd_images)
    rp = ssub.add_parser("reap", help="clear what sandboxes of dead harnesses left (processes, mounts, run folders)",
                         description="Every cache's run folders under $POSTTRAIN_SANDBOX_RUN_DIR whose lock no process "
                         "holds: their cgroup's processes killed, their mounts taken down, the folders removed.")
    rp.set_defaults(func=cmd_reap)
    sh = ssub.add_parser("shipped", help="print the one file a sandbox runs of a program (pxd, the call probe)")
    sh.add_argument("program", help="sandboxes/pxd.py or evals/call_probe.py")
    sh.set_defaults(func=cmd_shipped)
