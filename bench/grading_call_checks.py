"""The cost of grading a bundled attempt: this checkout against a baseline commit, side by side.

Grading a bundled task (:mod:`evals.call_checks`) makes each call in a process of its own that cannot
write the results stream, and counts hidden inputs answered by the reference solution in a sandbox of
their own (once per task and process). The baseline is another commit's grading (default 1ec7686:
one probe process for all calls, hidden answers computed on the host), run from a git worktree of it.

The script builds a suite once, commits each sampled task's reference fix, then grades every task's
empty patch and its fix with both trees in turn (each in a worker process of its own, importing only
its tree's code), ``--repeats`` rounds, in real bubblewrap sandboxes. Each worker grades its tasks in
one process, as the trainer and an evaluation do, so the hidden answers are paid once per task: the
first grading of a task is reported apart from the later ones. Prints the median wall per grading of
each and the ratios, and checks that both give the honest fix 1.0 and the empty patch 0.0.

    .venv/bin/python bench/grading_call_checks.py [--tasks 9] [--repeats 2] [--baseline 1ec7686]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(suite: str, patches_file: str, repeats: int) -> None:
    """Grade every (task, patch) ``repeats`` times with the code on ``sys.path``; print JSON lines."""
    from evals.bundled import default_sandbox_factory
    from evals.grading import grade_patch
    from evals.tasks import load_bundled

    patches = json.loads(Path(patches_file).read_text())
    tasks = {t.id: t for t in load_bundled(suite).tasks}
    factory = default_sandbox_factory()
    seen: set[str] = set()
    for _ in range(repeats):
        for task_id, by_name in patches.items():
            for name, patch in by_name.items():
                started = time.perf_counter()
                result = grade_patch(tasks[task_id], patch, factory)
                wall = time.perf_counter() - started
                print(json.dumps({"task": task_id, "patch": name, "first": task_id not in seen, "wall_s": wall,
                                  "reward": result.scores.reward if result.scores else None}), flush=True)
                seen.add(task_id)


def run_worker(tree: Path, suite: Path, patches: Path, repeats: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import runpy; "
            "m = runpy.run_path(sys.argv[2]); m['worker'](sys.argv[3], sys.argv[4], int(sys.argv[5]))")
    done = subprocess.run([sys.executable, "-c", code, str(tree), __file__, str(suite), str(patches), str(repeats)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline", default="1ec7686", help="the commit to compare with (default: 1ec7686)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from evals.actions import apply_edits
    from evals.bundled import build_suite, default_sandbox_factory
    from evals.grading import committed_patch
    from evals.tasks import load_bundled

    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        tmp = Path(tmp)
        os.environ["POSTTRAIN_SANDBOX_DIR"] = str(tmp / "sandboxes")
        baseline = tmp / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline],
                       check=True, capture_output=True)
        try:
            build_suite(tmp / "suite", per_level=max(1, (args.tasks + 2) // 3), extra_eval_per_level=0,
                        rl_per_level=0, workers=2)
            tasks = list(load_bundled(tmp / "suite").tasks)[:args.tasks]
            factory = default_sandbox_factory()
            patches = {}
            for task in tasks:
                module = task.metadata["module_file"]
                edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
                with factory(task) as box:
                    box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
                    box.exec("git add -A && git commit -qm fix")
                    patches[task.id] = {"empty": "", "fix": committed_patch(box, task.base_commit)}
            (tmp / "patches.json").write_text(json.dumps(patches))
            results = {}
            for name, tree in (("baseline", baseline), ("this checkout", ROOT)):
                results[name] = run_worker(tree, tmp / "suite", tmp / "patches.json", args.repeats)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], capture_output=True)
    print(f"{len(tasks)} tasks x 2 patches (empty, reference fix) x {args.repeats} rounds; baseline {args.baseline}")
    medians = {}
    for name, rows in results.items():
        wrong = [r for r in rows if r["reward"] != (1.0 if r["patch"] == "fix" else 0.0)]
        first = [r["wall_s"] for r in rows if r["first"]]
        later = [r["wall_s"] for r in rows if not r["first"]]
        total = sum(r["wall_s"] for r in rows)
        medians[name] = (statistics.median(first), statistics.median(later), total / len(rows))
        print(f"{name:>14}: first grading of a task {medians[name][0] * 1000:.0f} ms, later gradings "
              f"{medians[name][1] * 1000:.0f} ms (medians), mean over all {medians[name][2] * 1000:.0f} ms; "
              f"wrong rewards: {len(wrong)}")
    new, old = medians["this checkout"], medians["baseline"]
    print(f"ratio (this checkout / baseline): first {new[0] / old[0]:.2f}x, later {new[1] / old[1]:.2f}x, "
          f"mean over all {new[2] / old[2]:.2f}x")


if __name__ == "__main__":
    main()
