"""The base model's SFT: batches padded to their longest example against the same batches computed in
micro-batches of similar length (the default), and optionally length-bucketed batches, in one run.

Builds the embedded base model from the same suite's demonstrations, in one process, one build after
the other: random batches padded whole (``micro_batch_tokens=0``, the baseline), the same random
batches in micro-batches of similar length (the default ``micro_batch_tokens``: the same steps to
float rounding), and with ``--pool N`` batches cut from N batches' worth of examples sorted by
length. Prints each
build's seconds (``build.json``'s ``build_s``), its last SFT loss and its loss on the demonstrations
after reloading, and each build's time as a ratio of the baseline's. Held-out accuracy is not
measured here: the demo evaluates it (docs/benchmarks.md, "Base model: length-bucketed SFT batches").

    .venv/bin/python bench/sft_batches.py --tasks HOME/datasets/bundled --out /tmp/sft-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from evals.bundled import read_suite
from evals.tasks import demonstration_tasks
from training.base_model import BaseModelSpec, build_base_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="a built bundled suite folder (a demo home's datasets/bundled)")
    parser.add_argument("--out", required=True, help="a scratch folder; the models are built under it")
    parser.add_argument("--pool", type=int, default=0,
                        help="also build with length_pool N (batches bucketed by length); 0: not (default)")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    tasks = demonstration_tasks(read_suite(args.tasks))
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    builds = {"random batches, padded": BaseModelSpec(micro_batch_tokens=0),
              "random batches, micro-batches": BaseModelSpec()}
    if args.pool > 1:
        builds[f"length_pool {args.pool}, micro-batches"] = BaseModelSpec(length_pool=args.pool)
    baseline_s = None
    for i, (name, spec) in enumerate(builds.items()):
        info = json.loads((build_base_model(out / f"build{i}", tasks, spec) / "build.json").read_text())
        baseline_s = baseline_s or info["build_s"]
        print(f"{name}: build {info['build_s']:.1f} s ({info['build_s'] / baseline_s:.2f}x the padded build), "
              f"last SFT loss {info['sft_curve'][-1]['loss']:.4f}, "
              f"demonstrations' loss after reload {info['reload_demo_loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
