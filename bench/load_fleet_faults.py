"""Fault benchmark: 40% of the engine replicas SIGKILLed in the middle of a step of a simulated run.

    .venv/bin/python bench/load_fleet_faults.py                 # 5 replicas, 6 steps, ~1 minute on 2 cores
    .venv/bin/python bench/load_fleet_faults.py --replicas 10 --sessions 200
    .venv/bin/python bench/load_fleet_faults.py --tiny-model --sessions 24 --max-new-tokens 8 --steps 4

The replicas are ``serving.sim`` engines, each its own process (the engine HTTP API, KV accounting,
a service-time model, no model compute), or with ``--tiny-model`` real local engines (``python -m
serving.local_engine`` on a tiny random Qwen2, real LoRA adapters loaded by peft), behind the real router (``serving.router``, ``kv_headroom``)
with a shared adapters volume. A "step" is what the producer does between two weight publications:
``--sessions`` multi-turn sessions (``lora_path: "latest"``, each turn sends the whole context)
run at once, then the next adapter version is published (volume copy + ``/publish_adapter``).

In step ``--fault-step``, once 40% of the step's calls are answered, 40% of the replicas are killed
with SIGKILL (calls in flight see a reset) and as many fresh replica processes are started and
added to the router, which makes each load the newest adapter from the volume before it takes
traffic; the run does not wait for them (later steps run on the survivors until they join). Printed: each step's wall time, the fault step against the mean of the steps before and
after (as a ratio), calls retried by the router, sessions moved, and the checks: every session
answered every turn (none lost, none answered twice), every session kept one adapter version, and
every replacement joined with the newest version loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.capture_store import environment_with, trainer_headers  # noqa: E402
from serving.client import EngineClient  # noqa: E402
from serving.router.core import Router  # noqa: E402
from serving.router.server import serve_router  # noqa: E402
from serving.tiny import build_tiny_lora_adapter, build_tiny_model  # noqa: E402


def start_replica(decode_step_ms: float, model_dir: Path | None = None) -> tuple[subprocess.Popen, str]:
    """One replica in its own process: simulated, or the local engine on ``model_dir``; returns it and its URL."""
    if model_dir is None:
        cmd = [sys.executable, "-m", "serving.sim", "--replicas", "1x1", "--decode-step-ms", str(decode_step_ms)]
    else:
        cmd = [sys.executable, "-m", "serving.local_engine", "--model", str(model_dir), "--port", "0", "--torch-threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=environment_with())  # this process's credential: it reads their sessions
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if model_dir is None:
        url = line.split()[0]
        assert proc.stdout.readline().strip() == "ready"
    else:
        assert " on http" in line, line
        url = line.rsplit(" on ", 1)[1].strip()
    return proc, url


def publish(volume: Path, router: Router, version: str, model_dir: Path | None = None) -> None:
    """A new version on the volume, then announced to the router (which loads it on every replica).
    With a real model it is a real LoRA adapter; the simulated engine reads no file."""
    tmp = volume / f".tmp-{version}"
    if model_dir is None:
        tmp.mkdir(parents=True)
        (tmp / "adapter_config.json").write_text(json.dumps({"r": 4}))
        (tmp / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    else:
        build_tiny_lora_adapter(model_dir, tmp, seed=int(version.rsplit("_", 1)[1]) + 1)
    tmp.rename(volume / version)
    router.publish_adapter(version, str(volume / version))


def run(*, replicas: int = 5, steps: int = 6, sessions: int = 96, turns: int = 4, fault_step: int = 3,
        kill_fraction: float = 0.4, max_new_tokens: int = 48, decode_step_ms: float = 10.0,
        workdir: Path | None = None, model_dir: Path | None = None) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="fleet-faults-"))
    volume = workdir / "adapters"
    volume.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    router = Router("kv_headroom", adapters_volume=str(volume), poll_interval_s=0.2)
    server = serve_router(router, port=0)
    client = EngineClient(server.url, timeout_s=120)
    result: dict = {"step_s": [], "lost": 0, "duplicated": 0, "mixed_versions": 0, "replacements": []}
    faulter: threading.Thread | None = None
    try:
        for _ in range(replicas):
            proc, url = start_replica(decode_step_ms, model_dir)
            procs[url] = proc
            router.add_replica(url)
        publish(volume, router, "step_000000", model_dir)
        for step in range(1, steps + 1):
            answered = [0]
            lock = threading.Lock()
            fault_done = threading.Event()
            total_calls = sessions * turns

            def session(i: int) -> list[dict]:
                rid = f"s{step:03d}-{i:04d}"
                context = [1 + (i // 8) % 50] * (64 if model_dir is None else 8)  # GRPO groups of 8 share a prompt
                metas = []
                try:
                    for _turn in range(turns):
                        out = client.generate(context, {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                                              lora_path="latest", rid=rid)
                        metas.append(out["meta_info"])
                        context = context + out["output_ids"] + [7] * (16 if model_dir is None else 2)  # tool output
                        with lock:
                            answered[0] += 1
                    client.pool.json("POST", f"{server.url}/end_session", {"rid": rid}, trainer_headers())
                except Exception as exc:  # a lost call: counted, and the first one kept for the report
                    result.setdefault("errors", []).append(repr(exc))
                return metas

            def fault() -> None:
                while answered[0] < 0.4 * total_calls and not result.get("errors"):
                    time.sleep(0.005)
                victims = list(procs)[: max(1, round(kill_fraction * replicas))]
                for url in victims:
                    procs.pop(url).send_signal(signal.SIGKILL)
                killed_at = time.perf_counter()
                for _ in victims:
                    proc, url = start_replica(decode_step_ms, model_dir)
                    procs[url] = proc
                    newest = router.newest_ready_version()
                    replica = router.add_replica(url)  # loads the newest version before any traffic
                    result["replacements"].append({"url": url, "newest": newest, "adapters": sorted(replica.adapters),
                                                   "joined_after_s": time.perf_counter() - killed_at})
                result["killed"] = victims
                fault_done.set()

            started = time.perf_counter()
            if step == fault_step:  # replacements join whenever they are up; the run does not wait for them
                faulter = threading.Thread(target=fault)
                faulter.start()
            with ThreadPoolExecutor(max_workers=sessions) as pool:
                answers = list(pool.map(session, range(sessions)))
            result["step_s"].append(time.perf_counter() - started)
            for metas in answers:
                result["lost"] += turns - len(metas) if len(metas) < turns else 0
                result["duplicated"] += len(metas) - turns if len(metas) > turns else 0
                if len({m["weight_version"] for m in metas}) != 1:
                    result["mixed_versions"] += 1
            publish(volume, router, f"step_{step:06d}", model_dir)
        if faulter is not None:
            faulter.join()
        m = router.metrics()
        result["retried_calls"] = m["router_retried_calls_total"]
        result["moved_sessions"] = m["router_moved_sessions_total"]
        result["calls"] = steps * sessions * turns
    finally:
        server.shutdown()
        for proc in procs.values():
            proc.kill()
            proc.wait()
    times = result["step_s"]
    i = fault_step - 1
    others = times[:i] + times[i + 1:]
    result["fault_step_s"] = times[i]
    result["other_steps_mean_s"] = statistics.mean(others) if others else float("nan")
    result["fault_ratio"] = times[i] / result["other_steps_mean_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--decode-step-ms", type=float, default=10.0)
    parser.add_argument("--tiny-model", action="store_true",
                        help="real local engines (transformers on CPU) on serving.tiny's model, real LoRA adapters")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = None
    if args.tiny_model:
        model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="fleet-faults-model-")) / "model")
    r = run(replicas=args.replicas, steps=args.steps, sessions=args.sessions, turns=args.turns, fault_step=args.fault_step,
            decode_step_ms=args.decode_step_ms, model_dir=model_dir, max_new_tokens=args.max_new_tokens)
    print(f"{'local engines (tiny model)' if model_dir else 'simulated'} replicas {args.replicas}, {args.sessions} sessions x {args.turns} turns per step, {args.steps} steps; "
          f"step {args.fault_step}: {len(r['killed'])} replicas SIGKILLed mid-step and replaced")
    for n, t in enumerate(r["step_s"], 1):
        print(f"  step {n}: {t:6.2f} s" + ("   <- fault" if n == args.fault_step else ""))
    print(f"fault step {r['fault_step_s']:.2f} s vs other steps mean {r['other_steps_mean_s']:.2f} s: "
          f"ratio {r['fault_ratio']:.2f} (production incident: 37 min vs 35 min = 1.06)")
    print(f"calls {r['calls']}, retried by the router {r['retried_calls']:.0f}, sessions moved {r['moved_sessions']:.0f}")
    if r.get("errors"):
        print(f"first lost call: {r['errors'][0]}")
    print(f"lost {r['lost']}, duplicated {r['duplicated']}, sessions with mixed adapter versions {r['mixed_versions']}")
    for rep in r["replacements"]:
        print(f"  replacement {rep['url']}: joined {rep['joined_after_s']:.1f} s after the kill with {rep['adapters']} "
              f"(newest published before it joined: {rep['newest']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
