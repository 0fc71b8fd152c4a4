"""Load benchmark: thousands of concurrent sessions through the router against simulated engines.

    .venv/bin/python bench/load_router.py                          # 2000 sessions x 3 turns, 16 replicas
    .venv/bin/python bench/load_router.py --sessions 4000 --turns 2

Three processes: a fleet of ``serving.sim`` replicas (``python -m serving.sim``), the router
(``python -m serving.router``, ``kv_headroom``) and this client, which opens every session at once (one
thread each, all released together) and runs ``--turns`` calls per session, each sending the whole
context so far. Then every session's calls are read back from the replicas' capture through the router
(``GET /sessions/{rid}``).

Printed: calls answered, lost (a call that raised or came back without its tokens) and duplicated (a
session whose replicas captured more calls than it made: a call executed twice), client-side call
latency p50/p99/max, the router's own overhead p50/p99 (its ``/metrics``), wall time and calls per
second. The router runs in its own process, so the client's threads do not slow it down.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.capture_store import environment_with, trainer_headers  # noqa: E402
from serving.client import EngineClient, HttpPool  # noqa: E402


def _start(cmd: list[str], until: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=environment_with())  # this process's credential
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd[:3]} exited: {lines}")
        lines.append(line.strip())
        if until in line:
            return proc, lines


def run(*, sessions: int = 2000, turns: int = 3, replicas: int = 16, max_new_tokens: int = 16,
        decode_step_ms: float = 5.0) -> dict:
    fleet, lines = _start([sys.executable, "-m", "serving.sim", "--replicas", f"{replicas}x1",
                           "--decode-step-ms", str(decode_step_ms), "--max-total-tokens-per-gpu", "262144"], "ready")
    urls = [line.split()[0] for line in lines if line.startswith("http")]
    workers = [arg for url in urls for arg in ("--worker", url)]
    router, lines = _start([sys.executable, "-m", "serving.router", "--port", "0", *workers], " on http")
    router_url = lines[-1].split(" on ")[1].split()[0]
    try:
        pool = HttpPool(timeout_s=300, headers=trainer_headers())  # reads sessions as the trainer
        client = EngineClient(router_url, pool=pool)
        latencies: list[float] = []
        errors: list[str] = []
        answered = [0]
        lock = threading.Lock()
        gate = threading.Barrier(sessions)

        def session(i: int) -> None:
            rid = f"load-{i:05d}"
            context = [2 + i % 97] * 48
            gate.wait()
            for turn in range(turns):
                t0 = time.perf_counter()
                try:
                    out = client.generate(context, {"max_new_tokens": max_new_tokens}, rid=rid)
                except Exception as exc:  # a lost call
                    with lock:
                        errors.append(f"{rid} turn {turn}: {exc!r}")
                    return
                dt = time.perf_counter() - t0
                if len(out.get("output_ids", [])) != max_new_tokens:
                    with lock:
                        errors.append(f"{rid} turn {turn}: {len(out.get('output_ids', []))} tokens")
                    return
                with lock:
                    latencies.append(dt)
                    answered[0] += 1
                context = context + out["output_ids"] + [5] * 8

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=sessions) as ex:
            list(ex.map(session, range(sessions)))
        wall_s = time.perf_counter() - started

        def captured(i: int) -> int:
            return len(pool.json("GET", f"{router_url}/sessions/load-{i:05d}")["calls"])

        with ThreadPoolExecutor(max_workers=32) as ex:
            counts = list(ex.map(captured, range(sessions)))
        status, data, _ = pool.request("GET", f"{router_url}/metrics")
        metrics = {line.split()[0].removeprefix("posttrain:"): float(line.split()[1])
                   for line in data.decode().splitlines() if line.startswith("posttrain:")} if status == 200 else {}
    finally:
        for proc in (router, fleet):
            proc.kill()
            proc.wait()
    latencies.sort()

    def q(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3 if latencies else float("nan")

    return {
        "sessions": sessions, "turns": turns, "replicas": replicas, "calls": sessions * turns,
        "answered": answered[0], "lost": sessions * turns - answered[0], "errors": errors,
        "duplicated_sessions": sum(1 for c in counts if c > turns),
        "captured_calls": sum(counts), "wall_s": wall_s, "calls_per_s": answered[0] / wall_s,
        "p50_ms": q(0.50), "p99_ms": q(0.99), "max_ms": latencies[-1] * 1e3 if latencies else float("nan"),
        "mean_ms": statistics.mean(latencies) * 1e3 if latencies else float("nan"),
        "router_overhead_p50_ms": metrics.get("router_overhead_p50_ms", float("nan")),
        "router_overhead_p99_ms": metrics.get("router_overhead_p99_ms", float("nan")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=16)
    args = parser.parse_args()
    r = run(sessions=args.sessions, turns=args.turns, replicas=args.replicas)
    print(f"{r['sessions']} concurrent sessions x {r['turns']} turns through the router to {r['replicas']} simulated replicas")
    print(f"calls {r['calls']}: answered {r['answered']}, lost {r['lost']}, sessions with a duplicated call "
          f"{r['duplicated_sessions']} (captured on the replicas: {r['captured_calls']})")
    print(f"client latency per call: p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, max {r['max_ms']:.0f} ms")
    print(f"router overhead: p50 {r['router_overhead_p50_ms']:.2f} ms, p99 {r['router_overhead_p99_ms']:.2f} ms")
    print(f"wall {r['wall_s']:.1f} s, {r['calls_per_s']:.0f} calls/s")
    for e in r["errors"][:5]:
        print("  error:", e)
    return 0 if r["lost"] == 0 and r["duplicated_sessions"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
