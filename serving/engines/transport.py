"""The HTTP of the engine clients (:mod:`serving.engines`): keep-alive connections to one engine
server, awaited on the event loop of the server that calls the engine, with a blocking form for the
few callers outside a loop.

    http = EngineHttp(timeout_s=600.0, headers={"Authorization": "Bearer ..."})
    status, body, content_type = await http.request("POST", url + "/generate", payload)   # on a loop
    http.run(engine.ahealth())     # blocking, from a thread without a running loop
    http.json("GET", url + "/v1/models")                  # blocking, JSON in and out
    http.close()                   # on shutdown: every connection of every loop

Why awaited: the capture front (:mod:`serving.capture`) answers on uvicorn's event loop
(:mod:`sandboxes.httpserver`). A blocking call to the engine had to run on a worker thread, so each
``/generate`` through the front paid two thread hops (to a worker and back) and held a thread for
the engine's whole service time; awaited on the loop, it pays neither (``bench/http_server.py``,
docs/benchmarks.md, "Issue 53: the capture front awaits the engine").

How: one ``aiohttp.ClientSession`` (its connection pool, unbounded as the blocking pool was) per
event loop that calls, made on that loop at its first call; in a capture front that is the
server's loop, one per process. A blocking call (:meth:`EngineHttp.run`: the replica polling its
engine's health before it serves, a test, a tool) runs the same coroutine on the process's loop
for blocking calls, in a thread of its own, so a blocking caller and an awaiting one share the
code, not the connections. ``aiohttp`` comes with the base install (the ``kubernetes`` client and LiteLLM need it).

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
import threading
import weakref
from typing import Any, Awaitable, TypeVar

import aiohttp

from serving.client import EngineError, error_message

T = TypeVar("T")


def _as_socket_error(exc: OSError) -> OSError:
    """``exc`` worded as a blocking socket words it (asyncio's connect says "Connect call failed
    (...)" where ``socket.create_connection`` says "Connection refused")."""
    if exc.errno:
        return type(exc)(exc.errno, os.strerror(exc.errno))
    return exc


class EngineHttp:
    """Keep-alive HTTP/1.1 to engine servers: ``timeout_s`` bounds each wait for the connection or
    for the next bytes of an answer (not the whole call: a long generation keeps sending nothing
    until it is done, and is bounded by that wait alone, as with a socket timeout); ``headers``
    go with every request (a request's own win). Its connections are closed by :meth:`close`, or
    when it is collected, or at the process's exit."""

    def __init__(self, timeout_s: float = 600.0, *, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_sessions, self._sessions, self._lock)

    # -- awaited -----------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                # limit=0: as many connections as calls in flight, as the blocking pool had; the engine
                # batches what arrives together
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
            with self._lock:
                for gone in [other for other in self._sessions if other.is_closed()]:
                    del self._sessions[gone]  # a loop that ended (asyncio.run): its connections went with it
                self._sessions[loop] = session
        return session

    async def request(self, method: str, url: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
        """Send one request; returns (status, body, content type). Raises ``OSError`` when the
        server cannot be reached or does not answer in time (see the module docstring)."""
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        hdrs.update(self.headers)
        hdrs.update(headers or {})
        for attempt in (0, 1):
            try:
                async with self._session().request(method, url, data=body, headers=hdrs) as resp:
                    data = await resp.read()
                    return resp.status, data, resp.headers.get("Content-Type", "")
            except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors
                raise TimeoutError("timed out") from None
            except aiohttp.ClientConnectorError as exc:  # never connected: nothing was sent
                raise _as_socket_error(exc.os_error) from exc
            except aiohttp.ClientError as exc:
                # A kept-alive connection the server closed, or an answer cut or garbled: once more on
                # another connection. A request that reached a dead server fails the same way twice.
                if attempt == 1:
                    raise ConnectionError(f"{url}: {exc!r}") from exc
        raise AssertionError("unreachable")

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
        """:meth:`close` from a coroutine: this loop's connections are closed when it returns."""
        with self._lock:
            mine = self._sessions.pop(asyncio.get_running_loop(), None)
        if mine is not None:
            await mine.close()
        _close_sessions(self._sessions, self._lock)

    def close(self) -> None:
        """Close every connection, on the loop that holds it (a later call opens new ones). From a
        thread other than those loops' (a server's shutdown), or on one of them (the close of that
        loop's connections is then scheduled there)."""
        _close_sessions(self._sessions, self._lock)


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


def _close_sessions(sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession], lock: threading.Lock) -> None:
    """Close each of ``sessions`` on its loop and forget them (a client's close, its collection, or exit)."""
    with lock:
        items = list(sessions.items())
        sessions.clear()
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for loop, session in items:
        if session.closed or loop.is_closed():
            continue  # a loop that ended took its connections' sockets with it
        if loop is current:
            loop.create_task(session.close())
        elif loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)
            except (TimeoutError, RuntimeError):  # the loop ended meanwhile
                pass
        else:
            loop.run_until_complete(session.close())


async def answers_health(http: EngineHttp, url: str) -> bool:
    """True when ``url``'s ``GET /health`` answers 200 (a server that cannot be reached is not healthy)."""
    try:
        status, _, _ = await http.request("GET", f"{url}/health")
    except OSError:
        return False
    return status == 200


__all__ = ["EngineHttp", "answers_health"]
