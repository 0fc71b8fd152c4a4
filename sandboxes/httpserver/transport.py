"""The transport: uvicorn (its httptools protocol) on an event loop of its own in a background
thread, serving one :class:`sandboxes.httpserver.app.App`, with the bounds a connection has before it has a
request.

uvicorn is used through its public interface: a ``uvicorn.Config`` (``timeout_keep_alive`` for the
idle bound, no lifespan, no logs) and ``Server.serve`` on a socket bound here, so ``url`` is known
before the server starts. What uvicorn has no setting for is done by :class:`_Gate`, an
``asyncio.Protocol`` in front of uvicorn's own (composed, through the protocol interface asyncio
defines, never subclassed): it sees each connection open and each byte arrive, and a request's head
before uvicorn parses it. The gate hands a connection to uvicorn's ``httptools`` protocol (the fast
one), or to its ``h11`` protocol where the first request is HTTP/1.0 (h11 sends a streamed answer to
such a client as it comes and then closes; httptools would frame it as chunked, which HTTP/1.0 has
not).

- Above ``max_connections`` open connections a new one gets ``503`` and is closed.
- A request's line and headers must arrive within ``header_timeout_s`` of the connect, or of the
  first byte after an answer (else ``408`` naming the bound, or a plain close where nothing came or
  ``answer_header_timeout`` is off); blank lines before a request line do not count as a request.
  A kept-alive connection with no new request for ``idle_timeout_s`` is closed (uvicorn's
  ``timeout_keep_alive``).
- A head longer than ``max_header_bytes`` gets ``431`` (it is never held past that); a head with
  more than one ``Content-Length`` line, a length that is not decimal digits, both a length and a
  transfer coding, or any transfer coding but ``chunked`` gets ``400`` before uvicorn parses it
  (httptools caps no head's size, and refuses bad framing with a bare "Invalid HTTP request").
  The gate follows each request's ``Content-Length`` (a chunked body: until its answer), so a head
  pipelined behind another is held to the same bounds; a refusal behind requests still being
  answered is sent after their answers.
- An answer's head and its body leave in one send (:class:`_Coalesced`).
- The rest (the caps on the target and the headers, the body's size and time, the method) is the
  application's (:mod:`sandboxes.httpserver.app`), with the request in hand.

``shutdown`` cuts every open connection, calls in flight included, as a crash would
(``LocalFleet.kill`` relies on that to crash an in-process replica).
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Iterable

import uvicorn

from sandboxes.httpserver.app import App, Cut, Endpoint, Route, error_body

# The largest request body a server reads: above a sharded adapter upload of a large model (one
# shard of a rank-64 adapter of an 8B model is well under it), far below what would exhaust memory.
MAX_BODY_BYTES = 1 << 30


@dataclass(frozen=True)
class HttpLimits:
    """How long and how much a client may take; see the module docstrings for what each refusal is."""

    header_timeout_s: float = 10.0  # request line and headers, from the first byte (or the connect)
    idle_timeout_s: float = 60.0  # a kept-alive connection between requests
    body_timeout_s: float = 60.0  # the whole body after its headers; also each write of a streamed answer
    max_connections: int = 8192  # open connections (idle ones included); beyond: 503 and close
    max_workers: int = 2048  # requests handled at once; more wait in order
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 65536  # request line and headers together
    max_headers: int = 100
    max_body_bytes: int = MAX_BODY_BYTES
    answer_header_timeout: bool = True  # 408 for a head that stopped coming (else a plain close)


_HEAD_END = re.compile(rb"\r?\n\r?\n")
_DIGITS = re.compile(rb"[0-9]{1,19}")


class _Quiet(logging.Filter):
    """uvicorn logs an application error with its traceback: a deliberate cut is not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Cut))


logging.getLogger("uvicorn.error").addFilter(_Quiet())


def _answer(status: int, message: str) -> bytes:
    """A whole error answer, for refusals made before there is a request to answer."""
    body = error_body(message)
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, reason, len(body), body))


