"""A finished demo's base model and its run's final checkpoint evaluated again with another number of
turns an episode, side by side: does the trained policy gain from more retries than the demo gives it?

    .venv/bin/python bench/eval_turns.py --home /tmp/demoRh --turns 8

Both evaluations use the demo's other settings (``DEMO_EVAL``: attempts, workers; the run's
``max_new_tokens``) on the home's held-out split, served by vLLM as the demo serves them; it prints
each one's pass@1 and how its attempts ended, then the paired change with its 95% interval and per
level. About 3 minutes on 2 cores; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from bench.recipe_trial import endings  # noqa: E402
from dagster_project.demo import DEMO_EVAL  # noqa: E402
from evals.evaluate import evaluate_checkpoint, load_eval_tasks  # noqa: E402
from evals.report import base_checkpoint, headlines  # noqa: E402
from evals.sandbox import platform_sandbox_factory  # noqa: E402


def finished_run(home: Path, run: str) -> tuple[dict, Path, list]:
    """A finished demo home's run: its trainer config, its final checkpoint's folder, and the home's
    held-out tasks; exits naming the file when ``home`` is not one."""
    run_dir = home / "runs" / run
    if not (run_dir / "trainer-config.json").is_file():
        raise SystemExit(f"{run_dir}/trainer-config.json: not found; --home must be a finished demo's home")
    cfg = json.loads((run_dir / "trainer-config.json").read_text())
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return cfg, final, load_eval_tasks("bundled", "eval", bundled_dir=home / "datasets" / "bundled")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home (posttrain demo --home DIR)")
    parser.add_argument("--run", default="demo", help="the RL run whose final checkpoint is evaluated (default %(default)s)")
    parser.add_argument("--turns", type=int, required=True, help="model turns per episode")
    args = parser.parse_args()

    cfg, final, tasks = finished_run(args.home, args.run)
    key = f"{args.run}-{final.name}"
    frames = {}
    for name, adapter, version in ((base_checkpoint(key), None, None), (key, final / "adapter", final.name)):
        frames[name] = pd.DataFrame(evaluate_checkpoint(
            tasks, cfg["base_model"], platform_sandbox_factory(cfg["sandbox_runtime"]), checkpoint=name,
            adapter=adapter, adapter_version=version, attempts=DEMO_EVAL["attempts"], max_turns=args.turns,
            max_new_tokens=cfg["max_new_tokens"], workers=DEMO_EVAL["workers"]))
        frame = frames[name]
        print(f"{name} at {args.turns} turns: pass@1 {100 * (frame['reward'] >= 1).mean():.1f}%  ({endings(frame)})")
    h = [x for x in headlines(pd.concat(list(frames.values()), ignore_index=True)) if x.checkpoint == key][0]
    levels = "  ".join(f"L{lv['level']} {100 * lv['base']:.1f}->{100 * lv['new']:.1f}" for lv in h.levels)
    print(f"change {100 * h.change.value:+.1f} [{100 * h.change.low:+.1f}, {100 * h.change.high:+.1f}]  {levels}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
