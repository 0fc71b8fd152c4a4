"""The routes and the access policy: an ASGI application that reads a request within its bounds,
checks what its route declares (the credential, a session's key), runs the route's handler (on a
worker thread, or on the event loop where the route says so) and sends its answer.

    routes = {("GET", "/health"): lambda req: {"status": "ok"},
              ("POST", "/load_lora_adapter"): Endpoint(load, needs_bearer(credential, "loading an adapter"))}

A route is ``(method, path)``; a path ending in ``/`` is a prefix, the rest of the path split on
``/`` being ``Request.params``. Its value is a handler (no access needed) or an :class:`Endpoint`
with an :class:`Access`, which the application checks before the handler runs, so no handler checks
a credential itself. An access that :attr:`~Access.from_headers` decides before any of the body is
read (a caller without the credential never makes the server read its body); one that needs the body
(the sessions a ``/generate`` call names) after it.

Handlers are plain blocking functions (an engine generating, the router waiting on a replica),
called on a bounded pool of threads (``max_workers``) that grows with load and shrinks when idle, so
an engine still sees every call in flight at once and batches them. An ASGI server answers from its
event loop, so such a call costs two thread hops (to a worker and back); a handler that needs no
thread runs on the loop instead (``Endpoint(on_loop=True)``): an ``async def`` one, whose I/O is
awaited there (a call to an upstream server on an async connection), or a plain one that is cheap
and never blocks (a health answer). A handler returns a JSON-able
value, :class:`Text`, :class:`Reply` (JSON with a status or headers of its own) or :class:`Stream`
(an answer sent as it is produced); it raises :class:`HttpError` for an error answer, and an
exception type given in ``errors`` (a ``BadRequest``: 400) or any other (500, with its reason).
Every error answer is ``{"error": "..."}``. Header values a handler sets must be printable ASCII, so
a value echoed from a client cannot split the answer's head.

The transport's bounds that need a request (:class:`~httpserver.transport.HttpLimits`) are checked
here: the target and header caps (414, 431), the method and version (501, 505), the framing (411
without a length, 400 for any coding but chunked), the body's size (413, before it is read) and its
time (408); each refusal closes the connection, so unread bytes are never taken for a request.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import re
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol
from urllib.parse import parse_qs, unquote

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")
_METHODS = ("GET", "POST", "PUT", "DELETE")
_JSON = b"application/json"
_CLOSE = (b"connection", b"close")
_WORKER_IDLE_S = 30.0  # a handler thread with no call for this long ends


class HttpError(Exception):
    """An error answer: ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Request:
    """One request as a handler sees it; ``headers`` has lower-case names (repeated ones joined by ", ").
    ``state`` holds what an access check parsed for the handler (a ``/generate`` call's requests)."""

    __slots__ = ("method", "path", "query", "body", "params", "headers", "state", "_json")

    def __init__(self, method: str, path: str, query: dict[str, list[str]], body: bytes, params: list[str],
                 headers: dict[str, str] | None = None):
        self.method, self.path, self.query, self.body, self.params = method, path, query, body, params
        self.headers = headers or {}
        self.state: dict[str, Any] = {}
        self._json: Any = _UNPARSED

    def json(self) -> Any:
        """The body as JSON (``{}`` for none), parsed once; invalid JSON is a 400 naming the fault."""
        if self._json is _UNPARSED:
            if not self.body:
                self._json = {}
            else:
                try:
                    self._json = json.loads(self.body)
                except ValueError as exc:
                    raise HttpError(400, f"request body is not valid JSON: {exc}") from exc
        return self._json


_UNPARSED = object()


class Text:
    """A non-JSON answer."""

    def __init__(self, text: str, content_type: str = "text/plain; version=0.0.4"):
        self.text, self.content_type = text, content_type


class Reply:
    """A JSON answer with a status or headers of its own (``{"X-Session-Id": ...}``)."""

    def __init__(self, body: Any, headers: dict[str, str] | None = None, status: int = 200):
        self.body, self.headers, self.status = body, dict(headers or {}), status


