"""What a gVisor sandbox costs per ``runsc`` build and platform: first a bare start, ``runsc run`` of
an OCI bundle (the host's root read-only, ``/proc``, a ``/tmp`` tmpfs, the sandbox runtime's own
``runsc`` flags) with different first processes; then the project's own sandboxes
(``sandboxes.start`` of a small task image), their start and their commands. Runs interleaved.

    .venv/bin/python bench/gvisor_start.py [--runs 12]           # root, runsc and cc on PATH
    .venv/bin/python bench/gvisor_start.py --runsc /old/usr/bin/runsc:ptrace --runsc runsc:ptrace

``--runsc PATH:PLATFORM`` (repeatable) names a ``runsc`` binary (a file named ``runsc``: the
project's runtime finds it on ``PATH``) and the platform to run it with; the default is the one on
``PATH`` with the runtime's platform. Another Debian build, unpacked without installing it:
``apt-get download runsc=VERSION && dpkg-deb -x runsc_*.deb DIR`` gives ``DIR/usr/bin/runsc``.

Bare starts, first processes:

- ``static C``: a C program that writes one line and exits, built with ``cc -O2 -static`` (no
  dynamic loader, about 30 page faults): what any start costs on this ``runsc`` and platform, the
  floor a compiled daemon would start at;
- ``/bin/echo``: the same with the dynamic loader and libc;
- ``python3 -I -S -c ...``: the sandbox's interpreter (``sandboxes.toolchain.SANDBOX_PYTHON``),
  started as pxd is started, writing one line;
- ``pxd``: the daemon as the local runtimes start it (the compiled file of
  ``sandboxes.runtimes.compiled_pxd``, ``--stdio``) given its key line and then end of input, so it
  writes its ready line and exits.

"Ready" is the wall time from ``runsc run`` starting to the first process's line on its stdout (what
``sandboxes.start`` waits for, pxd's ready line); "exit" runs on to ``runsc run``'s exit (the
sandbox's removal by runsc included). CPU is ``runsc run``'s and every process it waited for (its
gofer, gVisor's kernel and the stubs the platform starts), from ``wait4``'s resource usage, to the
exit.

The project's sandboxes: a hit start (the image's layers cached) to pxd's ready line, wall; the CPU
of that start and the sandbox's close; ``exec(["true"])`` (pxd starting a process inside gVisor and
answering), wall and CPU a call; and one command that starts Python and ``git`` (what a test run
or an agent's command starts), wall. CPU is counted as ``bench/sandbox_start.py`` counts it: the
bench moves itself into a cgroup of its own on the unified hierarchy, whose ``cpu.stat`` counts
every process it starts. ``bench/sandbox_start.py`` compares the project's start with a baseline
commit's on the installed ``runsc``; this bench shows what of a start is ``runsc`` and the first
process alone, and what another ``runsc`` would change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

import sandboxes  # noqa: E402
from sandbox_start import make_repo, own_cgroup, usage_s  # noqa: E402
from sandboxes.runtimes import GvisorRuntime, compiled_pxd  # noqa: E402
from sandboxes.toolchain import SANDBOX_PYTHON  # noqa: E402

# the flags GvisorRuntime.command gives runsc, apart from --root and --platform
RUNSC_FLAGS = ["--network=none", "--file-access-mounts=exclusive"]
KEY_LINE = b"PXD-KEY " + b"ab" * 32 + b"\n"
EXEC_CALLS = 5
COMMAND = "python3 -I -c 'import json, subprocess' && git status --short >/dev/null"


def bundle(folder: Path, args: list[str], binds: list[str]) -> Path:
    """An OCI bundle whose root is the host's, read-only, with ``args`` as its first process."""
    folder.mkdir(parents=True)
    mounts = [{"destination": "/proc", "type": "proc", "source": "proc"},
              {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
              *[{"destination": b, "type": "bind", "source": b, "options": ["rbind", "ro"]} for b in binds]]
    config = {"ociVersion": "1.0.2",
              "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": args, "cwd": "/",
                          "env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "noNewPrivileges": True},
              "root": {"path": "/", "readonly": True}, "hostname": "sandbox", "mounts": mounts,
              "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_once(runsc: tuple[str, str], state: Path, folder: Path, name: str, stdin: bytes) -> tuple[float, float, float]:
    """Ready and exit wall seconds and CPU seconds of one ``runsc run`` of the bundle in ``folder`` by
    ``runsc`` (path, platform)."""
    binary, platform = runsc
    started = time.perf_counter()
    proc = subprocess.Popen([binary, "--root", str(state), f"--platform={platform}", *RUNSC_FLAGS, "run", "--bundle",
                             str(folder), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(stdin)
    proc.stdin.close()
    line = proc.stdout.readline()
    ready = time.perf_counter() - started
    proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    err = proc.stderr.read().decode(errors="replace").strip()
    proc.stderr.close()
    subprocess.run([binary, "--root", str(state), "delete", "-force", name], capture_output=True, timeout=30)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not line:
        raise SystemExit(f"gvisor_start: runsc run of {folder.name} exited {code} (first line {line!r}): {err[-500:]}")
    return ready, wall, usage.ru_utime + usage.ru_stime


def cell(values: list[float], floor: float | None = None) -> str:
    """``p50 (+over floor) [min-max]`` in milliseconds."""
    m = statistics.median(values)
    over = f" (+{(m - floor) * 1e3:.0f})" if floor is not None else ""
    return f"{m * 1e3:.0f}{over} [{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]"


def bare_starts(runscs: list[tuple[str, str]], runs: int, cc: str) -> dict:
    """Per (runsc, first process): ready wall, exit wall and CPU seconds of each run."""
    with tempfile.TemporaryDirectory(prefix="gvisor-start-") as work:
        work = Path(work)
        os.chmod(work, 0o755)
        (work / "ready.c").write_text('#include <unistd.h>\nint main(void) { return write(1, "R\\n", 2) != 2; }\n')
        static = work / "bin" / "ready-static"
        static.parent.mkdir()
        subprocess.run([cc, "-O2", "-static", "-o", str(static), str(work / "ready.c")], check=True)
        pxd = compiled_pxd(SANDBOX_PYTHON)
        kinds = {
            "static C": (bundle(work / "static", [str(static)], [str(static.parent)]), b""),
            "/bin/echo": (bundle(work / "echo", ["/bin/echo", "R"], []), b""),
            "python3 -I -S -c ...": (bundle(work / "python", [SANDBOX_PYTHON, "-I", "-S", "-c", "print('R')"], []), b""),
            "pxd": (bundle(work / "pxd", [SANDBOX_PYTHON, "-I", "-S", str(pxd), "--workspace", "/tmp", "--stdio"],
                           [str(pxd.parent)]), KEY_LINE),
        }
        state = work / "state"
        cases = [(r, k) for r in runscs for k in kinds]
        results = {c: ([], [], []) for c in cases}
        for n, (runsc, kind) in enumerate(cases):  # once each first: the host's page cache
            folder, stdin = kinds[kind]
            run_once(runsc, state, folder, f"warm{n}-{folder.name}", stdin)
        for i in range(runs):
            for n, (runsc, kind) in enumerate(cases if i % 2 == 0 else cases[::-1]):
                folder, stdin = kinds[kind]
                for series, value in zip(results[(runsc, kind)], run_once(runsc, state, folder,
                                                                           f"b{i}-{n}-{folder.name}", stdin)):
                    series.append(value)
    return results


def use_runsc(runsc: tuple[str, str], path: str) -> None:
    """Make the project's gVisor runtime start ``runsc`` (path, platform)."""
    os.environ["PATH"] = f"{Path(runsc[0]).parent}:{path}"
    GvisorRuntime.platform = runsc[1]


def project_sandboxes(runscs: list[tuple[str, str]], runs: int) -> dict:
    """Per runsc: hit start wall, start+close CPU, exec wall and CPU a call, Python-and-git command wall."""
    group = own_cgroup()
    if group is None:
        raise SystemExit("gvisor_start: no cgroup of its own on the unified hierarchy to count CPU in")
    path = os.environ["PATH"]
    results = {r: {"start": [], "cpu": [], "exec": [], "exec_cpu": [], "command": []} for r in runscs}
    try:
        with tempfile.TemporaryDirectory(prefix="gvisor-start-") as work:
            work = Path(work)
            store, cache = sandboxes.ImageStore(work / "images"), sandboxes.LayerCache(work / "cache")
            image = sandboxes.build_image("small-task", make_repo(work), store)
            for runsc in runscs:  # the layers cached, the host's page cache warm
                use_runsc(runsc, path)
                sandboxes.start(image, runtime="gvisor", store=store, cache=cache).close()
            for i in range(runs):
                for runsc in (runscs if i % 2 == 0 else runscs[::-1]):
                    use_runsc(runsc, path)
                    r = results[runsc]
                    u0, t0 = usage_s(group), time.perf_counter()
                    sb = sandboxes.start(image, runtime="gvisor", store=store, cache=cache)
                    r["start"].append(time.perf_counter() - t0)
                    u1 = usage_s(group)
                    try:
                        sb.exec(["true"])
                        u2, t2 = usage_s(group), time.perf_counter()
                        for _ in range(EXEC_CALLS):
                            sb.exec(["true"])
                        r["exec"].append((time.perf_counter() - t2) / EXEC_CALLS)
                        r["exec_cpu"].append((usage_s(group) - u2) / EXEC_CALLS)
                        t3 = time.perf_counter()
                        done = sb.exec(COMMAND)
                        r["command"].append(time.perf_counter() - t3)
                        if done.exit_code != 0:
                            raise SystemExit(f"gvisor_start: {COMMAND!r} exited {done.exit_code}: {done.stdout[-500:]}")
                        u4 = usage_s(group)
                    finally:
                        sb.close()
                    r["cpu"].append((u1 - u0) + (usage_s(group) - u4))
    finally:
        os.environ["PATH"] = path
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12, help="runs of each kind per runsc (default 12)")
    parser.add_argument("--runsc", action="append", default=[], metavar="PATH:PLATFORM",
                        help=f"a runsc binary and the platform to run it with (repeatable; default: runsc on PATH, "
                             f"{GvisorRuntime.platform})")
    args = parser.parse_args()
    runscs = []
    for item in args.runsc or [f"runsc:{GvisorRuntime.platform}"]:
        path, _, platform = item.rpartition(":")
        binary = shutil.which(path) if path else None
        if binary is None or Path(binary).name != "runsc" or not platform:
            print(f"gvisor_start: --runsc {item!r}: expected PATH:PLATFORM, PATH an executable named runsc",
                  file=sys.stderr)
            return 2
        runscs.append((binary, platform))
    cc = shutil.which("cc") or shutil.which("gcc")
    if os.geteuid() != 0 or cc is None:
        print("gvisor_start: needs root and a C compiler (cc)", file=sys.stderr)
        return 2
    bare = bare_starts(runscs, args.runs, cc)
    project = project_sandboxes(runscs, args.runs)
    print(f"{args.runs} runs of each kind, interleaved; runsc flags {' '.join(RUNSC_FLAGS)}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; ms p50 (over static C) [min-max]")
    for runsc in runscs:
        version = subprocess.run([runsc[0], "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        floors = [statistics.median(series) for series in bare[(runsc, "static C")]]
        print(f"\n{runsc[0]} ({version}), --platform={runsc[1]}\n")
        print("| first process of a bare bundle | ready, wall | exit, wall | CPU to exit |")
        print("| --- | ---: | ---: | ---: |")
        for kind in ("static C", "/bin/echo", "python3 -I -S -c ...", "pxd"):
            print(f"| {kind} | " + " | ".join(cell(series, floor if kind != "static C" else None)
                                              for series, floor in zip(bare[(runsc, kind)], floors)) + " |")
    print("\nThe project's sandboxes (a small task's image, layers cached):\n")
    print("| runsc, platform | hit start, wall | start+close, CPU | exec true, wall | exec true, CPU | "
          "Python and git command, wall |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for runsc in runscs:
        r = project[runsc]
        print(f"| {runsc[0]}, {runsc[1]} | " + " | ".join(cell(r[k]) for k in ("start", "cpu", "exec", "exec_cpu", "command"))
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
