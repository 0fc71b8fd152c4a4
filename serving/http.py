"""HTTP for engines: SGLang's native API in front of any ``InProcessEngine``, with capture in the replica.

    server = serve(engine, host="127.0.0.1", port=0)   # port 0: pick a free one
    server.url                                         # http://127.0.0.1:PORT
    server.shutdown()

Endpoints (JSON unless said):
  POST /generate              {input_ids, sampling_params, return_logprob, lora_path, rid}
                              -> {text, output_ids, meta_info{prompt_tokens, completion_tokens,
                                 cached_tokens, finish_reason, weight_version, output_token_logprobs}}
                              (input_ids a list of lists -> a list of answers)
  POST /load_lora_adapter     {lora_name, lora_path}
  POST /unload_lora_adapter   {lora_name}
  PUT  /lora_shards/{lora_name}/{shard_index}?num_shards=N   (body: safetensors bytes)
  POST /commit_lora_adapter   {lora_name, num_shards, adapter_config}
  GET  /health, /health_generate, /server_info (alias /get_server_info), /metrics (Prometheus text)
  GET  /sessions, /sessions/{rid}; DELETE /sessions/{rid}   (captured calls: the session's key or
                              the trainer credential, serving.capture_store)

The four adapter routes need the trainer credential (``Authorization: Bearer``, else ``403``): an
adapter loaded is the policy every later call may sample, and ``lora_path`` names a folder the
replica reads.

Bad input is answered 400 with ``{"error": "..."}`` naming the field.

Every server here (:class:`JsonServer` and its subclasses: the engine server, the capture front, the
router) is uvicorn (its h11 protocol) on an event loop of its own in a background thread. Handlers
are plain blocking functions (an engine generating, the router waiting on a replica); each call runs
on a bounded pool of threads (``max_workers``) that grows with load and shrinks when idle, so the
engine still sees every call in flight at once and batches them. ``shutdown`` cuts every open connection, calls in flight included, as a crash would
(``LocalFleet.kill`` relies on that to crash an in-process replica).

Connections: a slow, stalled or odd client cannot hold the server or confuse its framing
(``HttpLimits`` sets every bound; pass ``limits=HttpLimits(...)`` to any server class):

- A connection waiting for a request costs a socket and a small buffer on the event loop, never a
  thread. Above ``max_connections`` open connections a new one gets ``503`` and is closed.
- The request line and headers must arrive within ``header_timeout_s`` of the connect or of the
  first byte after an answer (else ``408`` and close); a kept-alive connection with no new request
  for ``idle_timeout_s`` is closed; the whole body must arrive within ``body_timeout_s`` of its
  headers (else ``408``), and a streamed answer the client does not read for that long is dropped.
- Caps: request target ``max_request_line_bytes`` (``414``), headers ``max_headers`` and
  ``max_header_bytes`` (``431``), body ``max_body_bytes`` (``413`` before any of it is read).
- Framing is exact (h11 parses, and the checks below refuse what it would let through): a body is
  ``Content-Length`` bytes (exactly one such header, decimal digits) or ``Transfer-Encoding:
  chunked``, which is decoded; POST and PUT without either get ``411``; both at once, a repeated or
  malformed ``Content-Length``, any other transfer coding, or a blank line before the request line
  get ``400``. Each refusal closes the connection, so unread bytes are never taken for the next
  request.

Handlers see the request's headers (``Request.headers``) and may answer with headers of their own
(:class:`Reply`) or stream an answer as it is produced (:class:`Stream`: chunked transfer coding for
HTTP/1.1, server-sent events for ``/v1/chat/completions``); header values a handler sets are refused
unless they are printable ASCII, so a value echoed from a client cannot split the answer's head.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import re
import signal
import socket
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable
from urllib.parse import parse_qs, unquote

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.adapters import ShardAssembler
from serving.capture_store import CaptureStore, capture_generate, refusal, sessions_of
from serving.protocol import BadRequest, InProcessEngine, parse_adapter_load, parse_adapter_name, parse_generate, render_metrics

# The largest request body a server reads: above a sharded adapter upload of a large model (one
# shard of a rank-64 adapter of an 8B model is well under it), far below what would exhaust memory.
MAX_BODY_BYTES = 1 << 30


@dataclass(frozen=True)
class HttpLimits:
    """How long and how much a client may take; see the module docstring for what each refusal is."""

    header_timeout_s: float = 10.0  # request line and headers, from the first byte (or the connect)
    idle_timeout_s: float = 60.0  # a kept-alive connection between requests
    body_timeout_s: float = 60.0  # the whole body after its headers; also each write of a streamed answer
    max_connections: int = 8192  # open connections (idle ones included); beyond: 503 and close
    max_workers: int = 2048  # requests handled at once; more wait in order
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 65536  # request line and headers together
    max_headers: int = 100


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")
_DIGITS = re.compile(rb"[0-9]{1,19}")
_HOST_LINE = re.compile(rb"(?im)^host:")
_RAW_LENGTH = re.compile(rb"(?im)^content-length:[ \t]*([^\r\n]*?)[ \t]*\r?$")
_METHODS = ("GET", "POST", "PUT", "DELETE")
_JSON = b"application/json"
_CLOSE = (b"connection", b"close")
_WORKER_IDLE_S = 30.0  # a handler thread with no call for this long ends


class _Cut(Exception):
    """A streamed answer that cannot finish (its source failed, or the client stopped reading): the
    connection is cut, so the client sees a truncated answer and never a well-framed partial one."""


class _Quiet(logging.Filter):
    """uvicorn logs an application error with its traceback, and a warning for each malformed request;
    a deliberate cut is not an error, and a malformed request is answered with its reason (400)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], _Cut):
            return False
        return record.msg != "Invalid HTTP request received."


