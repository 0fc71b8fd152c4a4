"""The CPU a vLLM replica spends per generated token on an agent-like load, setting by setting:
vLLM's own LoRA ops against the grouped products of ``serving.engines.vllm_server``, and vLLM's
worker in a process of its own (vLLM's default on CPU) against a worker inside the engine-core
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one compute thread), and the adapter merged into the
model's weights and served with no LoRA layers (``max_loras=0``, :func:`serving.adapters.merge_adapter`:
how evaluations serve a checkpoint).

    .venv/bin/python bench/vllm_cpu_cost.py [--model DIR] [--clients 16] [--seconds 20] [--rounds 1] [--only TEXT]

The load is what an RL step of the embedded default sends: ``--clients`` agents, each asking for
``--new-tokens`` tokens under a rank-16 LoRA adapter (all linear layers) on a prompt that shares a
prefix with the others and grows by its output and an observation every turn, then "running tests"
(sleeping ``--think-s``) before its next turn; a session restarts after ``--turns`` turns. Each
setting is a fresh replica; the figure is user + system CPU of all of its processes over the
measured window, per generated token, and the tokens served per second. The first setting is the
baseline of the ratios. Without ``--model`` a random model of the embedded base model's shape is
built (serving/tiny.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dagster_project.processes import cpu_seconds, descendants  # noqa: E402
from serving.adapters import merge_adapter  # noqa: E402
from serving.client import EngineClient  # noqa: E402
from serving.engines.vllm_server import LORA_OPS_ENV  # noqa: E402
from serving.fleet import start_engine, stop_replica  # noqa: E402
from serving.tiny import build_tiny_lora_adapter, build_tiny_model  # noqa: E402

MERGED = "merged adapter, no LoRA layers, in-process worker"  # served as one model, max_loras=0
SETTINGS: dict[str, dict[str, str]] = {
    "vLLM's LoRA ops, worker process": {LORA_OPS_ENV: "vllm"},
    "grouped LoRA, worker process": {LORA_OPS_ENV: "grouped"},
    "grouped LoRA, in-process worker": {LORA_OPS_ENV: "grouped", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                        "OMP_NUM_THREADS": "1"},
    MERGED: {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def agent(client: EngineClient, index: int, args: argparse.Namespace, stop: threading.Event,
          counts: list[int], lora_path: str | None) -> None:
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    prefix = [(j * 31) % 500 + 10 for j in range(args.prompt_tokens)]
    session = 0
    while not stop.is_set():
        context = prefix + [(index * 977 + session * 13 + j) % 500 + 10 for j in range(24)]
        for _ in range(args.turns):
            out = client.generate(context, params, lora_path=lora_path, session_id=f"a{index}-{session}")
            counts[index] += len(out["output_ids"])
            context = context + out["output_ids"] + [(index + j) % 500 + 10 for j in range(32)]
            if stop.wait(args.think_s):
                return
        session += 1


def one_setting(model: str, adapter: Path | None, env: dict[str, str], args: argparse.Namespace,
                log: Path) -> dict[str, float]:
    """One setting on a fresh replica: ``adapter`` loaded as ``policy`` and asked for, or None for a
    replica without LoRA layers serving ``model`` (the merged one) alone."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        proc, url = start_engine(model, log, engine="vllm", **({} if adapter else {"max_loras": 0}))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    stop, counts = threading.Event(), [0] * args.clients
    try:
        client = EngineClient(url)
        if adapter is not None:
            client.load_lora_adapter("policy", str(adapter))
        threads = [threading.Thread(target=agent, args=(client, i, args, stop, counts, "policy" if adapter else None),
                                    daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(5)  # warm: the first calls compile and fill the prefix cache
        pids = [proc.pid, *sorted(descendants(proc.pid))]
        before, tokens_before, t0 = cpu_seconds(pids), sum(counts), time.perf_counter()
        time.sleep(args.seconds)
        after, tokens_after, wall = cpu_seconds(pids), sum(counts), time.perf_counter() - t0
        stop.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        stop_replica(proc)
    cpu = sum(after[pid][1] - s for pid, (_, s) in before.items() if pid in after)
    tokens = tokens_after - tokens_before
    return {"generated tok/s": tokens / wall, "replica cores": cpu / wall,
            "CPU ms per generated token": 1000 * cpu / tokens if tokens else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a random one of the embedded shape)")
    parser.add_argument("--clients", type=int, default=16, help="agents in flight (the demo runs 16 episodes at once)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per setting")
    parser.add_argument("--rounds", type=int, default=1, help="times each setting is measured (the best is kept)")
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--new-tokens", type=int, default=34, help="per turn (a demo RL turn averages about 34)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--think-s", type=float, default=0.5, help="the agent's sandbox time between turns")
    parser.add_argument("--only", action="append", default=[],
                        help="measure only the settings whose name holds TEXT (repeatable; the first kept is the baseline)")
    args = parser.parse_args()
    settings = {name: env for name, env in SETTINGS.items() if not args.only or any(t in name for t in args.only)}
    if not settings:
        parser.error(f"--only {args.only}: no setting matches; the settings are {list(SETTINGS)}")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-cpu-"))
    model = args.model or str(build_tiny_model(root / "model", hidden_size=96, num_layers=3, num_heads=3,
                                               num_kv_heads=3, intermediate_size=288, vocab_size=768))
    adapter = build_tiny_lora_adapter(model, root / "policy", rank=16, alpha=32, target_modules=LORA_TARGETS)
    merged = merge_adapter(model, adapter, root / "merged") if MERGED in settings else None
    results: dict[str, dict[str, float]] = {}
    for rnd in range(args.rounds):  # settings alternate, so that load from elsewhere falls on all of them
        for name, env in settings.items():
            served, loaded = (str(merged), None) if name == MERGED else (model, adapter)
            r = one_setting(served, loaded, env, args, root / f"{rnd}-{len(results)}.log")
            print(f"round {rnd} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
            best = results.get(name)
            if best is None or r["CPU ms per generated token"] < best["CPU ms per generated token"]:
                results[name] = r

    names = list(results)
    base = results[names[0]]
    print(f"\n{args.clients} agents, {args.new_tokens} new tokens a turn, {args.think_s} s between turns, "
          f"rank-16 LoRA; best of {args.rounds} round(s) of {args.seconds:.0f} s; ratio = setting / {names[0]!r}\n")
    print("| setting | generated tok/s | replica cores | CPU ms per generated token | ratio (CPU per token) |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        r = results[name]
        print(f"| {name} | {r['generated tok/s']:.1f} | {r['replica cores']:.2f} | "
              f"{r['CPU ms per generated token']:.2f} | {r['CPU ms per generated token'] / base['CPU ms per generated token']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
