"""What one grading and one new task's validation cost in CPU, sandboxes and commands, every process
counted, beside a baseline commit's code run the same way in the same call.

The RL loop grades every episode (:func:`evals.grading.grade_patch`) and validates every new task of
its task stream (:func:`evals.bundled.build_task`) on the trainer's host, each in fresh sandboxes.
The loop's profile (``bench/loop_profile.py``) sees them only in part: a grading's processes start
and end between two samples. Here each operation runs alone, in turn, on bundled tasks of a built
home, and its cost is read where nothing is missed:

- **all CPU**: a ``cpuacct`` group this process joins first (:mod:`bench.cpuacct`; root, cgroup v1
  with ``cpuacct`` mounted apart from ``cpu``, which the sandboxes' cgroups use): every process it
  started, however briefly it lived, sandboxes included, and nothing else of the machine;
- **host CPU**: this process alone (every thread: the grader's code, the pxd client, the sandbox's
  start and stop on the host); the rest of the whole is the processes (bwrap, pxd, the commands,
  the processes they forked; ``git`` on the host for a new task's repository);
- **sandboxes** started and **commands** run in them (``exec`` calls; the commands' text, shortened,
  with ``--commands``).

One side at a time runs in a child process with its code on ``PYTHONPATH`` (``--baseline COMMIT``:
a ``git worktree`` of it, kept in the temporary folder), so the figures of both come from the same
machine minutes apart. CPU is what the work took, not wall time, so load from elsewhere moves it
less; the load average is printed beside it.

``--steps`` measures an evaluation attempt step by step instead (:func:`run_steps`): a sandbox's
start and stop alone, one run of the task's quick test, a scripted episode without its grading, the
grading, and the hidden answers of a task for a factory that has none.

    .venv/bin/python bench/grading_profile.py --home HOME [--tasks 4] [--reps 3] [--baseline 1ec7686] [--steps]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worktrees import baseline_tree  # noqa: E402 - bench/ is no package

REPO = Path(__file__).resolve().parent.parent


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class Meter:
    """Counts sandboxes, commands and sandbox CPU (cgroups) by patching the classes this side's code
    uses; the bench's own instrumentation, not the code under test."""

    def __init__(self, show_commands: bool):
        import sandboxes
        from evals import sandbox as ev_sandbox

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpuacct import open_group

        self.sandboxes = 0
        self.commands: list[str] = []
        self.group = open_group("grading-profile")
        if self.group is None or not self.group.counts_sandboxes:
            raise SystemExit("grading_profile needs root and cgroup v1's cpuacct hierarchy (/sys/fs/cgroup/cpuacct)")
        self.group.join(os.getpid())
        original_start = sandboxes.start
        original_exec = ev_sandbox.PlatformSandbox.exec
        meter = self

        def start(*args, **kwargs):
            meter.sandboxes += 1
            return original_start(*args, **kwargs)

        def exec_(box, command, **kwargs):
            meter.commands.append(command)
            return original_exec(box, command, **kwargs)

        sandboxes.start = start
        ev_sandbox.PlatformSandbox.exec = exec_

    def measured(self, fn) -> dict:
        """What ``fn()`` cost: sandboxes, commands, CPU of the processes it started and of this one, wall."""
        s0, c0, sb0, h0 = self.reading()
        n0 = len(self.commands)
        t0 = time.monotonic()
        fn()
        wall = time.monotonic() - t0
        s1, c1, sb1, h1 = self.reading()
        return {"sandboxes": s1 - s0, "commands": c1 - c0, "sandbox_cpu_s": sb1 - sb0, "host_cpu_s": h1 - h0,
                "wall_s": wall, "command_text": [c[:160].replace("\n", " ") for c in self.commands[n0:]]}

    def reading(self) -> tuple[int, int, float, float]:
        host = _cpu_now()
        return self.sandboxes, len(self.commands), self.group.cpu_s() - host, host


def run_side(home: Path, tasks_n: int, reps: int, show_commands: bool) -> dict:
    """This side's figures: per grading of a reference patch (answers already kept, as in the loop
    where the task stream's validation answered them) and per validation of a new stream task."""
    from evals import bundled, grading
    from evals.sandbox import platform_sandbox_factory
    from evals.tasks import load_bundled

    factory = platform_sandbox_factory("bwrap")
    suite = load_bundled(home / "datasets" / "bundled")
    tasks = [t for t in suite.tasks if (t.metadata or {}).get("reference_edits")][:tasks_n]
    if not tasks:
        raise SystemExit(f"{home}/datasets/bundled has no task with reference_edits")
    meter = Meter(show_commands)
    measured = meter.measured

    patches = {}
    for task in tasks:  # the reference patch, and the hidden answers kept: set-up, not measured
        with factory(task) as box:
            edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
            module = task.metadata["module_file"]
            from evals.actions import apply_edits
            box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
            box.exec(f"git add {module} && git commit -q -m ref", timeout_s=30)
            patches[task.id] = grading.committed_patch(box, task.base_commit)
        result = grading.grade_patch(task, patches[task.id], factory)
        assert result.scores is not None and result.scores.reward == 1.0, (task.id, result.status, result.detail)
    gradings = []
    for _ in range(reps):
        for task in tasks:
            gradings.append(measured(lambda: grading.grade_patch(task, patches[task.id], factory)))
    validations = []
    with tempfile.TemporaryDirectory() as out:
        for index in range(reps):
            for level in (1, 2, 3)[:max(1, min(3, tasks_n))]:
                gen = bundled.stream_task(977, level, index)
                validations.append(measured(lambda: bundled.build_task(gen, Path(out) / "tasks", factory)))
    meter.group.close()
    return {"grading": gradings, "validation": validations}