def _framing(head: bytes) -> tuple[str | None, int | None]:
    """``(why the head's framing is refused or None, its body's length)``: the length is None for a
    chunked body (see the module docstring)."""
    low = head.lower()
    lengths = low.count(b"\ncontent-length:")
    codings = low.count(b"\ntransfer-encoding:")
    if not lengths and not codings:
        return None, 0
    value = _value(head, low, b"\ncontent-length:") if lengths else b""
    if lengths > 1 or (lengths and not _DIGITS.fullmatch(value)):
        return "one Content-Length of decimal digits: a body has one length", 0
    if lengths and codings:
        return "both Content-Length and Transfer-Encoding given: a body has one framing", 0
    if codings > 1 or (codings and _value(low, low, b"\ntransfer-encoding:") != b"chunked"):
        return "the only transfer coding taken is Transfer-Encoding: chunked", 0
    return None, (int(value) if lengths else None)


def _value(head: bytes, low: bytes, name: bytes) -> bytes:
    """The value of the header line ``name`` (lower-case, with its line's newline) in ``head``."""
    start = low.find(name) + len(name)
    return head[start:low.find(b"\n", start)].strip(b" \t\r")


class Connections:
    """The server's open connections, each with its :class:`_Gate`; the application's hooks into
    them (a request started and ended, a connection to cut) go through here."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.open = 0
        self.by_peer: dict[Any, _Gate] = {}

    def request_started(self, scope: dict) -> "_Gate | None":
        return self.by_peer.get(scope.get("client"))

    def body_received(self, gate: "_Gate | None") -> bool:
        """Whether every byte of the request's body (one with a ``Content-Length``) has reached
        uvicorn's protocol: the gate is past the body of every request it passed on, so the
        application's read of it returns at once."""
        return gate is not None and gate.waiting and not gate.refused

    def answer_is_whole(self, gate: "_Gate | None") -> None:
        """The answer's head about to be sent is followed by its whole body at once: the two leave
        in one send with no flush scheduled in between (:class:`_Coalesced`)."""
        if gate is not None and gate.out is not None:
            gate.out.whole = True

    def request_ended(self, gate: "_Gate | None") -> None:
        if gate is not None:
            gate.answered()

    def abort(self, scope: dict) -> None:
        """Drop the request's connection at once, unsent bytes and all (a ``close`` would wait for a
        client that does not read)."""
        gate = self.by_peer.get(scope.get("client"))
        if gate is not None and gate.transport is not None:
            gate.transport.abort()


class _Coalesced:
    """The transport as uvicorn's protocol sees it: an answer's head waits for the write that follows
    it in the same turn of the event loop (its body, or a streamed answer's first piece), and the two
    leave in one send; a head with nothing after it leaves at the end of the turn. For an answer
    the application sends whole (``whole``, set just before its head) the head waits for its body
    without a flush scheduled: the body's write sends both."""

    __slots__ = ("_transport", "_loop", "_pending", "whole")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop, self._pending = transport, loop, []
        self.whole = False

    def write(self, data: bytes) -> None:
        self._pending.append(data)
        if len(self._pending) > 1:
            self._flush()
        elif self.whole:  # an answer's head: its body comes next
            self.whole = False
        else:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:  # the rest of the transport's interface, as it is
        return getattr(self._transport, name)


