"""Where the RL loop's CPU goes: N steps of the embedded default, through the real loop, beside a
baseline commit's configuration run the same way in the same call, with the groups/s ratio.

Each side is ``python -m training`` on the plan of its code's ``examples/embedded.toml`` (the model
path and the task suite made absolute: ``HOME/models/base`` and ``HOME/datasets/bundled``, built by
``posttrain demo`` or ``python -m training.base_model`` and ``posttrain tasks build``; ``steps`` set
to ``--steps``): the real vLLM CPU engine, real bwrap sandboxes. The baseline side runs the
baseline commit's code from a ``git worktree`` (same Python environment).

While a run goes, every process of the trainer's tree is sampled from /proc (psutil) every
``--interval-s`` (0.25 s) and its CPU time (user + system) is put in one bucket:

- **model**: the forward passes: vLLM's engine core (and worker) processes, or the project's own
  engine's process (``serving.local_engine``);
- **episode commands**: what the sandbox daemon runs (the agent's tests and commands, the grading
  tests): the daemon's reaped children, plus those alive at the sample;
- **sandbox start/stop**: the sandbox's own processes (the cgroup shell, setpriv, bwrap, the pxd
  daemon: a Python start per sandbox);
- **trainer step**: the trainer's main thread: the GRPO step (torch on ``torch_threads`` = 1 runs
  on it), checkpoints, publication and the loop that waits for groups (the loop's own ``train_s``
  per step is printed beside it);
- **else**: the rest: the replica's HTTP processes (vLLM's API server, posttrain's capture front),
  the trainer's other threads (the harness's HTTP calls and parsing, grading glue, image, rootfs and
  cgroup set-up, the rollout store) and any other process it starts.

The sampler misses a process that starts and ends between two samples, and an episode starts many
(a sandbox's shell, ``setpriv`` and ``bwrap``, a test run, ``git``): each side also prints the
machine's own busy CPU over the same window (``/proc/stat``) and the part of it the sampler did not
see. On a machine running nothing else that line is the loop's whole CPU. As root on cgroup v1 with
``cpuacct`` mounted apart (:mod:`bench.cpuacct`), the trainer joins a ``cpuacct`` group of its own
at its start, and the whole tree's CPU (sandboxes and short-lived processes included, nothing of
other work on the machine) is printed as well: the figure to compare under load.

Only the steady part counts: from the end of step 1 (the engine is up, the pipeline full) to the end
of step N, so ``groups/s`` is the groups the steps 2..N took over that time. The machine is shared:
absolute figures move with the load; the CPU a group and the shares carry over best.

    .venv/bin/python bench/loop_profile.py --home HOME [--steps 4] [--baseline fdf7a51[,1ec7686]]
    .venv/bin/python bench/loop_profile.py --home HOME --only current --set producer_workers=8   # a trial

With ``--acct`` (root, ``accton`` of Debian's ``acct``), the kernel's process accounting is on over
the same window and every process of the trainer's tree that ends in it is counted by its command
name (how many a group, how many only forked and never exec'd, their CPU a group), split by where it
ran: in a sandbox (below a ``bwrap``) or outside it. This sees what the sampler misses (a sandbox's
start, every ``git``, shell and test process) and says how many sandboxes a group starts (the
``bwrap`` rows).

``--code DIR`` runs the current side from another checkout (a ``git worktree`` of the commit to
measure, when this one is being edited); ``--set KEY=VALUE`` sets a trainer key on the current side,
``--env NAME=VALUE`` an environment variable of its trainer (``POSTTRAIN_ENGINE=local``: the
project's engine rather than vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpuacct import open_group  # noqa: E402 - bench/ is no package
from worktrees import baseline_tree  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BUCKETS = ("model", "episode commands", "sandbox start/stop", "trainer step", "else")
STEP_LINE = re.compile(r"^step\s+(\d+) .* groups (\d+) .* train ([0-9.]+)s")

PLAN_SCRIPT = """
import json, sys, tomllib
from training.planner.resolve import resolve
data = tomllib.loads(open(sys.argv[1]).read())
data["model"]["path"] = sys.argv[2]
plan = resolve(data, source=sys.argv[1]).to_json()
print(json.dumps(plan))
"""


@dataclass
class Sample:
    """Cumulative CPU seconds per bucket at one moment (the step's from the loop, added later), and
    the whole machine's busy CPU seconds then (``/proc/stat``)."""

    at: float
    cpu_s: dict[str, float]
    machine_busy_s: float = 0.0
    tree_s: float = 0.0  # the trainer's whole tree (cpuacct), sandboxes and short-lived processes included


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot (``/proc/stat``: user, nice,
    system, irq and softirq; not idle, iowait or a hypervisor's steal). The sampler sees only
    processes alive at a sample; a process that starts and ends between two samples (a sandbox's
    shell, setpriv and bwrap; a test run; ``git``) is seen here."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:7])
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Tracker:
    """Classifies the trainer's process tree and keeps each process's CPU as last seen."""

    root: int
    kinds: dict[tuple[int, float], str] = field(default_factory=dict)
    own_s: dict[tuple[int, float], float] = field(default_factory=dict)
    reaped_s: dict[tuple[int, float], float] = field(default_factory=dict)  # a sandbox daemon's children
    alive_commands_s: float = 0.0
    seen: set[int] = field(default_factory=set)  # every pid of the tree a sample saw

    def _kind(self, proc: psutil.Process, parent_kind: str | None) -> str:
        if proc.pid == self.root:
            return "trainer"
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            cmd = ""
        if parent_kind in ("model", "serving") or "serving.replica" in cmd or "vllm" in cmd.lower() \
                or "serving.local_engine" in cmd:
            try:
                name = proc.name()
            except psutil.Error:
                name = ""
            # vLLM's engine core (and worker) run the forward passes; its API server and posttrain's
            # capture front are HTTP; the project's own engine does both in one process
            return "model" if name.startswith("VLLM::") or "serving.local_engine" in cmd else "serving"
        if parent_kind in ("sandbox", "command"):
            if parent_kind == "sandbox" and ("--stdio" in cmd or "bwrap" in cmd):
                return "sandbox"  # bwrap's own child and the pxd daemon
            return "command"
        if "bwrap" in cmd or "setpriv" in cmd or "cgroup.procs" in cmd or "--stdio" in cmd:
            return "sandbox"
        return "other"

    def sample(self) -> None:
        try:
            top = psutil.Process(self.root)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            return
        by_pid = {}
        for proc in procs:
            try:
                by_pid[proc.pid] = (proc, proc.create_time(), proc.ppid())
            except psutil.Error:
                continue
        alive_commands = 0.0
        self.seen.update(by_pid)
        for pid, (proc, created, ppid) in by_pid.items():
            key = (pid, created)
            if key not in self.kinds:
                parent = by_pid.get(ppid)
                parent_kind = self.kinds.get((ppid, parent[1])) if parent else None
                self.kinds[key] = self._kind(proc, parent_kind)
            kind = self.kinds[key]
            try:
                if kind == "serving" and proc.name().startswith("VLLM::"):  # named after its start
                    kind = self.kinds[key] = "model"
                t = proc.cpu_times()
            except psutil.Error:
                continue
            own = t.user + t.system
            if kind == "trainer":  # its main thread: the step, publication and the take loop
                # every process it started that ended and was reaped, with all they reaped in turn
                # (a sandbox's bwrap, pxd and commands; git on the host): exact, seen or not
                self.own_s[("reaped", 0.0)] = t.children_user + t.children_system
                try:
                    main = next(th for th in proc.threads() if th.id == pid)
                    self.own_s[("main", 0.0)] = main.user_time + main.system_time
                except (psutil.Error, StopIteration):
                    pass
            if kind == "command":
                alive_commands += own
                continue
            self.own_s[key] = own
            if kind == "sandbox" and "--stdio" in self._cmd(proc):
                self.reaped_s[key] = t.children_user + t.children_system
        self.alive_commands_s = alive_commands

    @staticmethod
    def _cmd(proc: psutil.Process) -> str:
        try:
            return " ".join(proc.cmdline())
        except psutil.Error:
            return ""

    def totals(self) -> dict[str, float]:
        out = {"model": 0.0, "episode commands": 0.0, "sandbox start/stop": 0.0, "trainer": 0.0, "serving": 0.0,
               "other": 0.0, "trainer main thread": 0.0, "trainer's reaped children": 0.0}
        for key, seconds in self.own_s.items():
            if key == ("main", 0.0):
                out["trainer main thread"] = seconds
                continue
            if key == ("reaped", 0.0):
                out["trainer's reaped children"] = seconds
                continue
            out[{"sandbox": "sandbox start/stop"}.get(self.kinds[key], self.kinds[key])] += seconds
        out["episode commands"] = sum(self.reaped_s.values()) + self.alive_commands_s
        return out


ACCTON = "/usr/sbin/accton"
ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")  # linux/acct.h struct acct_v3: 64 bytes
ACCT_HZ = 100  # AHZ: the unit of ac_utime and ac_stime
ACCT_FORKED = 0x01  # AFORK: forked and never exec'd


def _comp_t(value: int) -> int:
    """linux/acct.h's comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


@dataclass
class AcctRecord:
    pid: int
    ppid: int
    comm: str
    cpu_s: float
    forked_only: bool


def read_acct(path: Path) -> list[AcctRecord]:
    """The acct_v3 records of ``path`` (one per process that ended while accounting was on)."""
    data = path.read_bytes()
    out = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        (flag, version, _tty, _exit, _uid, _gid, pid, ppid, _btime, _etime, utime, stime,
         *_rest, comm) = ACCT_V3.unpack_from(data, offset)
        if version & 0x0F != 3:
            raise SystemExit(f"{path}: record at {offset} is accounting version {version & 0x0F}, not 3 (acct_v3)")
        out.append(AcctRecord(pid, ppid, comm.split(b"\0", 1)[0].decode("utf-8", "replace"),
                              (_comp_t(utime) + _comp_t(stime)) / ACCT_HZ, bool(flag & ACCT_FORKED)))
    return out


class Accounting:
    """The kernel's process accounting over a window (``accton FILE`` ... ``accton off``): it records
    every process of the machine as it ends, so the trainer's tree is picked out by parent ids (the
    live tree as last sampled, plus the records' own ppid chains)."""

    def __init__(self, work: Path):
        self.path = work / "pacct"
        self.on = False

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self.path.touch()
        subprocess.run([ACCTON, str(self.path)], check=True, capture_output=True)
        self.on = True

    def stop(self) -> None:
        if self.on:
            subprocess.run([ACCTON, "off"], check=True, capture_output=True)
            self.on = False

    def summary(self, root: int, live: set[int]) -> dict:
        """Per (where, command name): processes, of them forked only, CPU seconds; for the trainer's
        tree only. 'where' is 'sandbox' below a ``bwrap`` (bwrap itself and pxd included), else 'host'."""
        records = read_acct(self.path)
        parent = {r.pid: r.ppid for r in records}
        comm = {r.pid: r.comm for r in records}
        known = {root, *live}

        def chain(pid: int) -> list[int]:
            out = [pid]
            while pid in parent and len(out) < 64:
                pid = parent[pid]
                out.append(pid)
            return out

        rows: dict[tuple[str, str], list] = {}
        sandboxes: dict[int, list[str]] = {}  # the outermost bwrap's pid: what ended in it
        for r in records:
            path = chain(r.pid)
            if not known.intersection(path):
                continue
            boxes = [p for p in path if comm.get(p) == "bwrap"]
            where = "sandbox" if boxes else "host"
            if boxes:
                sandboxes.setdefault(boxes[-1], []).append(
                    "bwrap" if r.comm == "bwrap" else f"{r.comm}{'(fork)' if r.forked_only else ''}")
            row = rows.setdefault((where, r.comm), [0, 0, 0.0])
            row[0] += 1
            row[1] += r.forked_only
            row[2] += r.cpu_s
        kinds: dict[str, int] = {}
        for names in sandboxes.values():  # a sandbox's kind: how many of each process ended in it
            counted: dict[str, int] = {}
            for name in names:
                counted[name] = counted.get(name, 0) + 1
            kind = " ".join(f"{n}x{name}" for name, n in sorted(counted.items()))
            kinds[kind] = kinds.get(kind, 0) + 1
        return {"rows": {f"{where}:{name}": {"processes": n, "forked_only": f, "cpu_s": cpu}
                         for (where, name), (n, f, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][0])},
                "sandboxes": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def resolved_plan(code: Path, home: Path, steps: int, run_name: str, overrides: dict | None = None) -> dict:
    """The plan of ``code``'s ``examples/embedded.toml``, resolved by that code's planner, on ``home``;
    ``overrides``: trainer keys set on top (a trial's)."""
    toml = code / "examples" / "embedded.toml"
    out = subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str(toml), str(home / "models" / "base")],
                         cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True,
                         check=True)
    plan = json.loads(out.stdout)
    plan["trainer"].update({"base_model": str(home / "models" / "base"), "tasks": str(home / "datasets" / "bundled"),
                            "steps": steps, "checkpoint_every": steps + 1, "run_name": run_name,
                            **(overrides or {})})
    return plan


