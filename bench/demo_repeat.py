"""N fresh runs of ``posttrain demo``, each in a home of its own with its own trainer seed: each run's
wall time, the paired change in held-out pass@1 from the base with its 95% interval (paired bootstrap
over tasks), level 3's change, and the mean over runs against the target.

    .venv/bin/python bench/demo_repeat.py --runs 3 --out /tmp/demo-repeat

Each run is a separate process (the Dagster instance comes from the environment), so nothing of one
run is reused by the next: suite, base model, curriculum, RL and evaluations are all rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dagster_project.demo import run_demo
from dagster_project.instance import ensure_dagster_home
from evals.report import headlines, load_attempt_rows, newest_runs

TARGET_POINTS = 8.4  # each run's gain in held-out pass@1
TARGET_MEAN_POINTS = 10.0


def one_run(home: Path, seed: int) -> int:
    os.environ.pop("DAGSTER_HOME", None)  # the run's instance lives in its own home
    ensure_dagster_home(str(home))  # what `posttrain demo --home HOME` does first
    return run_demo("demo", seed=seed)


def summary(home: Path) -> dict:
    rows = newest_runs(load_attempt_rows(home / "evals" / "deepswe"))
    heads = headlines(rows)
    if not heads:
        raise RuntimeError(f"{home}: no checkpoint was evaluated beside the base model")
    h = heads[-1]
    level3 = next((lv for lv in h.levels if lv["level"] == 3), None)
    return {"checkpoint": h.checkpoint, "base": round(100 * h.base_pass_at_1, 1), "final": round(100 * h.pass_at_1, 1),
            "change": round(100 * h.change.value, 1), "low": round(100 * h.change.low, 1),
            "high": round(100 * h.change.high, 1), "tasks": h.change.n_tasks,
            "level3_change": round(100 * level3["change"].value, 1) if level3 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh demo runs (default 3)")
    parser.add_argument("--out", default="/tmp/posttrain-demo-repeat", help="folder for the runs' homes")
    parser.add_argument("--first-seed", type=int, default=0, help="trainer seed of the first run; run i uses first + i")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return one_run(Path(args.home), args.seed)

    out = Path(args.out)
    results = []
    for i in range(args.runs):
        home = out / f"run-{i}"
        if home.exists():
            raise SystemExit(f"{home} exists: give --out a fresh folder (every run starts from nothing)")
        home.mkdir(parents=True)
        seed = args.first_seed + i
        started = time.monotonic()
        with open(home / "demo.log", "w") as log:
            rc = subprocess.run([sys.executable, __file__, "--one", "--home", str(home), "--seed", str(seed)],
                                stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - started
        if rc != 0:
            raise SystemExit(f"run {i} (seed {seed}) failed with exit code {rc}; see {home / 'demo.log'}")
        row = {"run": i, "seed": seed, "wall_min": round(wall / 60, 1), **summary(home)}
        results.append(row)
        level3 = f", level 3 {row['level3_change']:+.1f}" if row["level3_change"] is not None else ""
        print(f"run {i} seed {seed}: {row['wall_min']} min, pass@1 {row['base']}% -> {row['final']}%, change "
              f"{row['change']:+.1f} [{row['low']:+.1f}, {row['high']:+.1f}] ({row['tasks']} tasks){level3}", flush=True)
    mean = sum(r["change"] for r in results) / len(results)
    level3 = [r["level3_change"] for r in results if r["level3_change"] is not None]
    print(f"mean change {mean:+.1f} points over {len(results)} runs (target: each >= +{TARGET_POINTS} with CI above 0, "
          f"mean >= +{TARGET_MEAN_POINTS}); every run's CI above 0: {all(r['low'] > 0 for r in results)}; "
          f"slowest run {max(r['wall_min'] for r in results)} min (target < 20)"
          + (f"; level 3 mean change {sum(level3) / len(level3):+.1f}" if level3 else ""))
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