logging.getLogger("uvicorn.error").addFilter(_Quiet())


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _error_answer(status: int, message: str) -> bytes:
    """A whole error answer, for refusals made before h11 has a request to answer."""
    body = _error_body(message)
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, reason, len(body), body))


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
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot run a call after shutdown")
            self._jobs.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-worker", daemon=True).start()
            else:
                self._backlog += 1
        return future

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
            if future.set_running_or_notify_cancel():
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
            if job is not None:
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)


class _Parser(h11.Connection):
    """h11's parser, keeping the error that ended the request so the answer can name it, and refusing
    a repeated Content-Length (``40, 40`` or two equal lines), which h11 would merge into one."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        head = self.trailing_data[0] if self.their_state is h11.IDLE else b""  # a request head still to parse
        if head:
            self._default_host(head)
        try:
            event = super().next_event()
            if head and isinstance(event, h11.Request):
                lengths = _RAW_LENGTH.findall(head[:head.find(b"\n\r\n") + 1 or head.find(b"\n\n") + 1])
                if len(lengths) > 1 or (lengths and not _DIGITS.fullmatch(lengths[0])):
                    raise h11.RemoteProtocolError("more than one Content-Length given: a body has one length", 400)
            return event
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise

    def _default_host(self, head: bytes) -> None:
        """An HTTP/1.1 request without a Host header is served (h11 would refuse it): the servers here
        are reached by address, and a client that leaves Host out still gets its answer (a 413 or
        411 that names its mistake). An empty Host line is added to the head before h11 parses it."""
        head = head.lstrip(b"\r\n")
        end = head.find(b"\r\n\r\n")
        if end < 0 or _HOST_LINE.search(head, 0, end + 2) or not head[:head.find(b"\n")].rstrip().endswith(b"HTTP/1.1"):
            return
        buf = self._receive_buffer  # h11's own buffer (``head`` is all of it, blank lines stripped)
        data = buf._data
        line_end = data.find(b"\n", len(data) - len(head)) + 1
        data[line_end:line_end] = b"Host: \r\n"
        buf._next_line_search = buf._multiple_lines_search = 0


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus the bounds it has no setting for: the connection cap (503 at
    the connect), the header timeout, and error answers that carry their length and a reason."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = _Parser(h11.SERVER, limits.max_header_bytes)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"server busy: {self.limits.max_connections} open connections")
            return
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def _watch_head(self) -> None:
        """The header timeout runs while part of a request head is here and the rest is not."""
        waiting = (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                   and bool(self.conn.trailing_data[0]) and not self.transport.is_closing())
        if not waiting:
            if self.conn.their_state is not h11.IDLE:
                self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # a head that stopped coming; a silent connection just closes
            self._refuse(408, f"request line and headers not received within {self.limits.header_timeout_s:g} s")
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: answer with its reason (431 for an oversized head) and close."""
        error = self.conn.error
        status = 431 if error is not None and error.error_status_hint == 431 else 400
        self._refuse(status, f"malformed request: {error}" if error is not None else msg)

    def _refuse(self, status: int, message: str) -> None:
        self._stop_head_timer()
        self.transport.write(_error_answer(status, message))
        self.transport.close()


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Route = Callable[["Request"], Any]


