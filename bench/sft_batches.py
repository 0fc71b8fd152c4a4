"""The base model's SFT with random batches against length-bucketed ones, side by side in one run.

Builds the embedded base model twice from the same suite's demonstrations, in one process, one after
the other: ``length_pool`` 1 (random batches, the default) and ``--pool`` (batches cut from that many
batches' worth of examples sorted by length). Prints each build's seconds (``build.json``'s
``build_s``), its last SFT loss and its loss on the demonstrations after reloading, and the ratio of
the build times. Held-out accuracy is not measured here: the demo evaluates it (docs/benchmarks.md,
"Base model: length-bucketed SFT batches").

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
    parser.add_argument("--out", required=True, help="a scratch folder; the two models are built under it")
    parser.add_argument("--pool", type=int, default=8, help="length_pool of the bucketed build (default %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    tasks = demonstration_tasks(read_suite(args.tasks))
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    builds = {}
    for pool in (1, args.pool):
        info = json.loads((build_base_model(out / f"pool{pool}", tasks, BaseModelSpec(length_pool=pool)) / "build.json").read_text())
        builds[pool] = info
        print(f"length_pool {pool}: build {info['build_s']:.1f} s, last SFT loss {info['sft_curve'][-1]['loss']:.4f}, "
              f"demonstrations' loss after reload {info['reload_demo_loss']:.4f}", flush=True)
    print(f"build time: {builds[args.pool]['build_s']:.1f} s bucketed against {builds[1]['build_s']:.1f} s random, "
          f"ratio {builds[args.pool]['build_s'] / builds[1]['build_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