def profile(code: Path, home: Path, steps: int, interval_s: float, work: Path, label: str,
            overrides: dict | None = None, environ: dict | None = None, acct: bool = False) -> dict:
    """Run ``steps`` steps of ``code``'s embedded default and return its CPU split and groups/s."""
    run_dir = work / label
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    plan = resolved_plan(code, home, steps, f"profile-{label}", overrides)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))
    engine_args = plan["inference"].get("local_engine_args") or []
    settings = {**{k: plan["trainer"].get(k) for k in ("groups_per_step", "producer_workers", "episode_workers")
                   if k in plan["trainer"]},
                **{k: v for k, v in (overrides or {}).items()}, **(environ or {}),
                "engine": " ".join(map(str, engine_args))}
    env = {**os.environ, **(environ or {}), "PYTHONPATH": str(code), "POSTTRAIN_HOME": str(home),
           "PYTHONUNBUFFERED": "1"}
    log = open(run_dir / "trainer.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "training", "--config", str(run_dir / "plan.json"),
                             "--run-dir", str(run_dir / "run")], cwd=code, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    group = open_group(f"loop-profile-{label.replace(' ', '-')}")
    if group is not None:
        group.join(proc.pid)  # before it starts anything: it is still importing
    tracker = Tracker(proc.pid)
    steps_done: list[tuple[int, int, float, float, Sample]] = []  # step, groups, train_s, at, sample
    lock = threading.Lock()
    accounting = Accounting(run_dir) if acct else None

    def read_steps() -> None:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = STEP_LINE.match(line)
            if m:
                with lock:
                    tracker.sample()
                    at = time.monotonic()
                    steps_done.append((int(m[1]), int(m[2]), float(m[3]), at,
                                       Sample(at, tracker.totals(), machine_busy_s(),
                                              group.cpu_s() if group is not None else 0.0)))
                    if accounting and len(steps_done) == 1:
                        accounting.start()
                    elif accounting and len(steps_done) == steps:
                        accounting.stop()

    reader = threading.Thread(target=read_steps, daemon=True)
    reader.start()
    me = psutil.Process()
    profiler_cpu0 = sum(me.cpu_times()[:2])
    profiling_started = time.monotonic()
    try:
        while proc.poll() is None and len(steps_done) < steps:
            with lock:
                tracker.sample()
            time.sleep(interval_s)
    finally:
        if accounting:
            with lock:
                accounting.stop()
    profiler_cpu_s = sum(me.cpu_times()[:2]) - profiler_cpu0
    profiling_s = time.monotonic() - profiling_started
    if len(steps_done) < max(2, steps):
        proc.wait()
        reader.join(timeout=10)
        log.close()
        tail = (run_dir / "trainer.log").read_text()[-3000:]
        raise SystemExit(f"{label}: the trainer exited with {proc.returncode} after {len(steps_done)} steps; "
                         f"log {run_dir / 'trainer.log'}:\n{tail}")
    first, last = steps_done[0], steps_done[-1]
    window_s = last[3] - first[3]
    groups = sum(s[1] for s in steps_done[1:])
    train_s = sum(s[2] for s in steps_done[1:])
    cpu = {k: last[4].cpu_s[k] - first[4].cpu_s[k] for k in last[4].cpu_s}
    step_cpu = cpu["trainer main thread"]
    split = {"model": cpu["model"], "episode commands": cpu["episode commands"],
             "sandbox start/stop": cpu["sandbox start/stop"], "trainer step": step_cpu,
             "else": cpu["serving"] + cpu["other"] + cpu["trainer"] - step_cpu}
    detail = {"serving HTTP and capture": cpu["serving"], "trainer process outside the step": cpu["trainer"] - step_cpu,
              "other processes": cpu["other"]}
    machine_s = last[4].machine_busy_s - first[4].machine_busy_s
    result = {"label": label, "code": str(code), "settings": settings, "steps": len(steps_done),
              "window_s": window_s, "groups": groups, "groups_per_s": groups / window_s, "cpu_s": split,
              "else_detail": detail, "train_wall_s": train_s, "cores_busy": sum(split.values()) / window_s,
              "profiler_cpu_s": profiler_cpu_s,
              "reaped_s": cpu["trainer's reaped children"],
              "tree_s": (last[4].tree_s - first[4].tree_s) if group is not None and group.counts_sandboxes else None, "machine_busy_s": machine_s, "machine_cores": os.cpu_count(),
              # the profiler's own CPU is spread over the whole call; its share of the window is taken out
              "unseen_s": max(0.0, machine_s - sum(split.values()) - profiler_cpu_s * window_s / max(profiling_s, 1e-9))}
    if accounting:
        result["acct"] = accounting.summary(proc.pid, tracker.seen)
    print_side(result)
    # the figures are in; the trainer still finishes the groups in flight and stops its engine
    print(f"{label}: waiting for the trainer to stop", file=sys.stderr, flush=True)
    proc.wait()
    reader.join(timeout=10)
    log.close()
    if group is not None:
        group.close()
    if proc.returncode != 0:
        raise SystemExit(f"{label}: the trainer exited with {proc.returncode}; log {run_dir / 'trainer.log'}")
    return result