class Stream:
    """An answer sent while it is produced (server-sent events): ``pieces`` yields bytes, each sent
    as it comes (a chunk of ``Transfer-Encoding: chunked``). A plain iterator is advanced on a
    worker thread (it may block); an async one (an ``async def`` generator relaying an upstream
    stream) is awaited on the event loop. A handler checks everything that could
    fail the call before returning one: once the head is sent, the status cannot change; an error
    after that cuts the connection. ``pieces.close()`` (``aclose()``) is called when the answer ends or the client
    goes away, so a generator can release what it holds (an upstream connection) in ``finally``."""

    def __init__(self, pieces: Any, content_type: str = "text/event-stream", headers: dict[str, str] | None = None):
        self.pieces, self.content_type, self.headers = pieces, content_type, dict(headers or {})


class Access(Protocol):
    """What a route needs of its caller. ``check`` raises :class:`HttpError` (403, or 429 for a
    session that is full) for a caller that may not; ``from_headers`` says it needs no body."""

    from_headers: bool

    def check(self, request: Request) -> None: ...


class Bearer:
    """The route needs ``Authorization: Bearer <credential>`` (a :class:`sandboxes.httpserver.auth.Credential`);
    ``refusal`` is what a caller without it is told."""

    from_headers = True

    def __init__(self, credential, refusal: str | Callable[[Request], str]):
        self.credential, self.refusal = credential, refusal

    def check(self, request: Request) -> None:
        if not self.credential.presented_by(request.headers):
            why = self.refusal(request) if callable(self.refusal) else self.refusal
            raise HttpError(403, why)


def needs_bearer(credential, doing: str) -> Bearer:
    """The trainer credential, for ``doing`` (``"loading an adapter"``)."""
    return Bearer(credential, f"{doing} needs the trainer credential (Authorization: Bearer)")


@dataclass(frozen=True)
class Endpoint:
    """A route's handler and what it needs of its caller (checked by the application, once).

    ``on_loop``: the handler runs on the server's event loop instead of a worker thread, which
    saves a call the two thread hops (to a worker and back). For an ``async def`` handler (its
    I/O awaited on the loop: an upstream call on an async connection), which always runs there,
    and for a plain one that is cheap and never blocks (a health answer, a counter); a handler
    that blocks there holds up every connection of the server."""

    handler: Callable[[Request], Any]
    access: Access | None = None
    on_loop: bool = False

    def __post_init__(self) -> None:
        if inspect.iscoroutinefunction(self.handler) or inspect.iscoroutinefunction(getattr(self.handler, "__call__", None)):
            object.__setattr__(self, "on_loop", True)


Route = Callable[[Request], Any]


class _Workers(Executor):
    """The handler threads: at most ``max_workers``, started as calls come, ended after
    ``_WORKER_IDLE_S`` without one. Daemon threads, unlike a ``ThreadPoolExecutor``'s, so a call
    stuck in a handler (an engine that never answers) never holds up the process's exit."""

    def __init__(self, max_workers: int, name: str):
        self._max, self._name = max_workers, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # workers waiting for a call, less the calls already promised to them
        self._backlog = 0  # calls queued while every worker was busy: the next to finish takes one
        self._closed = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._enqueue((future, fn, args, kwargs))
        return future

    def _enqueue(self, job: tuple) -> None:
        """Queue ``job`` for a waiting worker, a new one (up to the cap), or the next to finish."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run a call after shutdown")
            self._jobs.put(job)
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-worker", daemon=True).start()
            else:
                self._backlog += 1

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_WORKER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # more workers wait than there are calls: this one goes
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue  # a call was promised to a waiting worker: take it
            if job is None:
                return
            future, fn, args, kwargs = job
            if kwargs is None:  # a call of :meth:`call`: the result goes straight to the future's loop
                try:
                    result, exc = fn(*args), None
                except BaseException as error:
                    result, exc = None, error
                try:
                    future.get_loop().call_soon_threadsafe(_settle, future, result, exc)
                except RuntimeError:  # the server has stopped (its loop closed): no one waits for the answer
                    pass
                del result, exc
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)
            del job, future, fn, args, kwargs
            with self._lock:
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._idle += 1

    def call(self, fn: Callable, *args: Any) -> asyncio.Future:
        """``fn(*args)`` on a worker, awaited on the running loop: what ``run_in_executor`` does with
        one future less (the worker hands the result straight to the loop)."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue((future, fn, args, None))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls, cancel the ones not started, and let each worker end after its call."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job[3] is not None:  # a :meth:`submit`'s: its caller waits on it
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not future.done():  # cancelled meanwhile (the connection was cut)
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)