class Request:
    """One request as a handler sees it; ``headers`` has lower-case names (repeated ones joined by ", ")."""

    def __init__(self, method: str, path: str, query: dict[str, list[str]], body: bytes, params: list[str],
                 headers: dict[str, str] | None = None):
        self.method, self.path, self.query, self.body, self.params = method, path, query, body, params
        self.headers = headers or {}

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc


class Text:
    """A non-JSON answer."""

    def __init__(self, text: str, content_type: str = "text/plain; version=0.0.4"):
        self.text, self.content_type = text, content_type


class Reply:
    """A JSON answer with headers of its own (``{"X-Session-Id": ...}``); values are printable ASCII."""

    def __init__(self, body: Any, headers: dict[str, str]):
        self.body, self.headers = body, headers


class Stream:
    """An answer sent while it is produced (server-sent events): ``pieces`` yields bytes, each sent
    as it comes (a chunk of ``Transfer-Encoding: chunked``). A handler checks everything that could
    fail the call before returning one: once the head is sent, the status cannot change; an error
    after that cuts the connection. ``pieces.close()`` is called when the answer ends or the client
    goes away, so a generator can release what it holds (an upstream connection) in ``finally``."""

    def __init__(self, pieces: Any, content_type: str = "text/event-stream", headers: dict[str, str] | None = None):
        self.pieces, self.content_type, self.headers = pieces, content_type, dict(headers or {})


