"""The sandbox pool's HTTP API as a hostile or broken client meets it: real HTTP on loopback.

Every route but ``GET /health`` needs the run's credential; a request without it is refused before
the pool does anything (no pod is asked for). Each connection is bounded: a client that sends its
request slowly, a byte at a time, or stops in the middle of its body is cut off at the request
timeout, a body above the limit is refused unread, and connections beyond the cap are answered
503 at once. The pool behind the server reaches no API server: its ``create_namespaced_pod`` is
recorded and refused (403), so an authorized request is seen to reach the pool and go no further.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from sandboxes import pool
from serving import capture_store

IMAGE = "registry.local/tasks/calc:1"
CREDENTIAL = "c" * 64
GUARD_S = 30.0  # how long a test waits for the server to do what it must, before it fails


@pytest.fixture
def served():
    """``(url, created, make)``: a pool's API on loopback with the credential ``CREDENTIAL``;
    ``make(**kw)`` serves another one with other limits."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    servers = []
    created: list[dict] = []

    def make(**kw):
        cfg = client.Configuration()
        cfg.host = "http://127.0.0.1:9"  # never called: the pod create below is recorded and refused
        p = pool.SandboxPool(pool.PoolConfig(run="demo"), client.ApiClient(cfg))

        def create(namespace, manifest):
            created.append(manifest)
            raise ApiException(status=403, reason="Forbidden")

        p.core.create_namespaced_pod = create
        p.core.delete_namespaced_pod = lambda *a, **k: None
        server = pool.make_server(p, "127.0.0.1", 0, credential=CREDENTIAL, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield make(), created, make
    for server in servers:
        server.shutdown()
        server.server_close()


def call(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=GUARD_S) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.startswith(b"{") else {"text": raw.decode()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=GUARD_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the guard fails the test)."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            pytest.fail(f"the server kept the connection open for {GUARD_S:g} s; it sent {out[:200]!r}")
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def test_the_credential_names_are_the_trainer_credentials():
    """The pool reads serving.capture_store's variables itself (a layer below it): the same names."""
    assert pool.CREDENTIAL_ENV == capture_store.CREDENTIAL_ENV
    assert pool.CREDENTIAL_FILE_ENV == capture_store.CREDENTIAL_FILE_ENV
    assert pool.MIN_CREDENTIAL_CHARS == capture_store.MIN_CREDENTIAL_CHARS
    assert pool.run_credential() == capture_store.trainer_credential()


def test_every_route_but_health_needs_the_run_credential(served):
    url, created, _ = served
    episode = {"image": IMAGE, "task_id": "calc", "episode": "e1"}
    for headers in ({}, {"Authorization": "Bearer " + "x" * 64}, {"Authorization": CREDENTIAL},
                    {"Authorization": "Basic " + CREDENTIAL}, {"Authorization": "Bearer " + CREDENTIAL[:-1]}):
        for method, path, body in (("POST", "/v1/sandboxes", episode), ("POST", "/v1/warm", {"image": IMAGE, "count": 2}),
                                   ("POST", "/v1/sandboxes/sbx-1/exec", {"shell": "id"}),
                                   ("DELETE", "/v1/sandboxes/sbx-1", None), ("GET", "/metrics", None)):
            status, answer = call(url, method, path, body, headers)
            assert status == 403, (headers, method, path, status, answer)
            assert "needs the run's credential" in answer["error"]
    assert created == []  # nothing reached the pool
    assert call(url, "GET", "/health")[0] == 200  # the kubelet's probe sends no credential

    # with it, the same request reaches the pool (whose pod create the fake refuses)
    status, answer = call(url, "POST", "/v1/sandboxes", episode, {"Authorization": f"Bearer {CREDENTIAL}"})
    assert status == 400 and "HTTP 403" in answer["error"] and len(created) == 1
    assert call(url, "GET", "/metrics", headers={"Authorization": f"Bearer {CREDENTIAL}"})[0] == 200
    # the client sends it
    client = pool.PoolClient(url, credential=CREDENTIAL)
    assert "posttrain_sandbox_starts_total" in client.metrics()
    assert pool.PoolClient(url, credential="y" * 64).call("POST", "/v1/warm", {"image": IMAGE, "count": 1}, 30)[0] == 403


def test_a_slow_request_is_cut_off_at_the_request_timeout(served):
    _, _, make = served
    url = make(request_timeout_s=1.0)

    # headers that stop half-way: closed (the server answers nothing it could not parse)
    stalled = connect(url)
    stalled.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: pool\r\nAuthor")
    # another client is served meanwhile
    assert call(url, "GET", "/health")[0] == 200
    assert read_until_closed(stalled) == b""
    stalled.close()

    # a byte at a time, never a whole request: cut off while it is still sending (a plain socket
    # timeout would restart with every byte and keep it open for ever)
    trickle = connect(url)
    request = b"GET /metrics HTTP/1.1\r\nHost: pool\r\n" + b"X-Padding: " + b"a" * 4096
    cut = threading.Event()

    def send_slowly():
        for byte in request:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                cut.set()
                return
            time.sleep(0.05)

    sender = threading.Thread(target=send_slowly, daemon=True)
    sender.start()
    assert read_until_closed(trickle) == b""
    sender.join()
    trickle.close()
    assert cut.is_set(), "the whole slow request went through before the server gave up on it"

    # a body that stops: 408 and closed
    body = connect(url)
    body.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: pool\r\nAuthorization: Bearer " + CREDENTIAL.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"image\": ")
    answer = read_until_closed(body)
    body.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"did not arrive within 1 s" in answer


def test_a_body_above_the_limit_is_refused_unread_and_connections_are_capped(served):
    _, created, make = served
    url = make(max_body_bytes=1024, max_connections=2)
    big = connect(url)
    big.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: pool\r\nAuthorization: Bearer " + CREDENTIAL.encode()
                + b"\r\nContent-Length: 1048576\r\n\r\n")
    answer = read_until_closed(big)  # answered without waiting for the megabyte
    big.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and b"at most 1024" in answer, answer[:200]
    # a body too large and no credential: refused for the credential, the body never read either
    status, answer = call(url, "POST", "/v1/sandboxes", {"image": "x" * 4096})
    assert status == 403 and created == []

    held = [connect(url), connect(url)]
    for sock in held:  # each holds its slot: a request that has begun
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: pool\r\n")
    extra = connect(url)
    answer = read_until_closed(extra)
    extra.close()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"2 connections open" in answer, answer[:200]
    for sock in held:
        sock.close()
    deadline = time.monotonic() + GUARD_S
    while True:  # the slots come back once the server sees the held connections close
        try:
            if call(url, "GET", "/health")[0] == 200:
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, "no slot came back after the held connections closed"
        time.sleep(0.05)
