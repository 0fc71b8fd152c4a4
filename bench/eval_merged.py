"""A checkpoint's evaluation with its adapter merged into the weights (how evaluations serve a
checkpoint, ``evals.evaluate.served_checkpoint``) against the same evaluation with the adapter
applied at run time by vLLM's LoRA layers, side by side in one run.

    .venv/bin/python bench/eval_merged.py --home /tmp/demoRh [--rounds 1]

Both evaluate a finished demo's final checkpoint on the home's held-out split with the demo's
settings (``DEMO_EVAL``: attempts, turns, workers; the run's ``max_new_tokens``) on real sandboxes,
each with a fresh vLLM replica. Printed for each: wall time, the machine's busy CPU over it
(``/proc/stat``, every process), the attempts' pass@1, and the ratio merged / LoRA. The pass@1 of
the two are samples of one policy (the merged weights round one sum differently in float32, and the
episodes' scheduling differs), so they agree within sampling noise, not to the attempt. About 7
minutes on 2 cores; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from bench.eval_turns import finished_run  # noqa: E402
from bench.loop_profile import machine_busy_s  # noqa: E402
from dagster_project.demo import DEMO_EVAL  # noqa: E402
from evals.evaluate import evaluate_checkpoint  # noqa: E402
from evals.sandbox import platform_sandbox_factory  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home (posttrain demo --home DIR)")
    parser.add_argument("--run", default="demo", help="the RL run whose final checkpoint is evaluated (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="times each way is measured, alternating")
    args = parser.parse_args()

    cfg, final, tasks = finished_run(args.home, args.run)
    print(f"{args.run}-{final.name} on {len(tasks)} held-out tasks x {DEMO_EVAL['attempts']} attempts, "
          f"{DEMO_EVAL['max_turns']} turns, {DEMO_EVAL['workers']} workers", flush=True)
    results: dict[str, list[dict[str, float]]] = {"LoRA at run time": [], "merged": []}
    for rnd in range(args.rounds):
        for name in results:
            busy0, t0 = machine_busy_s(), time.perf_counter()
            frame = pd.DataFrame(evaluate_checkpoint(
                tasks, cfg["base_model"], platform_sandbox_factory(cfg["sandbox_runtime"]),
                checkpoint=f"bench-{name}", adapter=final / "adapter", adapter_version=final.name,
                merge=name == "merged", attempts=DEMO_EVAL["attempts"], max_turns=DEMO_EVAL["max_turns"],
                max_new_tokens=cfg["max_new_tokens"], workers=DEMO_EVAL["workers"]))
            wall, busy = time.perf_counter() - t0, machine_busy_s() - busy0
            graded = frame[frame["status"] != "infra_error"]
            r = {"wall": wall, "busy": busy, "pass": 100 * (graded["reward"] >= 1).mean(), "infra": len(frame) - len(graded)}
            results[name].append(r)
            print(f"round {rnd} {name}: {wall:.1f} s wall, the machine busy {busy:.1f} s, pass@1 {r['pass']:.1f}% "
                  f"({r['infra']} infrastructure errors)", flush=True)
    (lora, merged) = ({k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for rs in results.values())
    print(f"\nmean of {args.rounds} round(s): LoRA at run time {lora['wall']:.1f} s wall, {lora['busy']:.1f} s busy, "
          f"pass@1 {lora['pass']:.1f}%; merged {merged['wall']:.1f} s wall, {merged['busy']:.1f} s busy, "
          f"pass@1 {merged['pass']:.1f}%")
    print(f"ratio merged / LoRA: wall {merged['wall'] / lora['wall']:.2f}x, machine CPU {merged['busy'] / lora['busy']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
