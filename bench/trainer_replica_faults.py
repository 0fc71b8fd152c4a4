"""Fault benchmark: 40% of the trainer's engine replicas SIGKILLed in the middle of a step of ``python -m training``.

    .venv/bin/python bench/trainer_replica_faults.py              # a run without the fault, then one with it; ~2.5 min on 2 cores
    .venv/bin/python bench/trainer_replica_faults.py --no-control --steps 10

The trainer runs as it does in production here: its own process, ``replicas = 5`` engine processes
(``python -m serving.local_engine`` on a tiny random Qwen2) behind the router in the trainer
(``training.episodes.ReplicaFleet``), real LoRA versions published after every step. The episodes are
multi-turn sessions (``tests/reliability/fleet_env.py``) instead of sandboxed agents, so that the
replicas are the only thing under test. Producers are synchronous (``producer_workers = 0``): a step
is its groups' generation, the GRPO update, the checkpoint and the publication, and its time is the
interval between two step lines of the trainer.

In step ``--fault-step``, once its first rollouts are stored and calls are in flight, the 2
replicas with the most calls in flight are SIGKILLed from outside (frozen with SIGSTOP for 50 ms
first, so that a call in flight on them is still in flight when the kill lands). The trainer's watcher replaces
them; the replacements load the newest adapter from the run's volume before they take traffic; the run
does not wait for them. Printed: each step's time, the fault step against the steps before and after
it (and against the same steps of a run without the fault, measured just before), when the
replacements joined and with which version, what the router retried and moved, and the store's counts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving.client import HttpPool  # noqa: E402
from serving.tiny import build_tiny_model  # noqa: E402
from training.store import RolloutStore  # noqa: E402

STEP_LINE = re.compile(r"^step\s+(\d+) ")
FLEET_LINE = re.compile(r"^engine replicas behind the router (\S+): (.*)$")
MEMBER = re.compile(r"(http://\S+) \(pid (\d+)\)")
REPLACED = re.compile(r"^replica (\S+) exited \((-?\d+)\); replacement (\S+) \(pid (\d+)\) joined serving \[(.*)\] "
                      r"\(newest published before it joined: (\S+)\)$")


def trainer_config(model_dir: Path, *, replicas: int, steps: int, groups_per_step: int, group_size: int,
                   turns: int) -> dict:
    return {
        "run_name": "replica-faults", "base_model": str(model_dir), "steps": steps, "groups_per_step": groups_per_step,
        "group_size": group_size, "max_turns": turns, "max_new_tokens": 8, "producer_workers": 0,
        "checkpoint_every": 3, "lora_rank": 4, "learning_rate": 0.05, "seed": 3, "replicas": replicas,
        "environment": "tests.reliability.fleet_env:make",
    }


def _rollouts_of_step(store: Path, step: int) -> int:
    conn = sqlite3.connect(store, timeout=10)
    try:
        return conn.execute("SELECT COUNT(*) FROM rollouts WHERE group_id LIKE ?", (f"s{step:06d}-%",)).fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0
    finally:
        conn.close()


def _busiest(http, router_url: str, pids: dict[str, int]) -> list[dict]:
    """The router's view of the fleet's original replicas, most calls in flight first."""
    workers = http.json("GET", f"{router_url}/workers")["workers"]
    return sorted((w for w in workers if w["url"] in pids), key=lambda w: (-w["in_flight"], -w["live_sessions"]))


def run(workdir: Path, model_dir: Path, *, fault: bool = True, replicas: int = 5, kill: int = 2, steps: int = 14,
        fault_step: int = 4, groups_per_step: int = 3, group_size: int = 8, turns: int = 3) -> dict:
    """One trainer run (with the fault in ``fault_step`` when ``fault``); returns what it printed and measured."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "trainer.json"
    config.write_text(json.dumps(trainer_config(model_dir, replicas=replicas, steps=steps, groups_per_step=groups_per_step,
                                                group_size=group_size, turns=turns)))
    run_dir = workdir / "run"
    # The tiny model (head_dim 8) is one only the project's engine serves.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "POSTTRAIN_ENGINE": os.environ.get("POSTTRAIN_ENGINE", "local")}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    proc = subprocess.Popen([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run_dir)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    arrived = threading.Condition()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with arrived:
                lines.append((time.monotonic(), line.rstrip("\n")))
                arrived.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(pattern: re.Pattern, where=lambda m: True, timeout_s: float = 300.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        with arrived:
            while True:
                for _, text in lines:
                    m = pattern.match(text)
                    if m and where(m):
                        return m
                if not reader.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer printed no line {pattern.pattern!r}:\n" + "\n".join(t for _, t in lines))
                arrived.wait(timeout=1.0)

    result: dict = {"victims": [], "killed_at": None, "stored_at_kill": None}
    try:
        fleet = wait_for(FLEET_LINE)
        router_url, pids = fleet.group(1), {u: int(p) for u, p in MEMBER.findall(fleet.group(2))}
        result["replicas"] = pids
        if fault:
            wait_for(STEP_LINE, where=lambda m: int(m.group(1)) == fault_step - 1)
            # Mid-step: the fault step's first rollouts are stored and calls are in flight on the replicas.
            store = run_dir / "store" / "rollouts.sqlite"
            http = HttpPool(timeout_s=10)
            deadline = time.monotonic() + 120
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError("the fault step never got under way")
                busy = _busiest(http, router_url, pids)
                if busy[0]["in_flight"] > 0 and _rollouts_of_step(store, fault_step) >= 1:
                    # A call on the tiny model ends within milliseconds, before a kill seen from here can
                    # land. Freeze the chosen replicas first: a call still in flight once they are frozen
                    # cannot end, so the kill is sure to catch it. Otherwise thaw them and look again.
                    chosen = [w["url"] for w in busy[:kill]]
                    for url in chosen:
                        os.kill(pids[url], signal.SIGSTOP)
                    time.sleep(0.05)  # answers already sent reach the router
                    caught = sum(w["in_flight"] for w in _busiest(http, router_url, pids) if w["url"] in chosen)
                    if caught > 0:
                        break
                    for url in chosen:
                        os.kill(pids[url], signal.SIGCONT)
                time.sleep(0.005)
            result["victims"] = chosen
            for url in chosen:
                os.kill(pids[url], signal.SIGKILL)
            result["caught_calls"] = caught
            result["killed_at"] = time.monotonic()
            result["stored_at_kill"] = _rollouts_of_step(store, fault_step)
        result["returncode"] = proc.wait(timeout=900)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:  # the run failed: stop the trainer and the replicas it can no longer stop
            proc.kill()
            proc.wait()
            reader.join(timeout=10)
            pids = [int(p) for _, t in lines for p in re.findall(r"\(pid (\d+)\)", t)]
            for pid in pids:
                try:
                    if b"serving.local_engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    result["lines"] = [t for _, t in lines]
    step_at = {int(STEP_LINE.match(t).group(1)): at for at, t in lines if STEP_LINE.match(t)}
    start = next((at for at, t in lines if t.startswith("run replica-faults: step 0")), None)
    marks = [start] + [step_at.get(s) for s in range(1, steps + 1)]
    result["step_s"] = {s: marks[s] - marks[s - 1] for s in range(1, steps + 1)
                        if marks[s] is not None and marks[s - 1] is not None}
    result["replaced"] = []
    for at, t in lines:
        m = REPLACED.match(t)
        if m:
            result["replaced"].append({
                "dead": m.group(1), "returncode": int(m.group(2)), "url": m.group(3),
                "serving": [v.strip(" '") for v in m.group(5).split(",") if v.strip()], "newest": m.group(6),
                "joined_after_s": at - result["killed_at"] if result["killed_at"] else None,
                "joined_in_step": min((s for s, t2 in step_at.items() if t2 >= at), default=None),
            })
    result["router"] = next((t for t in result["lines"] if t.startswith("router: ")), "")
    counted = re.match(r"router: calls retried (\d+), sessions moved (\d+)", result["router"])
    result["retried_calls"], result["moved_sessions"] = (int(counted[1]), int(counted[2])) if counted else (None, None)
    store = run_dir / "store" / "rollouts.sqlite"
    conn = sqlite3.connect(store)
    try:
        result["group_sizes"] = conn.execute(
            "SELECT g.group_id, g.group_size, COUNT(r.rollout_id) FROM groups g "
            "LEFT JOIN rollouts r ON r.group_id = g.group_id GROUP BY g.group_id").fetchall()
        result["infos"] = [json.loads(i) for (i,) in conn.execute("SELECT info FROM rollouts")]
    finally:
        conn.close()
    result["counts"] = RolloutStore(store).counts()
    return result


def report(r: dict, fault_step: int, control: dict | None = None) -> str:
    steps = r["step_s"]
    before = [steps[s] for s in steps if 1 < s < fault_step]  # step 1 also warms up the replicas
    after = [steps[s] for s in steps if s > fault_step]
    out = []
    for s, d in steps.items():
        base = f"   control {control['step_s'][s]:6.2f} s" if control and s in control["step_s"] else ""
        out.append(f"  step {s:2d}: {d:6.2f} s{base}" + ("   <- fault" if s == fault_step else "   (warm-up)" if s == 1 else ""))
    fs = steps[fault_step]
    out.append(f"fault step {fs:.2f} s vs steps before {statistics.mean(before):.2f} s (ratio {fs / statistics.mean(before):.2f}), "
               f"steps after {statistics.mean(after):.2f} s (ratio {fs / statistics.mean(after):.2f}); "
               "production incident: 37 min vs 35 min = 1.06")
    if control:
        c = control["step_s"]
        out.append(f"against the run without the fault: step {fault_step} {fs / c[fault_step]:.2f}x, steps after "
                   f"{statistics.mean(after) / statistics.mean([c[s] for s in c if s > fault_step]):.2f}x, "
                   f"whole run after step 1 {sum(v for s, v in steps.items() if s > 1) / sum(v for s, v in c.items() if s > 1):.2f}x")
    for rep in r["replaced"]:
        out.append(f"  replacement {rep['url']} for {rep['dead']} (exit {rep['returncode']}): joined "
                   f"{rep['joined_after_s']:.1f} s after the kill, during step {rep['joined_in_step']}, serving "
                   f"{rep['serving']} (newest published before it joined: {rep['newest']})")
    spanning = [i for i in r["infos"] if len(set(i["replicas"])) > 1]
    served = {u for i in r["infos"] for u in i["replicas"]}
    out.append(r["router"])
    out.append(f"rollouts {r['counts']}; whole groups {sum(1 for _, size, n in r['group_sizes'] if n == size)}"
               f"/{len(r['group_sizes'])}; rollouts answered by two replicas {len(spanning)}; sessions with mixed "
               f"adapter versions {sum(1 for i in r['infos'] if len(set(i['weight_versions'])) != 1)}; replacements "
               f"that served calls {len({x['url'] for x in r['replaced']} & served)}/{len(r['replaced'])}")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=5)
    parser.add_argument("--kill", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--no-control", action="store_true", help="skip the run without the fault")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainer-replica-faults-"))
    model = build_tiny_model(workdir / "model", hidden_size=32, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, max_position_embeddings=256)
    kw = dict(replicas=args.replicas, kill=args.kill, steps=args.steps, fault_step=args.fault_step)
    control = None if args.no_control else run(workdir / "control", model, fault=False, **kw)
    r = run(workdir / "fault", model, fault=True, **kw)
    print(f"python -m training, {args.replicas} engine replicas behind the router, 3 groups x 8 sessions x 3 turns per "
          f"step, {args.steps} steps; step {args.fault_step}: {len(r['victims'])} replicas SIGKILLed once "
          f"{r['stored_at_kill']} of its 24 rollouts were stored, with {r['caught_calls']} calls in flight on them" + ("" if control is None else "; control: the same run without the fault, just before"))
    print(report(r, args.fault_step, control))
    return 0 if r["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
