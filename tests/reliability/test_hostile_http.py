"""Hostile HTTP clients against every server in serving/ (the engine, the router, the capture
sidecar), real servers on 127.0.0.1 driven by raw sockets: idle and half-sent connections hold no
thread and are closed after the header timeout, a body that stops coming or a kept-alive connection
left idle is closed, connections beyond the bound get 503, and the framing cannot be confused
(chunked bodies are decoded, a body without Content-Length gets 411, a repeated, malformed or
doubly framed length gets 400, oversized headers 431), while a well-behaved client keeps getting its
answers. Promise: serving/http.py's module docstring ("Connections"). No timing is asserted: each
test waits (with a generous bound) for what must happen and asserts on what happened."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import pytest

from serving.client import HttpPool
from serving.http import HttpLimits

KINDS = ("engine", "router", "sidecar")
GENERATE = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}).encode()
WAIT_S = 120.0  # the most a test waits for a server to act; a server that never acts fails the test


def _make(kind: str, limits: HttpLimits):
    """A running server of ``kind`` with ``limits`` (and the simulated engine behind it); returns
    the server and a function that stops everything."""
    from serving.capture import serve_sidecar
    from serving.http import serve
    from serving.router.core import Router
    from serving.router.server import serve_router
    from serving.sim import SimEngine

    if kind == "engine":
        server = serve(SimEngine(max_total_tokens=8192), limits=limits)
        return server, server.shutdown
    upstream = serve(SimEngine(max_total_tokens=8192))
    if kind == "sidecar":
        server = serve_sidecar(upstream.url, limits=limits)
    else:
        router = Router("kv_headroom", poll_interval_s=0.2)
        router.add_replica(upstream.url)
        server = serve_router(router, limits=limits)

    def stop() -> None:
        server.shutdown()
        upstream.shutdown()

    return server, stop


@pytest.fixture(params=KINDS)
def make_server(request):
    """``make_server(**limits)``: the parametrized server kind, started with those ``HttpLimits``."""
    stops = []

    def make(**limits):
        server, stop = _make(request.param, HttpLimits(**limits))
        stops.append(stop)
        return server

    yield make
    for stop in stops:
        stop()


def _connect(server, timeout_s: float = WAIT_S) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=timeout_s)


def _read_to_close(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes; ``closed`` is False when it never did."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed with our unread bytes in its buffer: closed all the same
        pass
    except socket.timeout:
        return data, False
    return data, True


def _answers(data: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each HTTP answer in ``data``, in order."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a partial answer: {data[:200]!r}"
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
        out.append((status, rest[:length]))
        data = rest[length:]
    return out


def _exchange(server, payload: bytes) -> tuple[list[tuple[int, bytes]], bool]:
    with _connect(server) as sock:
        sock.sendall(payload)
        data, closed = _read_to_close(sock)
    return _answers(data), closed


def _served(server) -> None:
    """A well-behaved client's call is answered in full."""
    out = HttpPool(timeout_s=WAIT_S).json("POST", f"{server.url}/generate", json.loads(GENERATE))
    assert len(out["output_ids"]) == 2