class _Scripted:
    """Stands in for the model: answers each turn with the next of fixed texts (the episode's actions)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.calls = 0

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        ids = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        return {"output_ids": list(ids), "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in ids]}}


def run_steps(home: Path, tasks_n: int, reps: int, show_commands: bool) -> dict:
    """An evaluation attempt's work, step by step, on held-out tasks of the suite: a sandbox's start
    and stop alone; one run of the task's quick test (the agent's ``test`` action) in an open
    sandbox; an episode without its grading (a scripted agent: ``test``, the reference edits,
    ``test``, ``commit``, then its committed patch read; no model); the grading of that patch (the
    hidden answers already kept); the hidden answers of a task for a factory that has none (once a
    task and process: what an evaluation in a process of its own pays per task)."""
    from evals import call_checks, grading
    from evals.actions import demonstration
    from evals.harness import run_episode
    try:
        from evals.harness import grade_key
    except ImportError:  # a baseline before issue 55: its grade_cache was keyed by the task's id
        def grade_key(task, patch: str):
            return (task.id, hashlib.sha256(patch.encode()).hexdigest())
    from evals.sandbox import platform_sandbox_factory
    from evals.tasks import load_bundled
    from serving.tiny import build_tiny_tokenizer

    factory = platform_sandbox_factory("bwrap")
    suite = load_bundled(home / "datasets" / "bundled")
    tasks = [t for t in suite.tasks if t.split == "eval" and (t.metadata or {}).get("reference_edits")][:tasks_n]
    if not tasks:
        raise SystemExit(f"{home}/datasets/bundled has no held-out task with reference_edits")
    tokenizer = build_tiny_tokenizer()
    meter = Meter(show_commands)
    measured = meter.measured

    def episode(task):
        _, answer = demonstration(task)
        edits = answer.rsplit("commit", 1)[0]
        # its grading taken from a cache of this episode's own (measured apart, below)
        cache = {grade_key(task, patches[task.id]): graded[task.id]} if task.id in graded else None
        traj = run_episode(task, _Scripted(tokenizer, ["test\n", edits + "test\n", "commit\n"]), tokenizer,
                           factory, max_turns=5, grade_cache=cache)
        assert traj.committed and traj.reward == 1.0, (task.id, traj.stop_reason, traj.error)
        patches[task.id] = traj.patch

    rows: dict[str, list[dict]] = {k: [] for k in ("start_stop", "quicktest", "episode", "grading", "answers")}
    patches: dict[str, str] = {}
    graded: dict = {}
    for task in tasks:  # set-up, not measured: the answers kept, the code paths warm
        episode(task)
        graded[task.id] = grading.grade_patch(task, patches[task.id], factory)
    for _ in range(reps):
        for task in tasks:
            rows["start_stop"].append(measured(lambda: _open_close(factory, task)))
            with factory(task) as box:
                rows["quicktest"].append(measured(lambda: box.exec(task.test_command, timeout_s=60)))
            rows["episode"].append(measured(lambda: episode(task)))
            rows["grading"].append(measured(lambda: grading.grade_patch(task, patches[task.id], factory)))
            fresh = _fresh_factory()
            rows["answers"].append(measured(lambda: call_checks.graded_checks(task, fresh)))
    meter.group.close()
    return rows


def _open_close(factory, task) -> None:
    with factory(task):
        pass


def _fresh_factory():
    """A bwrap factory of its own (not the process's shared one): it has no hidden answers kept."""
    from evals.sandbox import platform_sandbox_factory

    real = platform_sandbox_factory("bwrap")

    def fresh(task):
        return real(task)
    return fresh


def summary(rows: list[dict]) -> dict:
    n = len(rows)
    keys = ("sandboxes", "commands", "sandbox_cpu_s", "host_cpu_s", "wall_s")
    out = {k: sum(r[k] for r in rows) / n for k in keys}
    out["n"] = n
    out["command_text"] = rows[-1]["command_text"]
    return out


def side(code: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", "--home", str(args.home), "--tasks",
           str(args.tasks), "--reps", str(args.reps), *(["--steps"] if args.steps else [])]
    out = subprocess.run(cmd, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{code}: the side failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def show(label: str, result: dict, commands: bool) -> None:
    for what in result:
        s = summary(result[what])
        print(f"{label:16s} {what:10s} (n={s['n']}): {s['sandboxes']:.1f} sandboxes, {s['commands']:.1f} commands, "
              f"CPU {1000 * (s['sandbox_cpu_s'] + s['host_cpu_s']):.0f} ms (the processes it started "
              f"{1000 * s['sandbox_cpu_s']:.0f}, this process {1000 * s['host_cpu_s']:.0f}), wall {1000 * s['wall_s']:.0f} ms")
        if commands:
            for c in s["command_text"]:
                print(f"      $ {c}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="a posttrain home with datasets/bundled")
    parser.add_argument("--tasks", type=int, default=4, help="bundled tasks graded (and stream tasks validated)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline", default="", help="commits to run beside this checkout, comma-separated")
    parser.add_argument("--code", type=Path, default=REPO, help="the current side's code")
    parser.add_argument("--commands", action="store_true", help="print the commands of one grading and validation")
    parser.add_argument("--steps", action="store_true", help="an eval attempt's steps instead (run_steps)")
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.home = args.home.resolve()
    if args.side:
        run = run_steps if args.steps else run_side
        print(json.dumps(run(args.home, args.tasks, args.reps, args.commands)))
        return 0
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")
    for commit in filter(None, args.baseline.split(",")):
        show(commit, side(baseline_tree(commit, "gp-base"), args), args.commands)
    show("current", side(args.code.resolve(), args), args.commands)
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
