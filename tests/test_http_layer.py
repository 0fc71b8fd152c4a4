"""One HTTP layer for every server of the project (``sandboxes.httpserver``): on uvicorn's public
interface, with each route's access declared beside it and checked by the layer, and the sandbox
pool's API on the same layer with the same framing as the engines and the router.

The first test reads the source: no module of the project imports uvicorn's protocol modules or
h11, or reaches into a private attribute of theirs (the HTTP layer used to subclass uvicorn's
``H11Protocol`` and edit h11's receive buffer). The others run real servers on 127.0.0.1."""

from __future__ import annotations

import ast
import json
import socket
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dagster_project", "assets", "viewer", "training", "evals", "serving", "sandboxes", "bench")
PRIVATE_MODULES = ("uvicorn.protocols", "uvicorn.lifespan", "h11")
CREDENTIAL = "k" * 64


def _private_server_uses(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
        if isinstance(node, ast.Attribute) and node.attr in ("_receive_buffer", "_data", "lifespan_class"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: uses .{node.attr}")
    return out


def test_no_module_reaches_into_uvicorns_or_h11s_internals():
    bad = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
           for hit in _private_server_uses(path)]
    assert bad == [], "private parts of the HTTP server used:\n" + "\n".join(bad)


def test_every_route_that_changes_what_is_served_declares_the_trainer_credential():
    """The adapter routes of the engine server and the capture front, and the router's fleet and
    publish routes, each declare the credential with the route: the layer refuses a caller
    without it before the handler runs (so no handler has to remember to check)."""
    from sandboxes.httpserver import Bearer, Endpoint
    from serving.capture import serve_sidecar
    from serving.http import serve
    from serving.router.core import Router
    from serving.router.server import RouterServer
    from serving.sim import SimEngine

    engine = serve(SimEngine(max_total_tokens=4096))
    front = serve_sidecar(engine.url)
    router = RouterServer(Router("kv_headroom", poll_interval_s=0.2))
    try:
        guarded = {
            engine: [("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"), ("PUT", "/lora_shards/"),
                     ("POST", "/commit_lora_adapter"), ("GET", "/sessions")],
            front: [("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"), ("PUT", "/lora_shards/"),
                    ("POST", "/commit_lora_adapter"), ("GET", "/sessions")],
            router: [("POST", "/workers"), ("POST", "/add_worker"), ("POST", "/remove_worker"), ("POST", "/publish_adapter")],
        }
        for server, paths in guarded.items():
            for path in paths:
                target = server.routes[path]
                assert isinstance(target, Endpoint) and isinstance(target.access, Bearer), (server.url, path, target)
        # and the layer acts on it: no credential, 403 naming what it guards, the handler never run
        from serving.client import HttpPool

        status, data, _ = HttpPool(timeout_s=30).request(
            "POST", f"{engine.url}/load_lora_adapter", json.dumps({"lora_name": "v1", "lora_path": "/nope"}).encode())
        assert status == 403 and b"loading an adapter needs the trainer credential" in data
        assert "v1" not in engine.engine.adapters()
    finally:
        router.shutdown()
        front.shutdown()
        engine.shutdown()


@pytest.fixture
def pool_url():
    """The pool's API on loopback, in front of a pool that reaches no API server."""
    from kubernetes import client

    from sandboxes import pool

    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:9"  # never called: warming asks for no pod until the pool fills
    p = pool.SandboxPool(pool.PoolConfig(run="demo"), client.ApiClient(cfg))
    server = pool.make_server(p, "127.0.0.1", 0, credential=CREDENTIAL)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()


def _exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_the_pool_takes_a_chunked_body_and_refuses_ambiguous_framing_as_the_engines_do(pool_url):
    """The pool's API is on the same layer as the engine server and the router: a chunked body is
    decoded (the pool's own server refused it), and a doubled length is a 400 before anything is read."""
    url, server = pool_url
    body = json.dumps({"image": "registry.local/tasks/calc:1", "count": 0}).encode()
    half = len(body) // 2
    chunked = (b"POST /v1/warm HTTP/1.1\r\nHost: pool\r\nAuthorization: Bearer " + CREDENTIAL.encode()
               + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
    answer = _exchange(server.server_address[1], chunked)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"image": "registry.local/tasks/calc:1", "count": 0}

    doubled = (b"POST /v1/warm HTTP/1.1\r\nHost: pool\r\nAuthorization: Bearer " + CREDENTIAL.encode()
               + b"\r\nContent-Length: 40\r\nContent-Length: 40\r\n\r\n" + body[:40])
    answer = _exchange(server.server_address[1], doubled)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"one Content-Length" in answer, answer[:300]


def test_a_credential_is_an_object_that_never_shows_its_value():
    from sandboxes.httpserver.auth import Credential

    credential = Credential(CREDENTIAL, "test")
    assert CREDENTIAL not in repr(credential) and CREDENTIAL not in str(credential)
    assert credential.presented_by({"authorization": f"Bearer {CREDENTIAL}"})
    assert not credential.presented_by({"authorization": f"Bearer {CREDENTIAL[:-1]}"})
    assert credential.environment({})["POSTTRAIN_TRAINER_CREDENTIAL"] == CREDENTIAL
    with pytest.raises(ValueError, match="at least 32"):
        Credential("short", "test")


def test_a_head_pipelined_behind_a_request_is_held_to_the_same_bounds():
    """A request, and in the same send an oversized second head: the first is answered, then the
    second gets 431 and the connection closes (the gate follows the framing, so a head behind
    another is scanned too; httptools alone would hold any size of head)."""
    from serving.http import serve
    from serving.sim import SimEngine

    server = serve(SimEngine(max_total_tokens=4096))
    try:
        payload = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                   + b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        data = _exchange(server.port, payload)
        statuses = [int(answer[:3]) for answer in data.split(b"HTTP/1.1 ")[1:]]
        assert statuses == [200, 431], data[:400]
    finally:
        server.shutdown()
