"""Engine replicas killed mid-step and the router restarted. Promises (serving/router/, serving/fleet.py,
DESIGN "Engine replicas"/"Router"): a replica that fails a call is marked dead, its sessions move and the
failed call is retried elsewhere; a replica that joins loads the newest adapter before taking traffic;
a session keeps one adapter version for its whole life. Replicas are ``serving.sim`` engines, each its
own process (a real model would make 40% of a fleet too slow to start on 2 cores)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from serving.client import EngineClient
from tests.reliability.conftest import REPO, serves_newest


def _bench():
    spec = importlib.util.spec_from_file_location("load_fleet_faults", REPO / "bench" / "load_fleet_faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forty_percent_of_replicas_sigkilled_mid_step_loses_no_call(tmp_path: Path):
    """5 replica processes, 3 steps of 40 four-turn sessions; in step 2, 2 replicas are SIGKILLed once
    40% of the calls are answered and 2 fresh ones join. Every session gets every turn answered once,
    on one adapter version; each replacement joined serving the newest version published before it
    joined (or a later one)."""
    r = _bench().run(replicas=5, steps=3, sessions=40, turns=4, fault_step=2, workdir=tmp_path)
    assert r.get("errors") is None, r["errors"][:3]
    assert r["lost"] == r["duplicated"] == r["mixed_versions"] == 0
    assert len(r["killed"]) == 2 and len(r["replacements"]) == 2
    for rep in r["replacements"]:
        assert serves_newest(rep["adapters"], rep["newest"]), rep
    assert r["moved_sessions"] > 0  # the killed replicas had live sessions; they moved on


@pytest.mark.slow
def test_forty_percent_of_real_engine_replicas_sigkilled_replacements_load_the_newest_adapter(tmp_path: Path):
    """The same with real local engines (``python -m serving.local_engine``, a tiny random Qwen2) and real LoRA
    adapters published on the volume: 2 of 5 SIGKILLed mid-step, no call lost, and each replacement has
    the newest version loaded by peft before it takes traffic (over a minute: seven engine processes)."""
    from serving.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    r = _bench().run(replicas=5, steps=3, sessions=16, turns=3, fault_step=2, max_new_tokens=8,
                     workdir=tmp_path / "run", model_dir=model)
    assert r.get("errors") is None, r["errors"][:3]
    assert r["lost"] == r["duplicated"] == r["mixed_versions"] == 0
    assert len(r["replacements"]) == 2
    for rep in r["replacements"]:
        assert serves_newest(rep["adapters"], rep["newest"]), rep


def _sim() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "serving.sim", "--replicas", "2x1"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    urls = [proc.stdout.readline().split()[0] for _ in range(2)]
    assert proc.stdout.readline().strip() == "ready"
    return proc, urls


def _router(port: int, urls: list[str]) -> tuple[subprocess.Popen, str]:
    workers = [arg for url in urls for arg in ("--worker", url)]
    proc = subprocess.Popen([sys.executable, "-m", "serving.router", "--port", str(port), *workers], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert " on http" in line, line
    return proc, line.split(" on ")[1].split()[0]


def test_router_process_sigkilled_mid_session_and_restarted_serves_the_same_sessions(tmp_path: Path):
    """The router process is SIGKILLed between two turns of live sessions and started again on the same
    port with the same replicas: meanwhile the client sees a connection error (``OSError``, which the
    harness records as an infrastructure failure, never a model failure), then every session continues
    through the new router with its full context."""
    proc, urls = _sim()
    router, url = _router(0, urls)
    try:
        client = EngineClient(url, timeout_s=30)
        contexts = {f"s{i}": [3 + i] * 32 for i in range(12)}
        for rid, ctx in contexts.items():
            contexts[rid] = ctx + client.generate(ctx, {"max_new_tokens": 8}, rid=rid)["output_ids"]
        router.send_signal(signal.SIGKILL)
        router.wait()
        with pytest.raises(OSError):
            client.generate(contexts["s0"], {"max_new_tokens": 8}, rid="s0")
        router, url2 = _router(int(url.rsplit(":", 1)[1]), urls)
        assert url2 == url
        for rid, ctx in contexts.items():
            out = client.generate(ctx, {"max_new_tokens": 8}, rid=rid)
            assert len(out["output_ids"]) == 8 and out["meta_info"]["prompt_tokens"] == len(ctx)
        live = client.pool.request("GET", f"{url}/metrics")[1].decode()
        assert f"posttrain:router_live_sessions {float(len(contexts))!r}" in live
    finally:
        router.send_signal(signal.SIGKILL)
        router.wait()
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_replica_dying_between_headers_and_body_is_a_connection_error():
    """A replica killed after it sent the headers of an answer and before its body (what SIGKILL did in
    ``bench/load_fleet_faults.py``): the client raises ``OSError``, which the router treats as a dead
    replica (retry elsewhere), not an HTTP 500 that would lose the call."""
    import socket
    import threading

    from serving.client import HttpPool

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_then_die() -> None:
        for _ in range(2):  # the first attempt and the client's one retry on a fresh connection
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 514\r\n\r\n{\"te")
            conn.close()

    thread = threading.Thread(target=serve_then_die, daemon=True)
    thread.start()
    with pytest.raises(OSError):
        HttpPool(timeout_s=10).request("POST", f"http://127.0.0.1:{port}/generate", b"{}")
    thread.join(timeout=10)
    listener.close()