class Cut(Exception):
    """A streamed answer that cannot finish (its source failed, or the client stopped reading): the
    connection is cut, so the client sees a truncated answer and never a well-framed partial one."""


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _raw_headers(ctype: str, headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    raw = [(b"content-type", ctype.encode("latin-1"))]
    for name, value in (headers or {}).items():
        if not _TOKEN.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {name!r}: {value[:80]!r} is not a plain header value")
        raw.append((name.encode("ascii"), value.encode("ascii")))
    return raw


async def _send_whole(send: Callable, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_refusal(send: Callable, status: int, message: str) -> None:
    """An error answer that also closes the connection: whatever the client sent next is not read."""
    await _send_whole(send, status, error_body(message), [(b"content-type", _JSON), _CLOSE])


async def _disconnected(receive: Callable) -> None:
    """Return once the client has gone (the request's body, read or not, is passed over)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _answer_of(result: Any) -> tuple[int, Any, str, dict[str, str]]:
    """A handler's value as ``(status, payload, content type, extra headers)``."""
    if isinstance(result, Stream):
        return 200, result, result.content_type, {}
    if isinstance(result, Reply):
        return result.status, json.dumps(result.body).encode(), "application/json", result.headers
    if isinstance(result, Text):
        return 200, result.text.encode(), result.content_type, {}
    return 200, json.dumps(result).encode(), "application/json", {}


class App:
    """The ASGI application of one server: its routes, its bounds (``limits``: an ``HttpLimits``),
    the exception types its handlers raise for a 400 (``errors``), and ``connections``, the
    transport's per-connection hooks (:class:`sandboxes.httpserver.transport.Connections`)."""

    def __init__(self, routes: dict[tuple[str, str], Route | Endpoint], limits, connections, name: str,
                 errors: Iterable[type[BaseException]] = ()):
        self.routes = routes
        self.limits = limits
        self.connections = connections
        self.errors = tuple(errors)
        self.pool = _Workers(limits.max_workers, name)
        self._exact: dict[tuple[str, str], Endpoint] = {}
        self._prefixes: list[tuple[str, list[str], Endpoint]] = []
        for (method, path), target in routes.items():
            endpoint = target if isinstance(target, Endpoint) else Endpoint(target)
            segments = [s for s in path.strip("/").split("/") if s]
            if path.endswith("/"):
                self._prefixes.append((method, segments, endpoint))
            self._exact.setdefault((method, "/" + "/".join(segments)), endpoint)

    # -- routing and handling (on a worker thread) ------------------------------------------------

    def find(self, method: str, path: str) -> tuple[Endpoint | None, list[str]]:
        """The endpoint of ``method path`` and the path's segments after a prefix route's."""
        endpoint = self._exact.get((method, path))  # the common case: a plain path, as declared
        if endpoint is not None:
            return endpoint, []
        segments = [unquote(s) for s in path.strip("/").split("/") if s]
        endpoint = self._exact.get((method, "/" + "/".join(segments)))
        if endpoint is not None:
            return endpoint, []
        for m, pre, endpoint in self._prefixes:
            if m == method and segments[:len(pre)] == pre:
                return endpoint, segments[len(pre):]
        return None, []

    def handle(self, endpoint: Endpoint, request: Request) -> tuple[int, Any, str, dict[str, str]]:
        """Check the endpoint's body-level access and run its handler: ``(status, payload, content
        type, extra headers)``; the payload is bytes, or a :class:`Stream`."""
        try:
            access = endpoint.access
            if access is not None and not access.from_headers:
                access.check(request)
            result = endpoint.handler(request)
        except Exception as exc:
            return self._failed(exc)
        return _answer_of(result)

    async def handle_on_loop(self, endpoint: Endpoint, request: Request) -> tuple[int, Any, str, dict[str, str]]:
        """:meth:`handle` on the event loop, for an ``on_loop`` endpoint (its handler awaited if async)."""
        try:
            access = endpoint.access
            if access is not None and not access.from_headers:
                access.check(request)
            result = endpoint.handler(request)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            return self._failed(exc)
        return _answer_of(result)

    def _failed(self, exc: Exception) -> tuple[int, bytes, str, dict[str, str]]:
        if isinstance(exc, HttpError):
            return exc.status, error_body(str(exc)), "application/json", {}
        if isinstance(exc, self.errors):
            return 400, error_body(str(exc)), "application/json", {}
        # an engine failure: 500 with the reason, the server keeps serving
        return 500, error_body(f"{type(exc).__name__}: {exc}"), "application/json", {}

    def dispatch(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, str, dict[str, str]]:
        """Route, check every access the route needs and handle one request (as the ASGI app does),
        in the calling thread (an ``on_loop`` handler on an event loop of its own)."""
        endpoint, params = self.find(method, path)
        if endpoint is None:
            return 404, error_body(f"no route for {method} {path}"), "application/json", {}
        request = Request(method, path, query, body, params, headers)
        if endpoint.access is not None and endpoint.access.from_headers:
            try:
                endpoint.access.check(request)
            except HttpError as exc:
                return exc.status, error_body(str(exc)), "application/json", {}
        if endpoint.on_loop:
            return asyncio.run(self.handle_on_loop(endpoint, request))
        return self.handle(endpoint, request)

    # -- the ASGI application (on the event loop) -------------------------------------------------

    def _refusal(self, scope: dict, fields: dict[str, str]) -> tuple[int, str] | tuple[None, int]:
        """``(status, reason)`` for a request refused from its head alone, else ``(None, body
        length)`` (``-1``: chunked), with the head's header ``fields`` read into the dict given
        (the same pass: a name in lower case, repeated ones joined by ", ")."""
        limits, method, headers = self.limits, scope["method"], scope["headers"]
        if scope["http_version"] not in ("1.1", "1.0"):
            return 505, f"HTTP version {scope['http_version']} not supported: use HTTP/1.1"
        if method not in _METHODS:
            return 501, f"method {method} not supported (one of {', '.join(_METHODS)})"
        target = len(scope["raw_path"]) + len(scope["query_string"]) + 1
        if target > limits.max_request_line_bytes:
            return 414, f"request line longer than {limits.max_request_line_bytes} bytes"
        if len(headers) > limits.max_headers:
            return 431, f"more than {limits.max_headers} header lines"
        length, chunked = None, False
        for name, value in headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            fields[key] = f"{fields[key]}, {text}" if key in fields else text
            # one length and one coding at most: the transport refused the rest
            if name == b"content-length":
                if length is not None or not value.isdigit() or len(value) > 19:
                    return 400, "one Content-Length of decimal digits: a body has one length"
                length = int(value)
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked" or scope["http_version"] != "1.1":
                    return 400, "the only transfer coding taken is Transfer-Encoding: chunked, over HTTP/1.1"
                chunked = True
        if chunked:
            if length is not None:
                return 400, "both Content-Length and Transfer-Encoding given: a body has one framing"
            return None, -1
        if length is not None:
            return None, length
        if method in ("POST", "PUT"):
            return 411, f"{method} needs a Content-Length header (or Transfer-Encoding: chunked)"
        return None, 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        connection = self.connections.request_started(scope)
        try:
            await self._serve(scope, receive, send, connection)
        finally:
            self.connections.request_ended(connection)

    async def _serve(self, scope: dict, receive: Callable, send: Callable, connection: Any) -> None:
        headers: dict[str, str] = {}
        status, length = self._refusal(scope, headers)
        if status is not None:
            await _send_refusal(send, status, length)
            return
        method = scope["method"]
        path = scope["raw_path"].decode("latin-1")
        endpoint, params = self.find(method, path)
        if endpoint is None:
            await _send_refusal(send, 404, f"no route for {method} {path}")
            return
        query = scope["query_string"]
        request = Request(method, path, parse_qs(query.decode("latin-1")) if query else {}, b"", params, headers)
        access = endpoint.access
        if access is not None and access.from_headers:  # before any of the body is read
            try:
                access.check(request)
            except HttpError as exc:
                await _send_refusal(send, exc.status, str(exc))
                return
        if length > self.limits.max_body_bytes:  # refused before reading: never buffered past the limit
            limit = self.limits.max_body_bytes
            await _send_refusal(send, 413, f"Content-Length {length} outside 0..{limit}: a body is at most {limit} bytes")
            return
        if length:
            try:
                if length > 0 and self.connections.body_received(connection):
                    body = await self._read_body(receive)  # all here: no timer to arm
                else:
                    async with asyncio.timeout(self.limits.body_timeout_s):
                        body = await self._read_body(receive)
            except TimeoutError:
                t = f"{self.limits.body_timeout_s:g}"
                await _send_refusal(send, 408, f"request body not received within {t} s "
                                               f"(the whole body did not arrive within {t} s of its headers)")
                return
            except HttpError as exc:
                await _send_refusal(send, exc.status, str(exc))
                return
            if body is None:  # the client went away
                return
            request.body = body
        if endpoint.on_loop:
            status, payload, ctype, extra = await self.handle_on_loop(endpoint, request)
        else:
            status, payload, ctype, extra = await self.pool.call(self.handle, endpoint, request)
        if isinstance(payload, Stream):
            await self._stream(scope, receive, send, payload)
            return
        try:
            raw = _raw_headers(ctype, extra)
        except ValueError as exc:  # a header value the handler should not have set
            await _send_refusal(send, 500, str(exc))
            return
        self.connections.answer_is_whole(connection)
        await _send_whole(send, status, payload, raw)

    async def _read_body(self, receive: Callable) -> bytes | None:
        parts, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            total += len(part)
            if total > self.limits.max_body_bytes:
                raise HttpError(413, f"chunked body longer than {self.limits.max_body_bytes} bytes")
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts) if len(parts) > 1 else parts[0]

    async def _stream(self, scope: dict, receive: Callable, send: Callable, stream: Stream) -> None:
        """Send a streamed answer piece by piece (chunked for HTTP/1.1; as it comes and then a close
        for HTTP/1.0). Each write has ``body_timeout_s`` to leave; a client that stops reading, or a
        source that fails, cuts the connection."""
        loop = asyncio.get_running_loop()
        awaited = hasattr(stream.pieces, "__anext__")
        pieces = stream.pieces if awaited else iter(stream.pieces)
        gone = asyncio.ensure_future(_disconnected(receive))
        done = object()
        try:
            try:
                raw = _raw_headers(stream.content_type, stream.headers)
            except ValueError as exc:
                await _send_refusal(send, 500, str(exc))
                return
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            while not gone.done():
                try:
                    piece = await (anext(pieces, done) if awaited else self.pool.call(next, pieces, done))
                except Exception as exc:
                    self.connections.abort(scope)
                    raise Cut(f"the stream's source failed: {type(exc).__name__}: {exc}") from exc
                if piece is done:
                    await send({"type": "http.response.body", "body": b""})
                    return
                if piece and not gone.done():
                    try:
                        async with asyncio.timeout(self.limits.body_timeout_s):
                            await send({"type": "http.response.body", "body": piece, "more_body": True})
                    except TimeoutError:
                        self.connections.abort(scope)
                        raise Cut(f"a streamed answer not read within {self.limits.body_timeout_s:g} s") from None
        finally:
            gone.cancel()
            if awaited:  # its generator's ``finally`` runs on the loop
                aclose = getattr(stream.pieces, "aclose", None)
                if callable(aclose):
                    try:
                        await aclose()
                    except Exception:
                        pass
            else:
                close = getattr(stream.pieces, "close", None)
                if callable(close):
                    try:
                        await loop.run_in_executor(self.pool, close)
                    except Exception:
                        pass
