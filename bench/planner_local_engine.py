"""Admission sweep of the local engine: decode throughput at R = 1 to 128 requests in flight.

    .venv/bin/python bench/planner_local_engine.py [--rounds 2] [--threads 1]

Builds a random Qwen2 with ``serving.tiny`` in the geometry of the embedded default's base model
(``training.base_model.BaseModelSpec``), serves it with the local
engine in this process, and replays one GRPO-shaped workload (16 prompts x 8 samples, 64-token
prompts, 32 new tokens each, EOS ignored so every request is the same length) at each admission,
rounds interleaved so that load from other processes falls on every setting alike. It prints output
tokens/s per setting, its ratio to R = 1 (the baseline, measured in the same run), and the smallest
R within 5% of the best: the admission of the ``local-cpu-tiny-v1`` preset.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers.utils import logging as hf_logging

from serving.local_engine import LocalEngine
from serving.protocol import GenerateRequest, SamplingParams
from serving.tiny import build_tiny_model
from training.base_model import BaseModelSpec

# The embedded default's base model geometry, read from its spec so the preset cannot drift from it.
_SPEC = BaseModelSpec()
GEOMETRY = dict(vocab_size=_SPEC.vocab_size, hidden_size=_SPEC.hidden_size, num_layers=_SPEC.num_layers,
                num_heads=_SPEC.num_heads, num_kv_heads=_SPEC.num_kv_heads,
                intermediate_size=_SPEC.intermediate_size, max_position_embeddings=_SPEC.max_position_embeddings)
PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 16, 8, 64, 32
ADMISSIONS = (1, 4, 16, 32, 64, 128)


def run_once(model_dir: Path, admission: int, threads: int, seed: int) -> tuple[float, int]:
    engine = LocalEngine(model_dir, max_running_requests=admission, max_total_tokens=65536, torch_threads=threads)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, GEOMETRY["vocab_size"]) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    requests = [
        GenerateRequest(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed * 1000 + i * SAMPLES + j))
        for i, prompt in enumerate(prompts)
        for j in range(SAMPLES)
    ]
    try:
        engine.generate(GenerateRequest(prompts[0], SamplingParams(max_new_tokens=2, ignore_eos=True)))  # warm up
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            results = list(pool.map(engine.generate, requests))
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return elapsed, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()

    load_before = os.getloadavg()
    best: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", **GEOMETRY)
        for rnd in range(args.rounds):
            for admission in ADMISSIONS:
                elapsed, tokens = run_once(model_dir, admission, args.threads, seed=rnd)
                rate = tokens / elapsed
                best[admission] = max(best.get(admission, 0.0), rate)
                print(f"round {rnd} R={admission:>3}: {tokens} tokens in {elapsed:6.2f} s = {rate:8.1f} tok/s", flush=True)
    print(f"\nlocal engine, random Qwen2 {GEOMETRY}, torch threads {args.threads}, {os.cpu_count()} CPUs")
    print(f"1-minute load average before / after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
          "(other processes share these CPUs; the best of the rounds is kept)")
    print(f"workload: {PROMPTS} prompts x {SAMPLES} samples, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens")
    base = best[1]
    print("| admission R | output tok/s (best of rounds) | vs R = 1 |")
    print("| --- | --- | --- |")
    for admission in ADMISSIONS:
        print(f"| {admission} | {best[admission]:.1f} | {best[admission] / base:.2f}x |")
    top = max(best.values())
    chosen = min(a for a in ADMISSIONS if best[a] >= 0.95 * top)
    print(f"\nsmallest R within 5% of the best: R = {chosen} at {best[chosen]:.1f} tok/s ({best[chosen] / base:.2f}x R = 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
