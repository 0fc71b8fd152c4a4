"""Handlers on the HTTP layer's event loop (``sandboxes.httpserver``): an ``async def`` handler is
awaited there (its I/O on the loop, no thread hop), a plain one declared ``on_loop`` runs there, and
every other handler still runs on a worker thread; the access a route declares, the error answers
and the body's bounds are the same for both. Real servers on 127.0.0.1, real HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading

import pytest

CREDENTIAL = "k" * 64


def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.fixture
def server():
    from sandboxes.httpserver import Endpoint, HttpError, HttpServer, needs_bearer
    from sandboxes.httpserver.auth import Credential

    release = asyncio.Event()  # the loop's own: set and awaited on the server's loop only
    ran: list[str] = []

    def where(req) -> dict:
        return {"thread": threading.current_thread().name}

    async def async_where(req) -> dict:
        await asyncio.sleep(0)  # a real suspension: the handler is awaited, not called
        return {"thread": threading.current_thread().name, "body": req.json()}

    async def wait(req) -> dict:
        ran.append("waiting")
        await release.wait()
        return {"released": True}

    async def let_go(req) -> dict:
        release.set()
        return {"set": True}

    async def guarded(req) -> dict:
        ran.append("guarded")
        return {"ran": True}

    async def fails(req) -> dict:
        raise HttpError(409, "already there")

    async def breaks(req) -> dict:
        raise KeyError("engine state")

    credential = Credential(CREDENTIAL, "test")
    srv = HttpServer({
        ("GET", "/worker"): where,
        ("GET", "/cheap"): Endpoint(where, on_loop=True),
        ("POST", "/async"): async_where,
        ("GET", "/wait"): wait,
        ("GET", "/let_go"): let_go,
        ("POST", "/guarded"): Endpoint(guarded, needs_bearer(credential, "changing it")),
        ("GET", "/fails"): fails,
        ("GET", "/breaks"): breaks,
    }, port=0).start()
    srv.ran = ran
    yield srv
    srv.shutdown()


def test_an_async_handler_is_awaited_on_the_loop_and_a_plain_one_runs_on_a_worker(server):
    loop_thread = f"http-{server.port}"
    status, data = _request(server.port, "POST", "/async", json.dumps({"n": 3}).encode())
    assert status == 200 and data == {"thread": loop_thread, "body": {"n": 3}}, data
    status, data = _request(server.port, "GET", "/cheap")
    assert status == 200 and data == {"thread": loop_thread}, data
    status, data = _request(server.port, "GET", "/worker")
    assert status == 200 and data["thread"] == f"http-{server.port}-worker", data


def test_an_async_handler_that_waits_holds_up_no_other_call(server):
    """A handler awaiting I/O leaves the loop free: a second connection's call is served meanwhile
    (here it is the one that lets the first finish)."""
    answer: dict = {}
    waiter = threading.Thread(target=lambda: answer.update(zip(("status", "data"), _request(server.port, "GET", "/wait"))))
    waiter.start()
    for _ in range(3000):  # until the first call is in its handler, awaiting
        if "waiting" in server.ran:
            break
        threading.Event().wait(0.01)
    assert server.ran == ["waiting"]
    status, data = _request(server.port, "GET", "/let_go")
    assert status == 200 and data == {"set": True}
    waiter.join(timeout=30)
    assert answer == {"status": 200, "data": {"released": True}}, answer


def test_an_async_handlers_access_and_errors_are_the_layers(server):
    status, data = _request(server.port, "POST", "/guarded", b"{}")
    assert status == 403 and "changing it needs the trainer credential" in data["error"], data
    assert "guarded" not in server.ran  # refused before the handler ran
    status, data = _request(server.port, "POST", "/guarded", b"{}", {"Authorization": f"Bearer {CREDENTIAL}"})
    assert status == 200 and data == {"ran": True} and server.ran == ["guarded"]
    assert _request(server.port, "GET", "/fails") == (409, {"error": "already there"})
    status, data = _request(server.port, "GET", "/breaks")
    assert status == 500 and data == {"error": "KeyError: 'engine state'"}, data


def test_a_body_that_arrives_after_its_head_is_read_and_one_that_stops_is_refused():
    """The application skips the body's timer only when the transport has passed on the whole
    body already; a body still coming is read as it comes, and one that stops gets 408."""
    from sandboxes.httpserver import HttpLimits, HttpServer

    async def echo(req) -> dict:
        return req.json()

    srv = HttpServer({("POST", "/echo"): echo}, port=0, limits=HttpLimits(body_timeout_s=1.0)).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n{\"a\":")
            threading.Event().wait(0.2)  # the head and part of the body are in: the rest comes later
            sock.sendall(b" 1}")
            data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b'{"a": 1}'), data
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n{\"a\":")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 408 ") and b"request body not received within 1 s" in data, data
    finally:
        srv.shutdown()


def test_the_engine_servers_health_answers_while_every_worker_is_busy():
    """The engine server answers ``/health`` on its event loop: with its one worker held by a call
    that is still generating, the health check is answered at once instead of waiting its turn."""
    from sandboxes.httpserver import HttpLimits
    from serving.http import serve
    from serving.sim import ServiceModel, SimEngine

    engine = SimEngine(max_total_tokens=4096, service=ServiceModel(decode_step_s=1.0, decode_chunk_tokens=1))
    server = serve(engine, limits=HttpLimits(max_workers=1))
    done: list[str] = []

    def long_call() -> None:
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}})
        try:
            _request(server.port, "POST", "/generate", body.encode())
            done.append("generate")
        except (OSError, http.client.HTTPException):  # cut by the shutdown below
            done.append("generate cut")

    caller = threading.Thread(target=long_call)
    caller.start()
    try:
        for _ in range(3000):  # until the engine is generating it (the server's one worker waits on it)
            if engine.scheduler.running:
                break
            threading.Event().wait(0.01)
        assert engine.scheduler.running, "the long call never reached the engine"
        assert _request(server.port, "GET", "/health") == (200, {"status": "ok"})
        assert done == []  # answered while the generate call still held the worker
    finally:
        server.shutdown()
        caller.join(timeout=30)
