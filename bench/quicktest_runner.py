"""posttrain's quick test runner (evals/quicktest.py) against pytest on the bundled suite's tests.

For each sampled bundled task and each of four states of its module (the base commit, the
reference fix, a function that raises, a syntax error), runs the task's tests under pytest (the
command the suite used before: ``python3 -m pytest -q -p no:cacheprovider --tb=short --junitxml``,
plugin autoloading off) and under the quick runner (the suite's ``TEST_COMMAND``), and checks that
the two agree on what the harness and the grader read: the exit status, the ``test`` action's
observation (:func:`evals.harness.execute`'s summary of the output) and every test's status in the
JUnit report. Prints the disagreements, then the CPU per run of each (user + system of the runner's
process, on the host) and the wall time per run inside a bubblewrap sandbox, side by side as ratios.

    .venv/bin/python bench/quicktest_runner.py [--tasks 60] [--sandbox-runs 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evals.actions import apply_edits, failing_summary  # noqa: E402
from evals.bundled import REPORT, TEST_COMMAND, generate  # noqa: E402
from evals.grading import parse_junit_bytes  # noqa: E402
from evals.harness import error_lines  # noqa: E402
import sandboxes  # noqa: E402
from sandboxes.cache import LayerCache  # noqa: E402
from sandboxes.images import ImageStore  # noqa: E402

PYTEST_COMMAND = f"python3 -m pytest -q -p no:cacheprovider --tb=short --junitxml={REPORT} tests"


def observation(code: int, output: str) -> str:
    if code == 0:
        return "all tests pass"
    return (failing_summary(output) or error_lines(output) or "<raw output>").replace("AssertionError: ", "")


def states(gen) -> dict[str, str]:
    module = gen.files[f"{gen.module}.py"]
    fixed = apply_edits(module, [(line, text) for _, line, text in gen.reference_edits])
    first_line = gen.reference_edits[0][1]
    raising = apply_edits(module, [(first_line, "    return undefined_name")])
    return {"base": module, "fixed": fixed, "raises": raising, "syntax_error": module + "\ndef broken(:\n"}


def run(command: str, repo: Path) -> tuple[int, str, dict, float]:
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    (repo / REPORT).unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(command, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = repo / REPORT
    statuses = {k: v.name for k, v in parse_junit_bytes(report.read_bytes(), str(report)).items()} if report.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, statuses, cpu


def sandbox_wall(gens, root: Path, runs: int) -> dict[str, float]:
    """Wall seconds per run of each command inside one bubblewrap sandbox per task."""
    store, cache = ImageStore(root / "images"), LayerCache(root / "cache")
    walls = {"pytest": [], "quicktest": []}
    for gen in gens[:max(1, runs // 4)]:
        repo = root / "sandbox-src" / gen.id
        if repo.exists():
            shutil.rmtree(repo)
        shutil.copytree(root / "repos" / gen.id, repo)
        with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
            for _ in range(4):
                for name, command in (("pytest", PYTEST_COMMAND), ("quicktest", TEST_COMMAND)):
                    t0 = time.perf_counter()
                    sb.exec(command, timeout_s=60)
                    walls[name].append(time.perf_counter() - t0)
    return {k: sum(v) / len(v) for k, v in walls.items() if v}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=60, help="bundled tasks sampled, evenly over the suite (0: all)")
    parser.add_argument("--sandbox-runs", type=int, default=20, help="runs of each command timed in sandboxes (0: none)")
    args = parser.parse_args(argv)
    gens = generate()
    if args.tasks:
        step = max(1, len(gens) // args.tasks)
        gens = gens[::step][:args.tasks]
    root = Path(tempfile.mkdtemp(prefix="posttrain-quicktest-bench-"))
    disagreements, cpu = [], {"pytest": [], "quicktest": []}
    try:
        for gen in gens:
            repo = root / "repos" / gen.id
            for rel, text in gen.files.items():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                (repo / rel).write_text(text)
            for state, module in states(gen).items():
                (repo / f"{gen.module}.py").write_text(module)
                p_code, p_out, p_status, p_cpu = run(PYTEST_COMMAND, repo)
                q_code, q_out, q_status, q_cpu = run(TEST_COMMAND, repo)
                cpu["pytest"].append(p_cpu)
                cpu["quicktest"].append(q_cpu)
                p_obs, q_obs = observation(p_code, p_out), observation(q_code, q_out)
                for what, a, b in (("exit", p_code, q_code), ("observation", p_obs, q_obs), ("statuses", p_status, q_status)):
                    if a != b:
                        disagreements.append(f"{gen.id} [{state}] {what}: pytest {a!r} / quicktest {b!r}")
            (repo / f"{gen.module}.py").write_text(gen.files[f"{gen.module}.py"])
        runs = len(cpu["pytest"])
        print(f"{len(gens)} tasks x 4 states: {runs} runs of each; disagreements: {len(disagreements)}")
        for line in disagreements[:20]:
            print("  " + line)
        p_cpu, q_cpu = sum(cpu["pytest"]) / runs, sum(cpu["quicktest"]) / runs
        print("| per run | pytest | quick runner | ratio |")
        print("| --- | --- | --- | --- |")
        print(f"| CPU s (host, user + system) | {p_cpu:.3f} | {q_cpu:.3f} | {q_cpu / p_cpu:.2f}x |")
        if args.sandbox_runs:
            walls = sandbox_wall(gens, root, args.sandbox_runs)
            print(f"| wall s in a bwrap sandbox | {walls['pytest']:.3f} | {walls['quicktest']:.3f} | "
                  f"{walls['quicktest'] / walls['pytest']:.2f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if disagreements else 0


if __name__ == "__main__":
    raise SystemExit(main())