def print_side(result: dict) -> None:
    total = sum(result["cpu_s"].values())
    print(f"{result['label']}: {result['groups']} groups in {result['window_s']:.1f} s (the steps' train_s "
          f"{result['train_wall_s']:.1f} s) = "
          f"{result['groups_per_s']:.2f} groups/s; CPU {total:.1f} s ({result['cores_busy']:.2f} cores busy); "
          f"settings {json.dumps(result['settings'])}")
    for bucket in BUCKETS:
        seconds = result["cpu_s"][bucket]
        print(f"  {bucket:20s} {seconds:7.1f} s  {100 * seconds / max(total, 1e-9):5.1f}%  "
              f"{seconds / result['groups']:.2f} s a group")
    print("    else: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result["else_detail"].items()))
    if "machine_busy_s" in result:
        print(f"  machine (/proc/stat)  {result['machine_busy_s']:7.1f} s busy of {result['machine_cores']} cores = "
              f"{result['machine_busy_s'] / result['window_s']:.2f} cores busy, "
              f"{result['machine_busy_s'] / result['groups']:.2f} s a group; not seen by the sampler "
              f"{result['unseen_s']:.1f} s ({result['unseen_s'] / result['groups']:.2f} s a group: processes "
              "that start and end between samples, mostly sandbox starts and test runs; or other load)")
    groups = result["groups"]
    if result.get("tree_s") is not None:
        print(f"  the trainer's whole tree (cpuacct: every process it started, sandboxes included, nothing else): "
              f"{result['tree_s']:.1f} s = {result['tree_s'] / result['window_s']:.2f} cores, "
              f"{result['tree_s'] / groups:.2f} s a group; beyond the sampler's "
              f"{(result['tree_s'] - sum(result['cpu_s'].values())) / groups:.2f} s a group")
    if "reaped_s" in result:
        print(f"  the trainer's ended children (their rusage, short-lived ones included): "
              f"{result['reaped_s']:.1f} s, {result['reaped_s'] / groups:.2f} s a group")
    if result.get("acct"):
        rows = result["acct"]["rows"]
        print(f"  processes ended in the window (process accounting), the trainer's tree: "
              f"{sum(r['processes'] for r in rows.values()) / groups:.1f} a group (CPU in 10 ms ticks: "
              "a shorter process shows 0)")
        for name, row in rows.items():
            if row["cpu_s"] / groups < 0.005 and row["processes"] / groups < 0.5:
                continue
            print(f"    {name:32s} {row['processes'] / groups:6.1f} a group ({row['forked_only'] / groups:5.1f} "
                  f"forked only)  {row['cpu_s'] / groups:.3f} s CPU a group")
        boxes = result["acct"]["sandboxes"]
        print(f"  sandboxes that ended: {sum(boxes.values()) / groups:.1f} a group; by what ended in them:")
        for kind, n in list(boxes.items())[:12]:
            print(f"    {n / groups:5.2f} a group: {kind}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="a posttrain home with models/base and datasets/bundled")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--baseline", default="fdf7a51",
                        help="the commit whose configuration is the baseline; several, comma-separated, run in turn")
    parser.add_argument("--interval-s", type=float, default=0.25)
    parser.add_argument("--only", choices=("baseline", "current"), help="run one side only")
    parser.add_argument("--code", type=Path, default=REPO, help="the current side's code (default: this checkout)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "loop-profile")
    parser.add_argument("--acct", action="store_true",
                        help="process accounting over the window (root, accton): every ended process by name")
    parser.add_argument("--json", type=Path, help="write both sides' figures here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer key for the current side (JSON value), for trials")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the current side's trainer (POSTTRAIN_ENGINE=local)")
    args = parser.parse_args(argv)
    if args.acct and not (os.geteuid() == 0 and Path(ACCTON).is_file()):
        raise SystemExit(f"--acct needs root and {ACCTON} (Debian's acct package)")
    home = args.home.resolve()
    for need in (home / "models" / "base" / "config.json", home / "datasets" / "bundled" / "suite.json"):
        if not need.is_file():
            raise SystemExit(f"{need} is missing: build the base model and the bundled suite in {home} first")
    overrides = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    results = []
    if args.only != "current":
        for commit in args.baseline.split(","):
            results.append(profile(baseline_tree(commit, "lp-base"), home, args.steps, args.interval_s, args.work,
                                   f"baseline {commit}", acct=args.acct))
    if args.only != "baseline":
        results.append(profile(args.code.resolve(), home, args.steps, args.interval_s, args.work, "current",
                               overrides, dict(item.split("=", 1) for item in args.env), acct=args.acct))
    if len(results) >= 2:
        cur = results[-1]
        for base in results[:-1]:
            print(f"groups/s: {cur['groups_per_s']:.2f} against {base['label']}'s {base['groups_per_s']:.2f}, "
                  f"ratio {cur['groups_per_s'] / base['groups_per_s']:.2f}x; CPU a group "
                  f"{sum(cur['cpu_s'].values()) / cur['groups']:.2f} s against "
                  f"{sum(base['cpu_s'].values()) / base['groups']:.2f} s (sampled); the machine's "
                  f"{cur['machine_busy_s'] / cur['groups']:.2f} s against "
                  f"{base['machine_busy_s'] / base['groups']:.2f} s")
    print(f"profiler's own CPU: {sum(r['profiler_cpu_s'] for r in results):.1f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
