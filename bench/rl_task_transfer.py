"""What an RL run learned on its own training tasks, and whether it carried over to the tasks it never
drew: the run's final checkpoint is evaluated on the RL tasks of a finished demo's home, with the
curriculum's settings, and set beside the base model's attempts on those tasks that the curriculum
measured (``curriculum/base_attempts.parquet``), grouped by how many groups the run drew of each task.

    .venv/bin/python bench/rl_task_transfer.py --home /tmp/demoRh --run demo

A gain only on the tasks drawn often, none on the tasks never drawn, says the run learned those
tasks rather than a skill the held-out tasks share. About 2 minutes on 2 cores (270 episodes);
run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from dagster_project.demo import DEMO_CURRICULUM  # noqa: E402
from evals.bundled import read_suite  # noqa: E402
from evals.evaluate import evaluate_checkpoint  # noqa: E402
from evals.sandbox import platform_sandbox_factory  # noqa: E402
from evals.tasks import rl_tasks  # noqa: E402
from training.checkpoint import list_checkpoints, store_path  # noqa: E402
from training.curriculum import BASE_ATTEMPTS_FILE, CURRICULUM_FILE  # noqa: E402

DRAWN_BINS = ((0, 0), (1, 2), (3, None))


def summary(name: str, rows) -> str:
    solved = rows["reward"] >= 1
    levels = "  ".join(f"L{level} {100 * s.mean():.1f}%" for level, s in solved.groupby(rows["difficulty"]))
    committed = rows["stop_reason"] == "commit"
    return (f"{name}: pass@1 {100 * solved.mean():.1f}%  {levels}  (committed and failed "
            f"{100 * (committed & ~solved).mean():.0f}%, out of turns {100 * (rows['stop_reason'] == 'max_turns').mean():.0f}%)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home (posttrain demo --home DIR)")
    parser.add_argument("--run", default="demo", help="the run in HOME/runs whose final checkpoint is evaluated")
    args = parser.parse_args()
    run_dir = args.home / "runs" / args.run
    config_path = run_dir / "trainer-config.json"
    base_path = args.home / "curriculum" / BASE_ATTEMPTS_FILE
    for path, what in ((config_path, "the run's trainer config"), (base_path, "the curriculum's base attempts")):
        if not path.is_file():
            raise SystemExit(f"{path}: not found ({what}); --home must be a finished demo's home and --run one of its runs")
    cfg = json.loads(config_path.read_text())
    measured = json.loads((args.home / "curriculum" / CURRICULUM_FILE).read_text())
    base = pd.read_parquet(base_path)
    saved = list_checkpoints(run_dir)
    if not saved:
        raise SystemExit(f"{run_dir}: no complete checkpoint")
    final = saved[-1].path

    tasks = rl_tasks(read_suite(args.home / "datasets" / "bundled"))
    rows = pd.DataFrame(evaluate_checkpoint(
        tasks, cfg["base_model"], platform_sandbox_factory(cfg["sandbox_runtime"]),
        checkpoint=f"{args.run}-rl-tasks-{final.name}", adapter=final / "adapter", adapter_version=final.name,
        attempts=int(measured["attempts_per_task"]), max_turns=cfg["max_turns"], max_new_tokens=cfg["max_new_tokens"],
        workers=DEMO_CURRICULUM["workers"]))

    with sqlite3.connect(store_path(run_dir)) as conn:
        drawn = dict(conn.execute("SELECT task_id, COUNT(*) FROM groups GROUP BY task_id").fetchall())
    print(f"{len(tasks)} RL tasks, {int(measured['attempts_per_task'])} attempts each; run {args.run}, {final.name}")
    print(summary("base", base))
    print(summary(final.name, rows))
    before = (base["reward"] >= 1).groupby(base["task_id"]).mean()
    after = (rows["reward"] >= 1).groupby(rows["task_id"]).mean()
    for low, high in DRAWN_BINS:
        ids = [t for t in after.index if drawn.get(t, 0) >= low and (high is None or drawn.get(t, 0) <= high)]
        label = f"{low}+" if high is None else (f"{low}" if low == high else f"{low}-{high}")
        print(f"  drawn in {label} groups: {len(ids)} tasks, pass@1 {100 * before[ids].mean():.1f}% -> "
              f"{100 * after[ids].mean():.1f}% ({100 * (after[ids].mean() - before[ids].mean()):+.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
