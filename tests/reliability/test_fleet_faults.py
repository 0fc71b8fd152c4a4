"""Engine replicas killed mid-step and the router restarted. Promises (serving/router.py, serving/fleet.py,
DESIGN "Engine replicas"/"Router"): a replica that fails a call is marked dead, its sessions move and the
failed call is retried elsewhere; a replica that joins loads the newest adapter before taking traffic;
a session keeps one adapter version for its whole life. Replicas are ``serving.sim`` engines, each its
own process (a real model would make 40% of a fleet too slow to start on 2 cores)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.client import EngineClient
from serving.router import Router, serve_router
from tests.reliability.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("load_fleet_faults", REPO / "bench" / "load_fleet_faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forty_percent_of_replicas_sigkilled_mid_step_loses_no_call(tmp_path: Path):
    """5 replica processes, 3 steps of 40 four-turn sessions; in step 2, 2 replicas are SIGKILLed once
    40% of the calls are answered and 2 fresh ones join. Every session gets every turn answered once,
    on one adapter version; each replacement joined with the newest version loaded."""
    r = _bench().run(replicas=5, steps=3, sessions=40, turns=4, fault_step=2, workdir=tmp_path)
    assert r.get("errors") is None, r["errors"][:3]
    assert r["lost"] == r["duplicated"] == r["mixed_versions"] == 0
    assert len(r["killed"]) == 2 and len(r["replacements"]) == 2
    for rep in r["replacements"]:
        assert rep["newest"] in rep["adapters"], rep
    assert r["moved_sessions"] > 0  # the killed replicas had live sessions; they moved on


def _sim() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "serving.sim", "--replicas", "2x1"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    urls = [proc.stdout.readline().split()[0] for _ in range(2)]
    assert proc.stdout.readline().strip() == "ready"
    return proc, urls


def test_router_restarted_mid_session_serves_the_same_sessions_again(tmp_path: Path):
    """The router is stopped between two turns of live sessions and a new one starts on the same port
    with the same replicas: the client sees the gap as a connection error (not an HTTP answer, so the
    harness records an infrastructure failure, never a model failure), then every session continues
    on the new router with its full context, and captured calls are still on the replicas."""
    proc, urls = _sim()
    try:
        router = Router("kv_headroom")
        for url in urls:
            router.add_replica(url)
        server = serve_router(router, port=0)
        port = server.port
        client = EngineClient(server.url, timeout_s=30)
        contexts = {f"s{i}": [3 + i] * 32 for i in range(12)}
        for rid, ctx in contexts.items():
            contexts[rid] = ctx + client.generate(ctx, {"max_new_tokens": 8}, rid=rid)["output_ids"]
        server.shutdown()
        with pytest.raises(OSError):
            client.generate(contexts["s0"], {"max_new_tokens": 8}, rid="s0")
        router2 = Router("kv_headroom")
        for url in urls:
            router2.add_replica(url)
        server2 = serve_router(router2, port=port)
        try:
            for rid, ctx in contexts.items():
                out = client.generate(ctx, {"max_new_tokens": 8}, rid=rid)
                assert len(out["output_ids"]) == 8 and out["meta_info"]["prompt_tokens"] == len(ctx)
            assert router2.metrics()["router_live_sessions"] == len(contexts)
        finally:
            server2.shutdown()
    finally:
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
