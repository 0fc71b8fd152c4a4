"""A vLLM replica's start on the CPU build: its engine-core process forked (the project's default,
``serving.engines.vllm_server``) against spawned (vLLM's own choice on CPU), side by side.

    .venv/bin/python bench/engine_start.py [--model DIR] [--rounds 3] [--max-loras 0]

Each start is ``serving.fleet.start_engine`` (the replica's capture front and vLLM's server) until
it answers ``/health``, as every evaluation, curriculum and RL run of the embedded default starts
one: wall seconds, and the CPU seconds its processes have used by then (``/proc``; the replica's
whole tree). ``--max-loras 0`` serves the model alone (an evaluation's or the curriculum's
replica); 4 adds vLLM's LoRA layers (the RL run's). Without ``--model`` a random model of the
embedded base model's shape is built (serving/tiny.py). Rounds alternate the two settings so that
load from elsewhere on the machine falls on both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_busy_poll import embedded_shape_model  # noqa: E402
from dagster_project.processes import cpu_seconds, descendants  # noqa: E402
from serving.engines.vllm_server import START_METHOD_ENV  # noqa: E402
from serving.fleet import start_engine, stop_replica  # noqa: E402

METHODS = ("fork", "spawn")  # the project's, then vLLM's


def one_start(model: str, method: str, max_loras: int, log_dir: Path) -> tuple[float, float]:
    """(wall s to /health, CPU s of the replica's processes by then) of one start with ``method``."""
    os.environ[START_METHOD_ENV] = method
    t0 = time.monotonic()
    proc, _ = start_engine(model, log_dir / f"replica-{method}.log", engine="vllm", max_loras=max_loras)
    wall = time.monotonic() - t0
    try:
        cpu = sum(s for _, s in cpu_seconds([proc.pid, *sorted(descendants(proc.pid))]).values())
    finally:
        stop_replica(proc)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a random one of the embedded shape)")
    parser.add_argument("--rounds", type=int, default=3, help="starts of each setting (default 3)")
    parser.add_argument("--max-loras", type=int, default=0, help="0: the model alone; 4: with LoRA layers (default 0)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="posttrain-engine-start-"))
    model = args.model or embedded_shape_model(work / "model")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            wall, cpu = one_start(model, method, args.max_loras, work)
            results[method].append((wall, cpu))
            print(f"round {r + 1} {method}: ready in {wall:.1f} s, CPU {cpu:.1f} s", flush=True)
    print(f"| max_loras {args.max_loras}, median of {args.rounds} | fork (posttrain) | spawn (vLLM) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for i, name in enumerate(("wall s to /health", "CPU s of the replica by then")):
        ours = statistics.median(v[i] for v in results["fork"])
        theirs = statistics.median(v[i] for v in results["spawn"])
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