class _Gate(asyncio.Protocol):
    """One connection's bounds before uvicorn's protocol (``inner``) sees a request (module docstring)."""

    def __init__(self, inner_factory: Callable[[bool], asyncio.Protocol], connections: Connections):
        self.inner_factory = inner_factory  # True: the first request is HTTP/1.0
        self.connections = connections
        self.limits = connections.limits
        self.inner: asyncio.Protocol | None = None  # made when the first head is here
        self.out: _Coalesced | None = None  # the transport as the inner protocol sees it
        self.refused = False
        self.deferred = b""  # a refusal of a pipelined head, sent once the answers before it are
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.waiting = True  # the next bytes are a request's head
        self.body_left: int | None = 0  # bytes of the current request's body still to pass on (None: chunked)
        self.in_flight = 0  # requests passed on to uvicorn and not answered yet
        self.head = b""  # a head still coming (held here until it is whole)
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.connections.open += 1
        if self.connections.open > self.limits.max_connections:
            self._refuse(503, f"server busy: {self.limits.max_connections} connections open; try again")
            return
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = (str(peer[0]), int(peer[1]))  # as uvicorn's scope["client"] has it
            self.connections.by_peer[self.peer] = self
        self.timer = asyncio.get_running_loop().call_later(self.limits.header_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        """Bytes of a body go on to uvicorn as they come; the bytes after a body (a request's
        ``Content-Length``: the gate follows the framing, so a request pipelined behind another is
        scanned too) are a head, held here until it is whole, then passed on with what follows."""
        if self.refused:
            return
        if not self.waiting:
            left = self.body_left
            if left is None or len(data) <= left:  # chunked (uvicorn finds its end), or all body
                if left is not None:
                    self.body_left = left - len(data)
                    self.waiting = self.body_left == 0
                self.inner.data_received(data)
                return
            self.body_left, self.waiting = 0, True
            self.inner.data_received(data[:left])
            data = data[left:]
        head = (self.head + data) if self.head else data
        while head:
            if head[:1] in (b"\r", b"\n"):  # blank lines before a request line: allowed, and no request
                head = head.lstrip(b"\r\n")
            end = _HEAD_END.search(head, 0, self.limits.max_header_bytes + 4)
            if end is None:
                if len(head) > self.limits.max_header_bytes:
                    self._refuse(431, f"request line and headers longer than {self.limits.max_header_bytes} bytes")
                    return
                self.head = head
                if self.timer is None and head:  # the head has begun: it has header_timeout_s to finish
                    self.timer = asyncio.get_running_loop().call_later(self.limits.header_timeout_s, self._head_timed_out)
                return
            fault, length = _framing(head[:end.end()])
            if fault is not None:
                self._refuse(400, fault)
                return
            self.head = b""
            self.head_complete()
            if self.inner is None:
                line = head[:head.find(b"\n")].rstrip()
                self.inner = self.inner_factory(line.endswith(b"HTTP/1.0"))
                self.out = _Coalesced(self.transport, asyncio.get_running_loop())
                self.inner.connection_made(self.out)
            self.in_flight += 1
            rest = len(head) - end.end()
            if length is None or rest <= length:
                self.body_left = None if length is None else length - rest
                self.waiting = self.body_left == 0
                self.inner.data_received(head)
                return
            cut = end.end() + length  # a pipelined request follows this one's body
            self.body_left, self.waiting = 0, True
            self.inner.data_received(head[:cut])
            head = head[cut:]

    def head_complete(self) -> None:
        self.waiting = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def answered(self) -> None:
        """A request's answer is sent: after a chunked body the next bytes are a head again."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.body_left is None:
            self.body_left, self.waiting = 0, True
        if self.deferred and not self.in_flight:
            self.transport.write(self.deferred)
            self.transport.close()

    def _head_timed_out(self) -> None:
        self.timer = None
        if self.transport is None or self.transport.is_closing() or not self.waiting:
            return
        if self.in_flight:  # a head pipelined behind a call still being answered: wait for the answer
            self.timer = asyncio.get_running_loop().call_later(self.limits.header_timeout_s, self._head_timed_out)
            return
        if self.head and self.limits.answer_header_timeout:  # a head that stopped coming
            self._refuse(408, f"request line and headers not received within {self.limits.header_timeout_s:g} s")
        else:  # a silent connection, or blank lines only
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self.refused = True
        self.head = b""
        self.head_complete()
        if self.in_flight:  # answers to the requests before it come first: then this one, and the close
            self.deferred = _answer(status, message)
            self.transport.pause_reading()
            return
        self.transport.write(_answer(status, message))
        self.transport.close()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.open -= 1
        self.head_complete()
        if self.peer is not None and self.connections.by_peer.get(self.peer) is self:
            del self.connections.by_peer[self.peer]
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class HttpServer:
    """An HTTP/1.1 server of ``routes`` (see :mod:`sandboxes.httpserver.app`), bounded by ``limits``.

    The socket is bound here (``url`` is known at once); :meth:`start` serves it from a background
    thread running uvicorn on an event loop of its own."""

    def __init__(self, routes: dict[tuple[str, str], Route | Endpoint], host: str = "127.0.0.1", port: int = 0,
                 limits: HttpLimits | None = None, *, errors: Iterable[type[BaseException]] = ()):
        self.limits = limits or HttpLimits()
        self._sock = socket.create_server((host, port), backlog=4096)
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.connections = Connections(self.limits)
        self.app = App(routes, self.limits, self.connections, f"http-{self.port}", errors)
        self.routes = self.app.routes
        config = uvicorn.Config(self.app, http=self._gate, interface="asgi3", lifespan="off", ws="none",
                                proxy_headers=False, server_header=False, access_log=False,
                                log_config=None, timeout_keep_alive=self.limits.idle_timeout_s, backlog=4096)
        self._protocols = []  # uvicorn's protocol classes, resolved from their names as uvicorn does
        for name in ("httptools", "h11"):
            inner = uvicorn.Config(self.app, http=name, log_config=None,
                                   h11_max_incomplete_event_size=self.limits.max_header_bytes)
            inner.load()
            self._protocols.append(inner.http_protocol_class)
        self._uvicorn = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def _gate(self, **kwargs: Any) -> _Gate:
        """uvicorn's protocol factory (``Config(http=...)``): a gate in front of httptools' protocol."""
        return _Gate(lambda http10: self._protocols[http10](**kwargs), self.connections)

    def open_connections(self) -> int:
        """How many client connections are open now (waiting for a request or being served)."""
        return self.connections.open

    def dispatch(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, str, dict[str, str]]:
        """One request handled as the server would, without HTTP (``(status, payload, type, headers)``)."""
        return self.app.dispatch(method, path, query, body, headers)

    # -- running and stopping ----------------------------------------------------------------------

    def start(self) -> "HttpServer":
        self._thread = threading.Thread(target=self._run, name=f"http-{self.port}", daemon=True)
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():  # uvicorn has no started event
            self._thread.join(timeout=0.002)
        if not self._uvicorn.started:
            raise RuntimeError(f"HTTP server on {self.url} did not start: {self._failed}") from self._failed
        return self

    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._uvicorn.config.get_loop_factory()) as runner:
                self._loop = runner.get_loop()
                if not self._closed:
                    runner.run(self._uvicorn.serve(sockets=[self._sock]))
        except BaseException as exc:
            self._failed = exc
            raise

    def _cut(self) -> None:
        """On the loop: stop uvicorn and cut every connection at once (calls in flight see a reset)."""
        self._uvicorn.should_exit = self._uvicorn.force_exit = True
        for server in self._uvicorn.servers:
            server.close()
        for gate in list(self.connections.by_peer.values()):
            if gate.transport is not None:
                gate.transport.abort()
        for task in list(self._uvicorn.server_state.tasks):
            task.cancel()

    def serve_until_stopped(self) -> None:
        if self._thread is None:
            self.start()
        while self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def run_in_foreground(self, banner: str) -> int:
        """Print ``banner``, serve until interrupted, then shut down: the body of a server's ``__main__``.

        SIGTERM (a pod's deletion, a fleet's stop) stops it as Ctrl-C does, even where the process
        inherited SIGTERM ignored or blocked from whatever started it; a handler the caller set is kept."""
        try:
            if threading.current_thread() is threading.main_thread():
                if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN):
                    signal.signal(signal.SIGTERM, stop_as_interrupt)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
            print(banner, flush=True)
            self.serve_until_stopped()
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Stop listening and cut every open connection (calls in flight see a reset, as from a crash)."""
        self._closed = True
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._cut)
            except RuntimeError:  # the loop has just ended
                pass
            self._thread.join(timeout=5)
        self._sock.close()
        self.app.pool.shutdown(wait=False, cancel_futures=True)


def stop_as_interrupt(signum, frame) -> None:
    """A SIGTERM handler: stop as on Ctrl-C. A second SIGTERM (a fleet's shutdown may send two) must
    not cut the stop, and whatever it cleans up, short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt
