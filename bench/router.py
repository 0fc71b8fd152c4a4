"""Router benchmark: multi-turn agent sessions replayed against a fleet of SIMULATED engines.

    .venv/bin/python bench/router.py                       # the issue's shape: ~100 calls per session
    .venv/bin/python bench/router.py --shape short         # the earlier, lighter shape: ~16 calls per session
    .venv/bin/python bench/router.py --shape long          # modelled on agentic-coding RL: long shared prompt, big KV
    .venv/bin/python bench/router.py --sessions 128 --routers kv_headroom,sglang-router   # a quick look

The replicas are ``serving.sim`` engines: the same HTTP API and KV-cache accounting as a replica
(block prefix cache, LRU eviction, token budget, retraction), a service-time model, and no model
compute. The fleet mixes 8-GPU "reserved" and 1-GPU "on-demand" replicas. Sessions come in GRPO
groups of 8 sharing a prompt; each turn sends the whole context (prompt + every earlier output and
tool observation), so the context grows every turn, then "runs a tool" (think time) before the
next turn. ``--shape agent`` (the default) is the issue's shape, about 100 calls per session;
``--shape short`` is the lighter one measured first (about 16 calls, a quarter of the KV per GPU).
``--shape long`` is modelled on agentic-coding (SWE-style) RL: a 4096-token system + task prompt
shared by each group of 8, about 100 calls of 40 output and ~150 tool-observation tokens, 131072 KV
tokens per GPU (an 8B model on an H200-class GPU, conservatively), on a scaled-down fleet (1x8 +
6x1 replicas, 32 sessions, 100 ms tool time) so that it runs in minutes on a small machine.
Every other option overrides the shape's value.

The most any router could hit is a property of the workload: every call's new tokens (its tool
observation; the group's prompt for the first sibling to start) must be computed somewhere. That
ceiling is printed with the workload and next to each router's hit rate.

The same workload (same seed) runs through each router, each against a freshly started fleet:
ours (``kv_headroom``), ``round_robin``, ``least_loaded`` (both ours too, sticky per session), and
the real ``sglang-router`` from PyPI (``--policy cache_aware``) when it is installed (the ``bench``
extra). Reported per router: prefix-cache hit rate (cached / prompt tokens over all calls),
retractions (summed over replicas), throughput, p50/p99 call latency, and router overhead
(client-side latency minus the replica's own ``e2e_latency``: the extra hop plus routing), then
each figure as a ratio to sglang-router's (or round-robin's when sglang-router is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.capture_store import environment_with, trainer_headers  # noqa: E402
from serving.client import EngineClient, EngineError, HttpPool  # noqa: E402
from serving.fleet import free_port  # noqa: E402


def start_fleet(args) -> tuple[subprocess.Popen, list[tuple[str, int]]]:
    cmd = [sys.executable, "-m", "serving.sim", "--max-total-tokens-per-gpu", str(args.tokens_per_gpu),
           "--decode-step-ms", str(args.decode_step_ms), "--prefill-us-per-token", str(args.prefill_us_per_token)]
    for spec in args.replicas:
        cmd += ["--replicas", spec]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=environment_with())  # this process's credential
    workers = []
    for line in proc.stdout:
        if line.strip() == "ready":
            break
        url, gpus = line.split()
        workers.append((url, int(gpus)))
    return proc, workers


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if EngineClient(url).health():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


def start_router(kind: str, workers, port: int) -> subprocess.Popen | None:
    if kind == "direct":
        return None
    if kind == "sglang-router":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "cache_aware", "--log-level", "error", "--worker-urls", *[u for u, _ in workers]]
    else:
        cmd = [sys.executable, "-m", "serving.router", "--port", str(port), "--policy", kind]
        for url, gpus in workers:
            cmd += ["--worker", f"{url}@{'reserved' if gpus > 1 else 'on_demand'}:{gpus}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment_with())
    wait_http(f"http://127.0.0.1:{port}")
    if kind == "sglang-router":  # it reports healthy before the workers are checked in
        time.sleep(3.0)
    return proc


SIM_BLOCK_TOKENS = 16  # serving.sim's prefix-cache block

SHAPES = {
    # ~100 calls per rollout as in the issue; 16384 KV tokens per GPU so that the longest session
    # (about 12k tokens at 180 calls) still fits a 1-GPU replica.
    "agent": {"turns": 100, "tokens_per_gpu": 16384, "sessions": 256},
    "short": {"turns": 16, "tokens_per_gpu": 4096, "sessions": 1024},
    # Modelled on agentic-coding (SWE-style) RL rollouts: a long system + task prompt shared by the
    # 8 sessions of a GRPO group, ~100 calls per session, each a short action (40 tokens: one tool
    # call) answered by a tool observation (75-225 tokens, mean 150: a file excerpt, a test or grep
    # result), so contexts reach about 4096 + 100 * 190 = 23k tokens. KV: 131072 tokens per GPU,
    # i.e. 16 GiB of bf16 KV for an 8B model with Llama-3-8B's 128 KiB per token: a conservative
    # H200 share (a dedicated 141 GB H200 left with ~100 GB after weights holds several times more;
    # colocated RL gives the rollout engine only part of it). Fleet and session count are scaled
    # down (1x8 + 6x1 replicas, 32 sessions, 100 ms tool time where real tools take seconds) so a full
    # run of all five routers takes about 4 minutes on 2 cores; one GRPO group of 8 sessions of up to
    # 23k tokens (prompt shared) is more than a 1-GPU replica's 128k holds.
    "long": {"turns": 100, "tokens_per_gpu": 131072, "sessions": 32, "live_sessions": 32,
             "prompt_tokens": 4096, "output_tokens": 40, "obs_tokens": 150, "think_ms": 100.0,
             "replicas": ["6x1", "1x8"]},
}

DEFAULTS = {"live_sessions": 128, "prompt_tokens": 512, "output_tokens": 16, "obs_tokens": 48, "think_ms": 500.0,
            "replicas": ["56x1", "8x8"]}


def make_workload(args) -> list[dict]:
    rng = random.Random(args.seed)
    sessions = []
    for g in range(args.sessions // args.group_size):
        prompt = [rng.randrange(10, 30000) for _ in range(args.prompt_tokens)]
        for k in range(args.group_size):
            turns = max(2, int(rng.gauss(args.turns, args.turns / 4)))
            obs = [[rng.randrange(10, 30000) for _ in range(rng.randint(args.obs_tokens // 2, args.obs_tokens * 3 // 2))]
                   for _ in range(turns)]
            sessions.append({"rid": f"g{g:05d}-s{k}", "prompt": prompt, "obs": obs})
    return sessions


def workload_ceiling(sessions, output_tokens: int, block_size: int = 1) -> tuple[int, int]:
    """(prompt tokens over all calls, the most of them any cache could hold): a call can hit its
    session's whole earlier context (every earlier output and observation), and a first call its
    group's prompt once a sibling has started (sessions start in list order). With ``block_size``
    > 1, in whole blocks as a block cache holds them (the last input token is always computed)."""
    prompt_total = cacheable = 0
    started = set()
    for session in sessions:
        group = session["rid"].split("-")[0]
        context = len(session["prompt"])
        before = context if group in started else 0
        started.add(group)
        for obs in session["obs"]:
            prompt_total += context
            cacheable += min(before, context - 1) // block_size * block_size
            before = context + output_tokens
            context += output_tokens + len(obs)
    return prompt_total, cacheable


def run_workload(url: str | None, sessions, args, workers=None) -> dict:
    """Replay the sessions through ``url`` (a router), or, with ``url`` None, straight to the
    replicas (``workers``), each session pinned by a hash of its id: the no-router baseline."""
    pool = HttpPool(timeout_s=600, headers=trainer_headers())  # the bench writes and ends sessions as the trainer
    records: list[tuple[float, float, int, int, int, int]] = []  # latency, replica_s, prompt, cached, completion, ceiling
    started_groups: set[str] = set()
    lock = threading.Lock()
    queue = list(reversed(sessions))
    errors = []

    def worker() -> None:
        local = []
        while True:
            with lock:
                if not queue:
                    break
                session = queue.pop()
            context = list(session["prompt"])
            group = session["rid"].split("-")[0]
            with lock:
                # The most a cache could hold for this call: the group's shared prompt once a
                # sibling has started, then everything this session sent and got before.
                ceiling = len(context) if group in started_groups else 0
                started_groups.add(group)
            for obs in session["obs"]:
                body = {"input_ids": context, "rid": session["rid"],
                        "sampling_params": {"max_new_tokens": args.output_tokens, "ignore_eos": True}}
                t0 = time.perf_counter()
                target = url or workers[hash(session["rid"]) % len(workers)][0]
                try:
                    out = pool.json("POST", f"{target}/generate", body)
                except (EngineError, OSError) as exc:
                    errors.append(repr(exc))
                    break
                latency = time.perf_counter() - t0
                meta = out["meta_info"]
                local.append((latency, float(meta.get("e2e_latency", 0.0)), int(meta["prompt_tokens"]),
                              int(meta.get("cached_tokens") or 0), int(meta["completion_tokens"]), ceiling))
                ceiling = len(context) + len(out["output_ids"])
                context += out["output_ids"] + obs
                time.sleep(args.think_ms / 1e3)
            if url is not None and args.end_sessions:
                try:
                    pool.request("POST", f"{url}/end_session", json.dumps({"rid": session["rid"]}).encode())
                except OSError:
                    pass
        with lock:
            records.extend(local)

    threads = [threading.Thread(target=worker) for _ in range(args.live_sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in records)
    over = sorted(max(0.0, r[0] - r[1]) for r in records)
    q = lambda v, p: v[min(len(v) - 1, int(len(v) * p))] * 1e3 if v else float("nan")  # noqa: E731
    return {
        "calls": len(records), "errors": len(errors), "first_error": errors[0] if errors else "",
        "cache_hit_rate": sum(r[3] for r in records) / max(1, sum(r[2] for r in records)),
        "hit_of_ceiling": sum(r[3] for r in records) / max(1, sum(r[5] for r in records)),
        "throughput_tok_s": sum(r[4] for r in records) / wall, "calls_per_s": len(records) / wall,
        "p50_ms": q(lat, 0.5), "p99_ms": q(lat, 0.99), "overhead_p50_ms": q(over, 0.5), "overhead_p99_ms": q(over, 0.99),
        "wall_s": wall,
    }


def _parse_plain(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def retractions(workers) -> float:
    return sum(EngineClient(url).metrics().get("num_retracted_reqs", 0.0) for url, _ in workers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", action="append", default=None, help="COUNTxGPUS (default: 56x1 and 8x8 = 64 replicas; long: 6x1 and 1x8)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="agent",
                   help="agent: ~100 calls per session (the issue's); short: ~16 (the shape measured first); "
                        "long: modelled on agentic-coding RL (4096-token shared prompt, 128k KV tokens/GPU)")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="KV budget per GPU in tokens (agent 16384, short 4096, long 131072)")
    p.add_argument("--decode-step-ms", type=float, default=20.0)
    p.add_argument("--prefill-us-per-token", type=float, default=20.0, help="prefill time per uncached token on one GPU")
    p.add_argument("--sessions", type=int, default=None, help="sessions in all (agent 256, short 1024, long 32)")
    p.add_argument("--live-sessions", type=int, default=None, help="sessions running at once (closed loop; 128, long 32)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=None, help="mean calls per session (agent 100, short 16, long 100)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="group prompt tokens (512, long 4096)")
    p.add_argument("--obs-tokens", type=int, default=None, help="mean tool-observation tokens per turn (48, long 150)")
    p.add_argument("--output-tokens", type=int, default=None, help="output tokens per call (16, long 40)")
    p.add_argument("--think-ms", type=float, default=None, help="tool time between a session's calls (500, long 100)")
    p.add_argument("--routers", default="direct,kv_headroom,round_robin,least_loaded,sglang-router",
                   help="'direct' is the no-router baseline for the hop columns")
    p.add_argument("--end-sessions", action=argparse.BooleanOptionalAction, default=True,
                   help="tell the router when a session ends (POST /end_session)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    for key, value in {**DEFAULTS, **SHAPES[args.shape]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    routers = [r for r in args.routers.split(",") if r]
    if "sglang-router" in routers:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            print("sglang-router is not installed (pip install 'posttrain[bench]'); skipping it", flush=True)
            routers.remove("sglang-router")
    sessions = make_workload(args)
    n_calls = sum(len(s["obs"]) for s in sessions)
    prompt_total, cacheable = workload_ceiling(sessions, args.output_tokens)
    ceiling = cacheable / prompt_total
    block_ceiling = workload_ceiling(sessions, args.output_tokens, SIM_BLOCK_TOKENS)[1] / prompt_total
    print(f"SIMULATED engines (serving.sim: engine HTTP API, KV-cache accounting, service-time model, no model compute)")
    print(f"fleet {'+'.join(args.replicas)} replicas, {args.tokens_per_gpu} KV tokens/GPU, prefill {args.prefill_us_per_token} us/token, "
          f"decode step {args.decode_step_ms} ms; {len(sessions)} sessions "
          f"(groups of {args.group_size}), {args.live_sessions} live, {n_calls} calls ({args.shape} shape: "
          f"{args.turns} calls/session mean, {args.prompt_tokens}-token prompt, +{args.output_tokens} out "
          f"+{args.obs_tokens} observation tokens per turn)", flush=True)
    if args.shape == "long":
        print("long shape: modelled on agentic-coding RL (SWE-style tool loop), 8B model, KV budget a conservative "
              "H200 share; fleet and sessions scaled down to fit a small machine", flush=True)
    print(f"workload ceiling: at most {ceiling:.4f} of prompt tokens can be cache hits "
          f"({prompt_total - cacheable} of {prompt_total} must be computed); {block_ceiling:.4f} in the "
          f"simulated engines' whole {SIM_BLOCK_TOKENS}-token blocks", flush=True)
    results = {}
    for kind in routers:
        fleet, workers = start_fleet(args)
        port = free_port()
        router = None
        try:
            router = start_router(kind, workers, port)
            url = None if kind == "direct" else f"http://127.0.0.1:{port}"
            res = run_workload(url, sessions, args, workers)
            res["retractions"] = retractions(workers)
            res["ceiling"] = ceiling
            res["in_router_p50_ms"] = float("nan")
            moved = ""
            if kind in ("kv_headroom", "round_robin", "least_loaded"):
                # our router's own timing, upstream time excluded
                _, text, _ = HttpPool().request("GET", f"{url}/metrics")
                metrics = {k.split(":")[-1]: v for k, v in _parse_plain(text.decode()).items()}
                res["in_router_p50_ms"] = metrics["router_overhead_p50_ms"]
                res["rehomed_sessions"] = metrics.get("router_rehomed_sessions_total", 0.0)
                moved = f", sessions moved off an overfull replica {res['rehomed_sessions']:.0f}"
            results[kind] = res
            print(f"  {kind}: {res['calls']} calls in {res['wall_s']:.1f}s, errors {res['errors']}{moved} "
                  f"{res['first_error'][:120]}", flush=True)
        finally:
            for proc in (router, fleet):
                if proc is not None:
                    proc.terminate()
                    proc.wait()
    base = "sglang-router" if "sglang-router" in results else "round_robin"
    cols = [("cache_hit_rate", "cache hit", "{:.4f}"), ("ceiling", "ceiling", "{:.4f}"), ("hit_of_ceiling", "hit / ceiling", "{:.4f}"), ("retractions", "retractions", "{:.0f}"),
            ("throughput_tok_s", "tok/s", "{:.0f}"), ("p50_ms", "p50 ms", "{:.1f}"), ("p99_ms", "p99 ms", "{:.1f}"),
            ("overhead_p50_ms", "hop p50 ms", "{:.2f}"), ("overhead_p99_ms", "hop p99 ms", "{:.2f}"),
            ("in_router_p50_ms", "in-router p50 ms", "{:.3f}")]
    print()
    print("| router | " + " | ".join(c[1] for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for kind, res in results.items():
        print(f"| {kind} | " + " | ".join(c[2].format(res[c[0]]) for c in cols) + " |")
    if base not in results:
        return 0
    print()
    print(f"ratios to {base} (same workload, same run):")
    print("| router | " + " | ".join(c[1] for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for kind, res in results.items():
        if kind == "direct":
            continue
        cells = []
        for key, _, _ in cols:
            b = results[base][key]
            v = res[key]
            if v != v or b != b:  # nan: not measured for this router
                cells.append("n/a")
            else:
                cells.append(f"{v / b:.2f}x" if b else ("=" if v == b else "inf"))
        print(f"| {kind} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
