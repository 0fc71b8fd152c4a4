"""Sandbox start latency and CPU per start+stop, per runtime, this checkout beside a baseline commit.

    .venv/bin/python bench/sandbox_start.py                 # a few minutes on 2 cores
    .venv/bin/python bench/sandbox_start.py --repeats 10 --rounds 3 --runtimes bwrap --baseline 1ec7686

"Start" is ``sandboxes.start(image)`` returning: the layers taken from the node cache (cold: the
cache is emptied first, so both layers are unpacked from their zstd blobs), the overlay and tmpfs
mounted, the cgroup made, the runtime started and ``pxd`` answering (its ready line read). A closed
sandbox is removed before the next start. Cold and hit starts alternate, so both see the same load.
Two images: a small task repository (the size of a bundled task) and a repository the size of
the ``pip`` source tree (about 1000 files, 13 MB), where unpacking on a miss costs more; and the
small task's folder itself (``task-folder``), which is how an episode and a grading start a
sandbox: its image is made from the folder on the way.

CPU, not wall: each tree is measured in a worker process of its own that first moves itself into a
cgroup of its own on the unified (v2) hierarchy, whose ``cpu.stat`` ``usage_usec`` counts every
process the worker starts and every one they start, ended ones included (the shell, ``setpriv``,
bwrap, pxd, ``runsc`` and gVisor's sandbox and gofer): short-lived processes that a sampling
profiler misses are counted in full. A sandbox's own cgroup (v1 ``cpu``/``memory``/``pids``) does
not move it out of that one. The CPU of a hit start+stop is split into the worker's own process
(``RUSAGE_SELF``: the harness's Python, the mount and cgroup system calls it makes) and everything
else (the runtime's processes and pxd), and the harness's part by step (``Sandbox.host_cpu_s``,
where the tree records it). Kernel work done later in kernel threads (a cgroup's release, an
overlay's deferred cleanup) is in neither; the machine's whole ``/proc/stat`` busy time over the
same starts is printed beside, which includes whatever else the machine runs (see the load average).
Last, the CPU a started sandbox costs while it waits (an episode's sandbox mostly waits for the
model): one sandbox left idle for ``--idle-s`` seconds, in CPU ms per second; and before that, the
CPU of one command in it (``exec(["true"])`` 20 times: the request, pxd starting ``true`` and
waiting for it, the answer; the harness's side included), in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIFIED = [Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]  # hybrid hosts, then pure v2


def make_repo(root: Path) -> Path:
    repo = root / "task"
    (repo / "src").mkdir(parents=True)
    for i in range(10):
        (repo / "src" / f"m{i}.py").write_text(f"def f(x):\n    return x + {i}\n" * 40)
    (repo / "test_m.py").write_text("def test_ok():\n    assert True\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *cmd], cwd=repo, check=True)
    return repo


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def own_cgroup() -> Path | None:
    """Move this process into a fresh cgroup of the v2 hierarchy (hybrid hosts: ``unified``) and
    return it; None where there is none to make (not root). Pure v2 hosts: the sandboxes' own
    cgroups take their processes out of this one, so only hybrid hosts count the sandbox side."""
    for base in UNIFIED:
        if (base / "cgroup.procs").exists() and (base / "cgroup.controllers").exists():
            group = base / f"posttrain-bench-{os.getpid()}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(os.getpid()))
                return group
            except OSError:
                return None
    return None


def usage_s(group: Path | None) -> float:
    if group is None:
        return float("nan")
    for line in (group / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    return float("nan")


def machine_busy_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


EXEC_CALLS = 20


def worker(repeats: int, runtimes: list[str], idle_s: float = 2.0) -> None:
    """Measure with the ``sandboxes`` on ``sys.path``; print one JSON line per image and runtime."""
    import sandboxes

    group = own_cgroup()
    try:
        with tempfile.TemporaryDirectory() as work:
            work = Path(work)
            store = sandboxes.ImageStore(work / "images")
            cache = sandboxes.LayerCache(work / "cache")
            import pip

            big = work / "pip-sized"
            shutil.copytree(Path(pip.__file__).parent, big, ignore=shutil.ignore_patterns("__pycache__"))
            repo = make_repo(work)
            images = [sandboxes.build_image("small-task", repo, store),
                      sandboxes.build_image("pip-sized", big, store)]
            # a task's folder, as an episode and its grading start it (the image made from it on the way)
            images.insert(1, repo)
            for image, runtime in [(i, r) for i in images for r in runtimes]:
                times = {"cold": [], "hit": []}
                cpu = {"start": [], "stop": [], "harness": [], "machine": []}
                steps: dict[str, list[float]] = {}
                sandboxes.start(image, runtime=runtime, store=store, cache=cache).close()  # warm the page cache
                for _ in range(repeats):
                    for kind in ("cold", "hit"):
                        if kind == "cold":
                            cache.evict(1)  # a folder's image: its task layer is unpacked again, the base is kept
                        u0, s0, m0 = usage_s(group), self_cpu_s(), machine_busy_s()
                        t = time.perf_counter()
                        sb = sandboxes.start(image, runtime=runtime, store=store, cache=cache)
                        times[kind].append(time.perf_counter() - t)
                        u1 = usage_s(group)
                        assert sb.cache_hit == (kind == "hit")
                        sb.close()
                        u2, s2, m2 = usage_s(group), self_cpu_s(), machine_busy_s()
                        if kind == "hit":
                            cpu["start"].append(u1 - u0)
                            cpu["stop"].append(u2 - u1)
                            cpu["harness"].append(s2 - s0)
                            cpu["machine"].append(m2 - m0)
                            for name, value in getattr(sb, "host_cpu_s", {}).items():
                                steps.setdefault(name, []).append(value)
                with sandboxes.start(image, runtime=runtime, store=store, cache=cache) as sb:  # one that waits
                    sb.exec("true")
                    u0 = usage_s(group)
                    for _ in range(EXEC_CALLS):  # what a command costs: pxd starting it, it, the answer
                        sb.exec(["true"])
                    exec_cpu = (usage_s(group) - u0) / EXEC_CALLS
                    time.sleep(0.2)
                    u0 = usage_s(group)
                    time.sleep(idle_s)
                    idle = (usage_s(group) - u0) / idle_s
                name, size = (image.name, image.size_bytes) if isinstance(image, sandboxes.Image) else ("task-folder", 0)
                print(json.dumps({"image": name, "size_bytes": size, "runtime": runtime,
                                  "cold_s": times["cold"], "hit_s": times["hit"], "cpu": cpu, "steps": steps,
                                  "idle_cpu_s_per_s": idle, "exec_cpu_s": exec_cpu}), flush=True)
    finally:
        if group is not None:  # back to the parent, and the cgroup removed
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()


def run_tree(tree: Path, repeats: int, runtimes: str, idle_s: float) -> list[dict]:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import runpy; "
            "m = runpy.run_path(sys.argv[2]); m['worker'](int(sys.argv[3]), sys.argv[4].split(','), float(sys.argv[5]))")
    done = subprocess.run([sys.executable, "-c", code, str(tree), __file__, str(repeats), runtimes, str(idle_s)],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="starts of each kind per image, runtime and round")
    ap.add_argument("--rounds", type=int, default=2, help="worker runs per tree, the trees alternating")
    ap.add_argument("--runtimes", default="bwrap,gvisor")
    ap.add_argument("--baseline", default="1ec7686", help="commit measured beside this checkout ('' for none)")
    ap.add_argument("--idle-s", type=float, default=2.0, help="how long one started sandbox is left idle and measured")
    args = ap.parse_args()
    trees = [("this checkout", ROOT)]
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="bench-sandbox-start-")) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), args.baseline],
                       check=True)
        trees.insert(0, (f"baseline {args.baseline}", worktree))
    try:
        # the trees' workers alternate, ``--rounds`` each, so that a change of the machine's load
        # falls on both alike
        results: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for name, tree in trees:
                rows = run_tree(tree, args.repeats, args.runtimes, args.idle_s)
                if name not in results:
                    results[name] = rows
                    continue
                for old, new in zip(results[name], rows):
                    for key in ("cold_s", "hit_s"):
                        old[key] += new[key]
                    for key in old["cpu"]:
                        old["cpu"][key] += new["cpu"][key]
                    for key in old["steps"]:
                        old["steps"][key] += new["steps"][key]
                    old["idle_cpu_s_per_s"] = (old["idle_cpu_s_per_s"] + new["idle_cpu_s_per_s"]) / 2
                    old["exec_cpu_s"] = (old.get("exec_cpu_s", 0.0) + new.get("exec_cpu_s", 0.0)) / 2
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
            shutil.rmtree(worktree.parent, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    print(f"{'tree':<17} {'image':<11} {'runtime':<8} {'cold p50 ms':>11} {'hit p50 ms':>10} {'hit p90 ms':>10} "
          f"| CPU ms per hit start+stop (p50): {'start':>6} {'stop':>6} {'total':>6} {'harness':>7} {'machine':>7} "
          f"| idle CPU ms/s | exec CPU ms")
    for name, rows in results.items():
        for r in rows:
            c = r["cpu"]
            total = [a + b for a, b in zip(c["start"], c["stop"])]
            print(f"{name:<17} {r['image']:<11} {r['runtime']:<8} {ms(r['cold_s']):>11} {ms(r['hit_s']):>10} "
                  f"{pct(r['hit_s'], 90) * 1e3:>10.1f} | {'':>33} {ms(c['start']):>6} {ms(c['stop']):>6} "
                  f"{ms(total):>6} {ms(c['harness']):>7} {ms(c['machine']):>7} | {r['idle_cpu_s_per_s'] * 1e3:>6.2f} "
                  f"| {r.get('exec_cpu_s', 0.0) * 1e3:>6.2f}")
    for name, rows in results.items():
        for r in rows:
            if r["steps"]:
                print(f"{name} {r['image']} {r['runtime']}: harness thread CPU ms by step (p50): " +
                      ", ".join(f"{k} {ms(v)}" for k, v in r["steps"].items()))
    if len(results) == 2:
        (bname, base), (_, new) = results.items()
        for b, n in zip(base, new):
            bt = statistics.median([x + y for x, y in zip(b["cpu"]["start"], b["cpu"]["stop"])])
            nt = statistics.median([x + y for x, y in zip(n["cpu"]["start"], n["cpu"]["stop"])])
            print(f"{n['image']} {n['runtime']}: CPU per hit start+stop {nt * 1e3:.1f} ms vs {bt * 1e3:.1f} ms "
                  f"({bname}): {nt / bt:.2f}x; hit p50 {ms(n['hit_s'])} ms vs {ms(b['hit_s'])} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
