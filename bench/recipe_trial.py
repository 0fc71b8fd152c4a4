"""One RL recipe trial on a finished demo's home: the demo's RL run again with some trainer keys
changed, its final checkpoint evaluated as the demo evaluates, and the paired change in held-out
pass@1 against the base model's evaluation already in the home (same tasks, attempts and seeds).

    .venv/bin/python bench/recipe_trial.py --home /tmp/demoRh --name seq --set loss_weighting=sequence

A trial reuses the home's suite, base model and curriculum (``runs/demo/trainer-config.json`` with
``--set`` applied, ``run_name`` set to ``--name``), so it costs the RL steps and one evaluation
(about 10 minutes on 2 cores) rather than a whole demo, and its change is paired with the base's
rows of that demo. It prints the trial's pass@1 and the demo's own final checkpoint's side by side,
each as a change from the base with its 95% interval, and how the attempts ended (committed and
passed, committed and failed, out of turns), and how each run's training went (reward of its first
and last quarter of steps, groups without variance or discarded, policy age, importance weight).
Run nothing else meanwhile: episodes share 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from dagster_project.demo import DEMO_EVAL  # noqa: E402
from evals.evaluate import evaluate_checkpoint, load_eval_tasks  # noqa: E402
from evals.report import base_checkpoint, headlines, load_attempt_rows, newest_runs  # noqa: E402
from evals.sandbox import platform_sandbox_factory  # noqa: E402
from training.checkpoint import metrics_dir  # noqa: E402
from training.config import TrainConfig  # noqa: E402


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def endings(rows) -> str:
    solved = rows["reward"] >= 1
    committed = rows["stop_reason"] == "commit"
    n = len(rows)
    return (f"committed and passed {100 * (committed & solved).sum() / n:.0f}%, committed and failed "
            f"{100 * (committed & ~solved).sum() / n:.0f}%, out of turns {100 * (rows['stop_reason'] == 'max_turns').sum() / n:.0f}%, "
            f"turns {rows['turns'].mean():.2f}")


def training_summary(run_dir: Path) -> str:
    """How the run's training went, from its step metrics: the reward of its first and last quarter
    of steps, the groups without reward variance and those discarded as stale, the sampling policy's
    mean age and the mean truncated importance weight."""
    steps = pd.read_parquet(metrics_dir(run_dir) / "steps.parquet").sort_values("step")
    q = max(len(steps) // 4, 1)
    return (f"reward {steps['reward_mean'].head(q).mean():.3f} (first {q} steps) -> {steps['reward_mean'].tail(q).mean():.3f} "
            f"(last {q}), groups without variance {int(steps['zero_variance_groups'].sum())} of "
            f"{int(steps['groups'].sum())}, discarded stale {int(steps['discarded_groups'].sum())}, policy age "
            f"{steps['policy_age_mean'].mean():.2f}, importance weight {steps['mean_is_weight'].mean():.3f} "
            f"(capped {100 * steps['clipped_is_fraction'].mean():.1f}%)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home (posttrain demo --home DIR)")
    parser.add_argument("--name", required=True, help="the trial's run name (its folder: HOME/runs/NAME)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer key to change (JSON value), e.g. loss_weighting=sequence; repeatable")
    parser.add_argument("--demo-run", default="demo", help="the demo's run name in the home (default %(default)s)")
    parser.add_argument("--rl-engine", choices=("vllm", "local"), default=None,
                        help="the engine the trial's RL run samples with (POSTTRAIN_ENGINE for the trainer only; "
                             "the evaluation stays on this process's engine, as the base's did); default: unchanged")
    args = parser.parse_args()
    home = args.home
    demo_cfg = home / "runs" / args.demo_run / "trainer-config.json"
    if not demo_cfg.is_file():
        raise SystemExit(f"{demo_cfg}: not found; --home must be a finished demo's home")
    cfg = json.loads(demo_cfg.read_text())
    keys = TrainConfig.keys()  # the trainer JSON's keys, the loss's (loss_weighting, ...) among them
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(keys))}")
        cfg[key] = parse_value(value)
    cfg["run_name"] = args.name
    try:  # a bad value is refused now, not after the trainer starts
        TrainConfig.from_mapping(cfg, source="--set")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    # The demo's own evaluations, read before the 10 minutes of RL rather than after them.
    evaluated = newest_runs(load_attempt_rows(home / "evals" / "deepswe"))
    base_key = f"{args.demo_run}-step_000000"
    ours = sorted(k for k in set(evaluated.get("checkpoint", [])) if k.startswith(f"{args.demo_run}-step_"))
    if base_key not in ours or len(ours) < 2:
        raise SystemExit(f"{home}/evals/deepswe: expected the evaluations of {base_key} and a later checkpoint of "
                         f"run {args.demo_run!r}, found {ours or 'none'}; run posttrain demo --home {home} first")
    base = evaluated[evaluated["checkpoint"] == base_key]
    demo_final = ours[-1]
    demo = evaluated[evaluated["checkpoint"] == demo_final]
    run_dir = home / "runs" / args.name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: pick another --name")
    run_dir.mkdir(parents=True)
    (run_dir / "trainer-config.json").write_text(json.dumps(cfg, indent=1))
    started = time.monotonic()
    with open(run_dir / "trainer.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "training", "--config", str(run_dir / "trainer-config.json"),
                                "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "POSTTRAIN_ENGINE": args.rl_engine} if args.rl_engine else None)
    if code:
        raise SystemExit(f"the trainer exited {code}; see {run_dir / 'trainer.log'}")
    rl_s = time.monotonic() - started
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    key = f"{args.name}-{final.name}"
    tasks = load_eval_tasks("bundled", "eval", bundled_dir=home / "datasets" / "bundled")
    rows = evaluate_checkpoint(
        tasks, cfg["base_model"], platform_sandbox_factory(cfg["sandbox_runtime"]), checkpoint=key,
        adapter=final / "adapter", adapter_version=final.name, attempts=DEMO_EVAL["attempts"],
        max_turns=DEMO_EVAL["max_turns"], max_new_tokens=cfg["max_new_tokens"], workers=DEMO_EVAL["workers"],
        engine_log=run_dir / "eval-engine.log")
    trial = pd.DataFrame(rows)
    trial.to_parquet(run_dir / "eval-rows.parquet")
    eval_s = time.monotonic() - started - rl_s

    change = " ".join(args.set + ([f"RL on the {args.rl_engine} engine"] if args.rl_engine else [])) or "no change"
    print(f"trial {args.name}: {change}; RL {rl_s:.0f} s, evaluation {eval_s:.0f} s")
    print(f"base {base_key}: pass@1 {100 * (base['reward'] >= 1).mean():.1f}%  ({endings(base)})")
    lines = {}
    for name, frame in ((demo_final, demo), (key, trial)):
        paired = base.assign(checkpoint=base_checkpoint(name))  # the base's rows as this run's step 0
        h = headlines(pd.concat([paired, frame], ignore_index=True))
        h = [x for x in h if x.checkpoint == name][0]
        c = h.change
        levels = "  ".join(f"L{lv['level']} {100 * lv['base']:.1f}->{100 * lv['new']:.1f}" for lv in h.levels)
        lines[name] = c.value
        print(f"{name}: pass@1 {100 * h.pass_at_1:.1f}%, change {100 * c.value:+.1f} "
              f"[{100 * c.low:+.1f}, {100 * c.high:+.1f}]  {levels}  ({endings(frame)})")
    print(f"trial against the demo's own run: {100 * lines[key]:+.1f} against {100 * lines[demo_final]:+.1f} points")
    for name, folder in ((args.demo_run, home / "runs" / args.demo_run), (args.name, run_dir)):
        print(f"training of {name}: {training_summary(folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