def _raw_headers(ctype: str, headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    """An answer's headers; a handler's own are refused (ValueError) unless they are plain values,
    so a value echoed from a client (a session id) never splits the answer's head."""
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
    await _send_whole(send, status, _error_body(message), [(b"content-type", _JSON), _CLOSE])


def _framing_refusal(scope: dict, limits: HttpLimits, max_body_bytes: int) -> tuple[int, str] | tuple[None, int]:
    """``(status, reason)`` for a request refused from its head alone, else ``(None, body length)``
    (``-1``: chunked). h11 has parsed the head; this refuses what it lets through."""
    method, headers = scope["method"], scope["headers"]
    if scope["http_version"] not in ("1.1", "1.0"):
        return 505, f"HTTP version {scope['http_version']} not supported: use HTTP/1.1"
    if method not in _METHODS:
        return 501, f"method {method} not supported (one of {', '.join(_METHODS)})"
    target = len(scope["raw_path"]) + len(scope["query_string"]) + 1
    if target > limits.max_request_line_bytes:
        return 414, f"request line longer than {limits.max_request_line_bytes} bytes"
    if len(headers) > limits.max_headers:
        return 431, f"more than {limits.max_headers} header lines"
    if target + sum(len(n) + len(v) + 4 for n, v in headers) > limits.max_header_bytes:
        return 431, f"request line and headers longer than {limits.max_header_bytes} bytes"
    lengths = [v for n, v in headers if n == b"content-length"]
    codings = [v for n, v in headers if n == b"transfer-encoding"]
    if codings:
        if lengths:
            return 400, "both Content-Length and Transfer-Encoding given: a body has one framing"
        if scope["http_version"] != "1.1":
            return 400, "Transfer-Encoding: chunked needs HTTP/1.1"
        return None, -1
    if lengths:  # one, of digits only: h11 and the parser above refuse any other
        length = int(lengths[0])
        if length > max_body_bytes:  # refused before reading: a body is never buffered past the limit
            return 413, f"Content-Length {length} outside 0..{max_body_bytes}"
        return None, length
    if method in ("POST", "PUT"):
        return 411, f"{method} needs a Content-Length header (or Transfer-Encoding: chunked)"
    return None, 0


class JsonServer:
    """An HTTP/1.1 server dispatching ``(method, path prefix)`` to handlers, each call on a worker thread.

    The socket is bound here (``url`` is known at once); :meth:`start` serves it from a background
    thread running uvicorn on an event loop of its own."""

    def __init__(self, routes: dict[tuple[str, str], Route], host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES, limits: HttpLimits | None = None):
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.limits = limits or HttpLimits()
        self._sock = socket.create_server((host, port), backlog=4096)
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._pool = _Workers(self.limits.max_workers, f"http-{self.port}")
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self._asgi, http=functools.partial(_Protocol, limits=self.limits), interface="asgi3", lifespan="off",
            ws="none", proxy_headers=False, server_header=False, access_log=False, log_config=None,
            timeout_keep_alive=self.limits.idle_timeout_s, backlog=4096,
            h11_max_incomplete_event_size=self.limits.max_header_bytes))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def open_connections(self) -> int:
        """How many client connections are open now (waiting for a request or being served)."""
        return len(self._uvicorn.server_state.connections)

    def dispatch(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, str, dict[str, str]]:
        """Run the route's handler: ``(status, payload, content type, extra headers)``; the payload
        is bytes, or a :class:`Stream` to send as it is produced."""
        segments = [unquote(s) for s in path.strip("/").split("/") if s]
        handler, params = None, []
        for (m, prefix), fn in self.routes.items():
            pre = [s for s in prefix.strip("/").split("/") if s]
            if m == method and segments[:len(pre)] == pre and (len(segments) == len(pre) or prefix.endswith("/")):
                handler, params = fn, segments[len(pre):]
                break
        try:
            if handler is None:
                raise HttpError(404, f"no route for {method} {path}")
            result = handler(Request(method, path, query, body, params, headers))
        except BadRequest as exc:
            return 400, _error_body(str(exc)), "application/json", {}
        except HttpError as exc:
            return exc.status, _error_body(str(exc)), "application/json", {}
        except Exception as exc:  # an engine failure: 500 with the reason, the server keeps serving
            return 500, _error_body(f"{type(exc).__name__}: {exc}"), "application/json", {}
        if isinstance(result, Stream):
            return 200, result, result.content_type, {}
        if isinstance(result, Reply):
            return 200, json.dumps(result.body).encode(), "application/json", dict(result.headers)
        if isinstance(result, Text):
            return 200, result.text.encode(), result.content_type, {}
        return 200, json.dumps(result).encode(), "application/json", {}

    # -- the ASGI application ----------------------------------------------------------------------

    async def _asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        status, length = _framing_refusal(scope, self.limits, self.max_body_bytes)
        if status is not None:
            await _send_refusal(send, status, length)
            return
        body = b""
        if length:
            try:
                async with asyncio.timeout(self.limits.body_timeout_s):
                    body = await self._read_body(receive)
            except TimeoutError:
                await _send_refusal(send, 408, f"request body not received within {self.limits.body_timeout_s:g} s")
                return
            except HttpError as exc:
                await _send_refusal(send, exc.status, str(exc))
                return
            if body is None:  # the client went away
                return
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1")
            headers[key] = f"{headers[key]}, {value.decode('latin-1')}" if key in headers else value.decode("latin-1")
        query = parse_qs(scope["query_string"].decode("latin-1"))
        status, payload, ctype, extra = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.dispatch, scope["method"], scope["raw_path"].decode("latin-1"), query, body, headers)
        if isinstance(payload, Stream):
            await self._stream(scope, receive, send, payload, extra)
            return
        try:
            raw = _raw_headers(ctype, extra)
        except ValueError as exc:  # a header value the handler should not have set
            await _send_refusal(send, 500, str(exc))
            return
        await _send_whole(send, status, payload, raw)

    async def _read_body(self, receive: Callable) -> bytes | None:
        parts, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            total += len(part)
            if total > self.max_body_bytes:
                raise HttpError(413, f"chunked body longer than {self.max_body_bytes} bytes")
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _stream(self, scope: dict, receive: Callable, send: Callable, stream: Stream,
                      extra: dict[str, str]) -> None:
        """Send a streamed answer piece by piece (h11 frames it: chunked for HTTP/1.1, then the
        connection kept; as it comes and then a close for HTTP/1.0). Each write has
        ``body_timeout_s`` to leave; a client that stops reading, or a source that fails, cuts
        the connection."""
        loop = asyncio.get_running_loop()
        pieces = iter(stream.pieces)
        gone = asyncio.ensure_future(_disconnected(receive))
        done = object()
        try:
            try:
                raw = _raw_headers(stream.content_type, {**stream.headers, **extra})
            except ValueError as exc:
                await _send_refusal(send, 500, str(exc))
                return
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            while not gone.done():
                try:
                    piece = await loop.run_in_executor(self._pool, next, pieces, done)
                except Exception as exc:
                    raise _Cut(f"the stream's source failed: {type(exc).__name__}: {exc}") from exc
                if piece is done:
                    await send({"type": "http.response.body", "body": b""})
                    return
                if piece and not gone.done():
                    try:
                        async with asyncio.timeout(self.limits.body_timeout_s):
                            await send({"type": "http.response.body", "body": piece, "more_body": True})
                    except TimeoutError:
                        _abort(send)
                        raise _Cut(f"a streamed answer not read within {self.limits.body_timeout_s:g} s") from None
        finally:
            gone.cancel()
            close = getattr(stream.pieces, "close", None)
            if callable(close):
                try:
                    await loop.run_in_executor(self._pool, close)
                except Exception:
                    pass

    # -- running and stopping ----------------------------------------------------------------------

    def start(self) -> "JsonServer":
        self._thread = threading.Thread(target=self._run, name=f"http-{self.port}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failed is not None:
            raise RuntimeError(f"HTTP server on {self.url} did not start: {self._failed}") from self._failed
        return self

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=self._uvicorn.config.get_loop_factory()) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            if self._closed:
                return
            config = self._uvicorn.config
            config.load()
            self._uvicorn.lifespan = config.lifespan_class(config)  # "off": nothing runs at startup
            await self._uvicorn.startup(sockets=[self._sock])
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._started.set()
        while not self._stop.is_set():
            await self._uvicorn.on_tick(0)  # refreshes the Date header
            try:
                async with asyncio.timeout(1.0):
                    await self._stop.wait()
            except TimeoutError:
                pass
        for server in self._uvicorn.servers:
            server.close()
        for connection in list(self._uvicorn.server_state.connections):
            connection.transport.abort()  # calls in flight see a reset, as from a crash
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
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has just ended
                pass
            self._thread.join(timeout=5)
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def stop_as_interrupt(signum, frame) -> None:
    """A SIGTERM handler: stop as on Ctrl-C. A second SIGTERM (a fleet's shutdown may send two) must
    not cut the stop, and whatever it cleans up, short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


async def _disconnected(receive: Callable) -> None:
    """Return once the client has gone (the request's body, read or not, is passed over)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _abort(send: Callable) -> None:
    """Drop the connection behind ``send`` at once, unsent bytes and all (a ``close`` would wait for a
    client that does not read). ASGI has no message for it: uvicorn's ``send`` is a method of the
    request's cycle, which holds the transport."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None:
        transport.abort()


def check_session_access(capture: CaptureStore, session_id: str, headers: dict[str, str] | None, doing: str,
                         *, appending: bool = False) -> None:
    """Refuse (403) a caller without ``session_id``'s key or the trainer credential
    (:mod:`serving.capture_store`), whether or not the session exists; refuse (429) a call into a
    session that holds as many calls as one may."""
    if not capture.may_use(session_id, headers):
        raise HttpError(403, refusal(session_id, doing))
    if appending and capture.is_full(session_id):
        raise HttpError(429, f"session {session_id!r} holds {capture.max_calls_per_session} calls, "
                             "the most one session may hold")


def check_generate_sessions(capture: CaptureStore, requests: list, headers: dict[str, str] | None) -> None:
    """A ``/generate`` call writes into each session it names: each needs its key (or the trainer credential)."""
    for session_id in sessions_of(requests):
        check_session_access(capture, session_id, headers, "a call into it", appending=True)


def require_trainer(capture: CaptureStore, headers: dict[str, str] | None, doing: str) -> None:
    """Refuse (403) a caller without the trainer credential (:mod:`serving.capture_store`)."""
    if not capture.is_trainer(headers):
        raise HttpError(403, f"{doing} needs the trainer credential (Authorization: Bearer)")


def session_routes(capture: CaptureStore) -> dict[tuple[str, str], Route]:
    """``GET /sessions`` (with the trainer credential only) and ``GET|DELETE /sessions/{id}`` (with
    the session's key or the trainer credential); any other caller gets 403."""

    def listing(req: Request) -> Any:
        require_trainer(capture, req.headers, "listing sessions")
        return {"sessions": capture.sessions()}

    def read(req: Request) -> Any:
        rid = "/".join(req.params)
        check_session_access(capture, rid, req.headers, "reading it")
        calls = capture.session(rid)
        if calls is None:
            raise HttpError(404, f"no captured session {rid!r}")
        return {"rid": rid, "session_id": rid, "calls": calls}

    def drop(req: Request) -> Any:
        rid = "/".join(req.params)
        check_session_access(capture, rid, req.headers, "deleting it")
        return {"dropped": capture.drop(rid)}

    return {("GET", "/sessions"): listing, ("GET", "/sessions/"): read, ("DELETE", "/sessions/"): drop}


class EngineServer(JsonServer):
    """An ``InProcessEngine`` behind SGLang's native API, capturing every call in ``self.capture``."""

    def __init__(self, engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0, *, staging_dir=None,
                 model_name: str = "posttrain", limits: HttpLimits | None = None):
        self.engine = engine
        self.capture = CaptureStore()
        self.shards = ShardAssembler(staging_dir)
        self.model_name = model_name
        self._batch_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="batch")
        routes: dict[tuple[str, str], Route] = {
            ("POST", "/generate"): self._generate,
            ("POST", "/load_lora_adapter"): self._load,
            ("POST", "/unload_lora_adapter"): self._unload,
            ("PUT", "/lora_shards/"): self._shard,
            ("POST", "/commit_lora_adapter"): self._commit,
            ("GET", "/health"): lambda r: {"status": "ok"},
            ("GET", "/health_generate"): lambda r: {"status": "ok"},
            ("GET", "/server_info"): lambda r: self.engine.server_info(),
            ("GET", "/get_server_info"): lambda r: self.engine.server_info(),
            ("GET", "/metrics"): lambda r: Text(render_metrics(self.engine.metrics(), {"model_name": self.model_name})),
            **session_routes(self.capture),
        }
        super().__init__(routes, host, port, limits=limits)

    def _generate(self, req: Request) -> Any:
        body = req.json()
        requests = parse_generate(body)
        check_generate_sessions(self.capture, requests, req.headers)
        if not isinstance(body["input_ids"][0], list):
            return capture_generate(self.engine.generate, requests[0], self.capture, self.url)
        return list(self._batch_pool.map(
            lambda r: capture_generate(self.engine.generate, r, self.capture, self.url), requests))

    def _load(self, req: Request) -> Any:
        require_trainer(self.capture, req.headers, "loading an adapter")
        name, path = parse_adapter_load(req.json())
        self.engine.load_lora_adapter(name, path)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _unload(self, req: Request) -> Any:
        require_trainer(self.capture, req.headers, "unloading an adapter")
        name = parse_adapter_name(req.json())
        self.engine.unload_lora_adapter(name)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _shard(self, req: Request) -> Any:
        require_trainer(self.capture, req.headers, "uploading an adapter")
        if len(req.params) != 2:
            raise BadRequest("use PUT /lora_shards/{lora_name}/{shard_index}?num_shards=N")
        name = parse_adapter_name({"lora_name": req.params[0]})
        try:
            index = int(req.params[1])
            num_shards = int(req.query.get("num_shards", [""])[0])
        except ValueError:
            raise BadRequest("shard_index and the num_shards query parameter must be integers") from None
        self.shards.put(name, index, num_shards, req.body)
        return {"success": True}

    def _commit(self, req: Request) -> Any:
        require_trainer(self.capture, req.headers, "loading an adapter")
        body = req.json()
        name = parse_adapter_name(body)
        path = self.shards.commit(name, body.get("num_shards"), body.get("adapter_config"))
        self.engine.load_lora_adapter(name, str(path))
        return {"success": True, "lora_path": str(path), "loaded_adapters": self.engine.adapters()}

    def shutdown(self) -> None:
        super().shutdown()
        self._batch_pool.shutdown(wait=False)
        self.engine.close()


def serve(engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0, **kwargs) -> EngineServer:
    """Serve ``engine`` on ``host:port`` from a background thread; returns the running server."""
    return EngineServer(engine, host, port, **kwargs).start()