def _half_sent(i: int) -> bytes:
    """Half a request: a cut request line, or the request line and part of the headers."""
    return [b"POST /gener", b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le", b"G"][i % 3]


def _wait_all_closed(socks: list[socket.socket]) -> dict[socket.socket, bytes]:
    """What each socket received until the server closed it (every one, or the test fails)."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    open_ = set(socks)
    deadline = time.monotonic() + WAIT_S
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            try:
                chunk = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[key.fileobj] += chunk
            else:
                sel.unregister(key.fileobj)
                open_.discard(key.fileobj)
    sel.close()
    assert not open_, f"{len(open_)} of {len(socks)} connections still open after {WAIT_S:g} s"
    return got


def test_500_half_sent_connections_hold_no_thread_each_and_are_closed_after_the_header_timeout(make_server):
    server = make_server(header_timeout_s=2.0)
    _served(server)  # the worker threads a call needs exist before counting
    before = threading.active_count()
    socks = []
    try:
        for i in range(500):
            s = _connect(server)
            s.sendall(_half_sent(i))
            socks.append(s)
        _served(server)  # connects are accepted in order: the 500 are all in the server now
        grown = threading.active_count() - before
        assert grown < 50, f"{grown} more threads with 500 idle connections open"
        got = _wait_all_closed(socks)
        for data in got.values():  # closed with a 408 naming the timeout (or a reset that lost it)
            if data:
                [(status, body)] = _answers(data)
                assert status == 408 and b"not received within 2 s" in body, data[:200]
        _served(server)
    finally:
        for s in socks:
            s.close()


def test_blank_lines_dripped_before_a_request_do_not_extend_the_header_timeout(make_server):
    """Blank lines before a request line are allowed (and ignored), but they are not a request: a
    client that sends only those, a few bytes at a time, is closed at the header timeout."""
    server = make_server(header_timeout_s=1.0)
    with _connect(server) as sock:
        sock.settimeout(0.2)
        closed = False
        deadline = time.monotonic() + WAIT_S
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"\r\n")
                closed = sock.recv(65536) == b""
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
    assert closed, f"a connection sending only blank lines was still open after {WAIT_S:g} s"
    _served(server)


def test_a_well_behaved_client_is_answered_while_500_idle_connections_are_open(make_server):
    server = make_server(header_timeout_s=600.0)
    socks = []
    try:
        for i in range(500):
            s = _connect(server)
            if i % 2:
                s.sendall(_half_sent(i))  # the others connected and sent nothing
            socks.append(s)
        for _ in range(5):
            _served(server)
        assert server.open_connections() >= 500
        sel = selectors.DefaultSelector()
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        assert sel.select(timeout=0) == []  # none of them was answered or closed meanwhile
        sel.close()
    finally:
        for s in socks:
            s.close()


def test_connections_beyond_the_bound_get_503_and_are_closed(make_server):
    server = make_server(max_connections=20, header_timeout_s=600.0)
    held = [_connect(server) for _ in range(20)]
    try:
        with _connect(server) as extra:
            data, closed = _read_to_close(extra)
        assert closed and [s for s, _ in _answers(data)] == [503], data[:200]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + WAIT_S
    while server.open_connections() and time.monotonic() < deadline:  # the server sees the closes
        time.sleep(0.05)
    _served(server)


def test_a_chunked_body_is_decoded_and_the_pipelined_request_after_it_is_its_own(make_server):
    """A chunked POST followed on the same connection by a GET: the POST is answered from its decoded
    body, the GET gets its own answer, and no part of the body is read as a request."""
    server = make_server()
    half = len(GENERATE) // 2
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{half:x}\r\n".encode() + GENERATE[:half] + b"\r\n"
               + f"{len(GENERATE) - half:x};note=x\r\n".encode() + GENERATE[half:] + b"\r\n0\r\n\r\n")
    answers, closed = _exchange(server, chunked + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert closed and [s for s, _ in answers] == [200, 200], answers
    assert len(json.loads(answers[0][1])["output_ids"]) == 2
    assert json.loads(answers[1][1])["status"] == "ok"


def test_a_body_without_content_length_gets_411_and_is_not_read_as_a_request(make_server):
    server = make_server()
    body = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # what a desynchronized server would answer next
    answers, closed = _exchange(server, b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n" + body)
    assert closed and [s for s, _ in answers] == [411], answers
    assert b"Content-Length" in answers[0][1]
    _served(server)


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nContent-Length: 40",
    b"Content-Length: 40, 40",
    b"Content-Length: +40",
    b"Content-Length: 4_0",
    b"Content-Length: 40\r\nTransfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
], ids=["two-lengths", "length-list", "plus-sign", "underscore", "length-and-chunked", "other-coding"])
def test_ambiguous_framing_gets_400_and_the_connection_is_closed(make_server, framing):
    server = make_server()
    payload = b"POST /generate HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n" + GENERATE[:40] + \
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answers, closed = _exchange(server, payload)
    assert closed and [s for s, _ in answers] == [400], answers
    _served(server)


@pytest.mark.parametrize("headers", [
    b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 8000) for i in range(20)),  # each line short, 160 KB in all
    b"".join(b"X-H-%d: 1\r\n" % i for i in range(200)),
    b"X-Big: " + b"a" * 100_000 + b"\r\n",
], ids=["many-long-lines", "many-headers", "one-huge-line"])
def test_oversized_headers_get_431(make_server, headers):
    server = make_server()
    answers, closed = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert closed and [s for s, _ in answers] == [431], answers
    _served(server)


def test_a_body_that_stops_coming_gets_408_and_the_connection_is_closed(make_server):
    server = make_server(body_timeout_s=1.0)
    answers, closed = _exchange(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n" + GENERATE[:10])
    assert closed and [s for s, _ in answers] == [408], answers
    assert b"request body not received within 1 s" in answers[0][1]
    _served(server)


def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(make_server):
    """Answered once, then nothing: the server closes it without a word (a client that reuses it
    later sees the close, not a stray answer)."""
    server = make_server(idle_timeout_s=1.0)
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, closed = _read_to_close(sock)
    assert closed and [s for s, _ in _answers(data)] == [200], data[:300]
    _served(server)
