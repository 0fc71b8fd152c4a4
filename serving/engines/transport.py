"""The HTTP of the engine clients (:mod:`serving.engines`): keep-alive connections to one engine
server, awaited on the event loop of the server that calls the engine, with a blocking form for the
few callers outside a loop.

    http = EngineHttp(timeout_s=600.0, headers={"Authorization": "Bearer ..."})
    status, body, content_type = await http.request("POST", url + "/generate", payload)   # on a loop
    http.run(engine.ahealth())     # blocking, from a thread without a running loop
    http.json("GET", url + "/v1/models")                  # blocking, JSON in and out
    answer = await http.stream("POST", url + "/v1/chat/completions", payload)   # read as it arrives:
    async for piece in answer.pieces(): ...                                      # serving.chat's streams
    answer.close()
    http.close()                   # on shutdown: every connection of every loop

Why awaited: the capture front (:mod:`serving.capture`) answers on uvicorn's event loop
(:mod:`sandboxes.httpserver`). A blocking call to the engine had to run on a worker thread, so each
``/generate`` through the front paid two thread hops (to a worker and back) and held a thread for
the engine's whole service time; awaited on the loop, it pays neither (``bench/http_server.py``,
docs/benchmarks.md, "Issue 53: the capture front awaits the engine").

How: a pool of kept-alive connections (as many as calls in flight, as the blocking pool had) per
event loop that calls, opened on that loop at its first call; in a capture front that is the
server's loop, one pool per process. Each connection is an asyncio protocol whose answers are
parsed by httptools, the parser of the project's own servers (:mod:`sandboxes.httpserver`): a call
costs the loop a write, a parse and a wake-up. With aiohttp (installed beside LiteLLM) in its place
the loop spent 0.36 ms a call in aiohttp's request path (cProfile) and the front served 0.78-1.06x
the requests/s of the hand-written server it replaced, where this serves 1.44-1.82x
(docs/benchmarks.md). A blocking call (:meth:`EngineHttp.run`: the replica polling its engine's
health before it serves, a test, a tool) runs the same coroutine on the process's loop for
blocking calls, in a thread of its own, so a blocking caller and an awaiting one share the code,
not the connections.

Failures are those of the blocking pool it replaced (:class:`serving.client.HttpPool`), so the
front answers an engine failure with the same status and ``{"error": ...}`` as before:

- an engine that cannot be reached: the ``OSError`` its socket gave, as the socket words it
  (``ConnectionRefusedError: [Errno 111] Connection refused``);
- no byte within ``timeout_s`` (to connect, or between reads of the answer): ``TimeoutError("timed out")``;
- a kept-alive connection that the engine had closed (or one that died mid-answer): the request is
  sent once more on another connection; failing twice, ``ConnectionError("{url}: ...")``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import weakref
from typing import Any, Awaitable, TypeVar
from urllib.parse import urlsplit

import httptools

from serving.client import EngineError, error_message

T = TypeVar("T")
_BREAKS_HEAD = re.compile(r"[\r\n\0]")


def _as_socket_error(exc: OSError) -> OSError:
    """``exc`` worded as a blocking socket words it (asyncio's connect says "Connect call failed
    (...)" where ``socket.create_connection`` says "Connection refused")."""
    if exc.errno:
        return type(exc)(exc.errno, os.strerror(exc.errno))
    return exc


class _Dropped(Exception):
    """A connection that ended, or sent what is not HTTP, before its answer was whole."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an engine server: sends a request, parses its answer with
    httptools (the parser the project's servers use), and wakes the caller when it is whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.loop, self.timeout_s = loop, timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.open = False
        self._answer: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._body: list[bytes] = []
        self._type = ""
        self._keep_alive = False
        self._pieces: asyncio.Queue | None = None  # a streamed answer's body pieces (then None: its end)

    # asyncio's protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.open = transport, True  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if (self._answer is None or self._answer.done()) and self._pieces is None:
            self._drop(_Dropped(f"{len(data)} bytes sent with no request waiting"))
            return
        self._arm()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._drop(_Dropped(f"the answer is not HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._disarm()
        self._fail(_Dropped(f"connection closed before the answer was whole ({exc!r})"))

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._type = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()  # read here: llhttp resets it once the answer ends
        if self._pieces is not None and self._answer is not None and not self._answer.done():
            self._answer.set_result((self.parser.get_status_code(), b"", self._type))  # the body follows

    def on_body(self, body: bytes) -> None:
        if self._pieces is not None:
            self._pieces.put_nowait(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._pieces is not None:
            self._pieces.put_nowait(None)
            self._disarm()
            return
        self._disarm()
        if self._answer is not None and not self._answer.done():
            self._answer.set_result((self.parser.get_status_code(), b"".join(self._body), self._type))

    # the caller's side
    async def exchange(self, head: bytes, body: bytes | None) -> tuple[int, bytes, str]:
        self._answer, self._body, self._type, self._keep_alive = self.loop.create_future(), [], "", False
        self.transport.write(head + body if body else head)  # type: ignore[union-attr]
        self._arm()
        try:
            answer = await self._answer
        finally:
            self._disarm()
            self._answer = None
        if not self._keep_alive:  # "Connection: close", or HTTP/1.0
            self.close()
        return answer

    async def start_streamed(self, head: bytes, body: bytes | None) -> tuple[int, str]:
        """Send a request whose answer is read as it comes: returns (status, content type) once its
        head is here; then :meth:`pieces` yields its body. The connection serves this one answer."""
        self._answer, self._type, self._pieces = self.loop.create_future(), "", asyncio.Queue()
        self.transport.write(head + body if body else head)  # type: ignore[union-attr]
        self._arm()
        try:
            status, _, content_type = await self._answer
        finally:
            self._answer = None
        return status, content_type

    async def pieces(self):
        """The streamed answer's body, piece by piece as it arrives (chunked framing removed); an
        answer cut short, or no byte within ``timeout_s``, raises as :meth:`exchange` does."""
        while True:
            piece = await self._pieces.get()  # type: ignore[union-attr]
            if piece is None:
                return
            if isinstance(piece, BaseException):
                raise piece
            yield piece

    def _fail(self, exc: BaseException) -> None:
        """End the call waiting on this connection (its answer, or its stream's next piece) with ``exc``."""
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        elif self._pieces is not None:
            self._pieces.put_nowait(exc)

    def _arm(self) -> None:
        """(Re)start the wait for the next bytes of the answer: a socket timeout's meaning."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        self._fail(TimeoutError("timed out"))
        self.close()

    def _drop(self, exc: Exception) -> None:
        self._fail(exc)
        self.close()

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """The connections of one event loop: idle ones per ``host:port`` (reused last-in first-out)
    and every open one (closed together)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.every: set[_Connection] = set()

    def close(self) -> None:
        """On the pool's loop: close every connection (a call in flight on one fails)."""
        for conn in list(self.every):
            conn.close()
        self.every.clear()
        self.idle.clear()


class EngineHttp:
    """Keep-alive HTTP/1.1 to engine servers: ``timeout_s`` bounds each wait for the connection or
    for the next bytes of an answer (not the whole call: a long generation keeps sending nothing
    until it is done, and is bounded by that wait alone, as with a socket timeout); ``headers``
    go with every request (a request's own win). Its connections are closed by :meth:`close`, or
    when it is collected, or at the process's exit."""

    def __init__(self, timeout_s: float = 600.0, *, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._pools: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_pools, self._pools, self._lock)

    # -- awaited -----------------------------------------------------------------------------------

    def _pool(self) -> _Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = _Pool(loop)
            with self._lock:
                for gone in [other for other in self._pools if other.is_closed()]:
                    del self._pools[gone]  # a loop that ended (asyncio.run): its connections went with it
                self._pools[loop] = pool
        return pool

    async def _connect(self, pool: _Pool, host: str, port: int) -> _Connection:
        try:
            async with asyncio.timeout(self.timeout_s):
                _, conn = await pool.loop.create_connection(lambda: _Connection(pool.loop, self.timeout_s), host, port)
        except TimeoutError:
            raise TimeoutError("timed out") from None
        except OSError as exc:
            raise _as_socket_error(exc) from None
        pool.every.add(conn)
        return conn

    def _head(self, method: str, url: str, body: bytes | None, headers: dict[str, str] | None) -> tuple[str, int, bytes]:
        """``(host, port, the request's head)`` for ``method url``."""
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        fields = {"Content-Type": "application/json"} if body is not None else {}
        fields.update(self.headers)
        fields.update(headers or {})
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        for name, value in fields.items():
            if _BREAKS_HEAD.search(f"{name}{value}"):
                raise ValueError(f"header {name!r}: a line break or NUL in a header would end the request's head")
            lines.append(f"{name}: {value}")
        if body is not None or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body or b'')}")
        return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def request(self, method: str, url: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
        """Send one request; returns (status, body, content type). Raises ``OSError`` when the
        server cannot be reached or does not answer in time (see the module docstring)."""
        host, port, head = self._head(method, url, body, headers)
        pool = self._pool()
        key = (host, port)
        for attempt in (0, 1):
            conn = None
            idle = pool.idle.get(key)
            while idle and attempt == 0:  # the retry takes a new connection: the idle ones may be as stale
                candidate = idle.pop()
                if candidate.open:
                    conn = candidate
                    break
                pool.every.discard(candidate)
            if conn is None:
                conn = await self._connect(pool, host, port)
            try:
                answer = await conn.exchange(head, body)
            except _Dropped as exc:
                # A kept-alive connection the server closed, or an answer cut or garbled: once more on
                # a new connection. A request that reached a dead server fails the same way twice.
                pool.every.discard(conn)
                conn.close()
                if attempt == 1:
                    raise ConnectionError(f"{url}: {exc}") from None
                continue
            except BaseException:  # a timeout, or the caller cancelled: the connection's state is unknown
                pool.every.discard(conn)
                conn.close()
                raise
            if conn.open:
                pool.idle.setdefault(key, []).append(conn)
            else:
                pool.every.discard(conn)
            return answer
        raise AssertionError("unreachable")

    async def stream(self, method: str, url: str, body: bytes | None = None,
                     headers: dict[str, str] | None = None) -> "Streamed":
        """Send one request on a connection of its own and return once the answer's head is here:
        its status and content type, and its body as it comes (:class:`Streamed`: iterate
        ``pieces()``, then ``close()``). Failures as :meth:`request`'s, without the retry (a stream
        is not sent twice)."""
        host, port, head = self._head(method, url, body, headers)
        pool = self._pool()
        conn = await self._connect(pool, host, port)
        try:
            status, content_type = await conn.start_streamed(head, body)
        except _Dropped as exc:
            pool.every.discard(conn)
            conn.close()
            raise ConnectionError(f"{url}: {exc}") from None
        except BaseException:
            pool.every.discard(conn)
            conn.close()
            raise
        return Streamed(status, content_type, conn, pool)

    async def ajson(self, method: str, url: str, payload: Any = None, headers: dict[str, str] | None = None) -> Any:
        """``payload`` sent as JSON, the answer's JSON back; a non-2xx answer raises
        :class:`serving.client.EngineError` with the server's message."""
        body = json.dumps(payload).encode() if payload is not None else None
        status, data, _ = await self.request(method, url, body, headers)
        if status >= 300:
            raise EngineError(status, error_message(data), url)
        return json.loads(data) if data else None

    # -- blocking ----------------------------------------------------------------------------------

    def run(self, call: Awaitable[T]) -> T:
        """The result of ``call`` (a coroutine of this client's), for a caller without a running
        event loop: run on the process's loop for blocking calls, in a thread of its own."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            getattr(call, "close", lambda: None)()
            raise RuntimeError("a blocking engine call on a running event loop would stop it: await the "
                               "a-prefixed method (agenerate, ahealth, ...) instead")
        return asyncio.run_coroutine_threadsafe(call, _blocking_loop()).result()

    def json(self, method: str, url: str, payload: Any = None, headers: dict[str, str] | None = None) -> Any:
        """:meth:`ajson`, blocking."""
        return self.run(self.ajson(method, url, payload, headers))

    # -- closing -----------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """:meth:`close` from a coroutine on one of the loops."""
        _close_pools(self._pools, self._lock)

    def close(self) -> None:
        """Close every connection, on the loop that holds it (a later call opens new ones); a call
        in flight on one fails. From any thread, or on one of those loops."""
        _close_pools(self._pools, self._lock)


class Streamed:
    """A streamed answer (:meth:`EngineHttp.stream`): ``status``, ``content_type``, ``pieces()``
    (the body as it arrives; an answer cut short raises ``ConnectionError``) and ``close()``."""

    def __init__(self, status: int, content_type: str, conn: _Connection, pool: _Pool):
        self.status, self.content_type = status, content_type
        self._conn, self._pool = conn, pool

    async def pieces(self):
        try:
            async for piece in self._conn.pieces():
                yield piece
        except _Dropped as exc:
            raise ConnectionError(str(exc)) from None

    async def read(self) -> bytes:
        """The whole body (an error answer's, say)."""
        return b"".join([piece async for piece in self.pieces()])

    def close(self) -> None:
        self._pool.every.discard(self._conn)
        self._conn.close()


_BLOCKING: list[asyncio.AbstractEventLoop] = []  # the process's loop for blocking calls, once started
_BLOCKING_LOCK = threading.Lock()


def _blocking_loop() -> asyncio.AbstractEventLoop:
    """One event loop, in a daemon thread, that runs every blocking call of every client of this process."""
    with _BLOCKING_LOCK:
        if not _BLOCKING:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="engine-http", daemon=True).start()
            _BLOCKING.append(loop)
        return _BLOCKING[0]


def _close_pools(pools: dict[asyncio.AbstractEventLoop, _Pool], lock: threading.Lock) -> None:
    """Close each pool's connections on its loop and forget them (a client's close, its
    collection, or the process's exit)."""
    with lock:
        items = list(pools.items())
        pools.clear()
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for loop, pool in items:
        if loop is current or (not loop.is_running() and not loop.is_closed()):
            pool.close()
        elif loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_closed(pool), loop).result(timeout=5)
            except (TimeoutError, RuntimeError):  # the loop ended meanwhile
                pass
        # a loop that ended took its connections' sockets with it


async def _closed(pool: _Pool) -> None:
    pool.close()


async def answers_health(http: EngineHttp, url: str) -> bool:
    """True when ``url``'s ``GET /health`` answers 200 (a server that cannot be reached is not healthy)."""
    try:
        status, _, _ = await http.request("GET", f"{url}/health")
    except OSError:
        return False
    return status == 200


__all__ = ["EngineHttp", "Streamed", "answers_health"]
