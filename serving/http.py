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

Bad input is answered 400 with ``{"error": "..."}`` naming the field.

Connections: a slow, stalled or odd client cannot hold the server or confuse its framing
(``HttpLimits`` sets every bound; pass ``limits=HttpLimits(...)`` to any server class):

- A connection waiting for a request costs a socket and a small buffer, never a thread: one
  selector thread collects request lines and headers, and only a complete head goes to a worker
  thread. Workers are a bounded pool (``max_workers``) that grows with load and shrinks when idle;
  requests beyond it wait in order. Above ``max_connections`` open connections a new one gets
  ``503`` and is closed.
- The request line and headers must arrive within ``header_timeout_s`` (else ``408`` and close);
  a kept-alive connection with no new request for ``idle_timeout_s`` is closed; the whole body must
  arrive within ``body_timeout_s`` of its headers (else ``408``), and an answer the client does not
  read for that long is dropped.
- Caps: request line ``max_request_line_bytes`` (``414``), headers ``max_headers`` and
  ``max_header_bytes`` (``431``), body ``max_body_bytes`` (``413`` before any of it is read).
- Framing is exact: a body is ``Content-Length`` bytes (exactly one such header, decimal digits) or
  ``Transfer-Encoding: chunked``, which is decoded; POST and PUT without either get ``411``; both at
  once, a repeated or malformed ``Content-Length``, or any other transfer coding get ``400``. Each
  refusal closes the connection, so unread bytes are never taken for the next request.

Why a hardened standard-library server and not uvicorn/starlette: every handler here blocks (an
engine generating, the router or sidecar waiting on a replica), and the engine batches the calls
that are in flight at once; plain threads keep that as it was, while an ASGI server would put each
handler behind an event loop and a thread pool of its own and change how the servers start, stop
and cut connections in process (``shutdown`` cuts calls in flight as a crash would, and
``LocalFleet.kill`` relies on that to crash an in-process replica). The protocol surface we need
(no TLS, no upgrades) is small enough to parse strictly here.

Handlers see the request's headers (``Request.headers``) and may answer with headers of their own
(:class:`Reply`) or stream an answer as it is produced (:class:`Stream`: chunked transfer coding for
HTTP/1.1, server-sent events for ``/v1/chat/completions``); a streamed answer keeps every bound above
(each write must leave within ``body_timeout_s``), and header values a handler sets are refused unless
they are printable ASCII, so a value echoed from a client cannot split the answer's head.
"""

from __future__ import annotations

import errno
import json
import re
import selectors
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

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
    body_timeout_s: float = 60.0  # the whole body after its headers; also writing the answer
    max_connections: int = 8192  # open connections (idle ones included); beyond: 503 and close
    max_workers: int = 2048  # requests handled at once; more wait in order
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 65536  # request line and headers together
    max_headers: int = 100


_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DIGITS = re.compile(rb"[0-9]{1,19}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_METHODS = ("GET", "POST", "PUT", "DELETE")
_SCAN_INTERVAL_S = 0.25  # how often the selector looks for connections past their deadline
_LINGER_S = 2.0  # after a refusal, how long unread input is drained so the answer is not lost to a reset
_WORKER_IDLE_S = 30.0  # a worker thread with nothing to do for this long exits


class _Refusal(Exception):
    """A request that is answered with ``status`` and then the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Gone(Exception):
    """The peer closed or reset the connection, or stopped sending past a deadline with no answer due."""


_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


def _head(status: int, ctype: str, close: bool, headers: dict[str, str] | None = None,
          length: int | None = None, chunked: bool = False) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}", "Server: posttrain", f"Date: {formatdate(usegmt=True)}",
             f"Content-Type: {ctype}"]
    for name, value in (headers or {}).items():
        # A handler may echo a client's value (a session id): it never splits the answer's head.
        if not _TOKEN.fullmatch(name.encode("latin-1", "replace")) or not _HEADER_VALUE.fullmatch(value):
            raise ValueError(f"header {name!r}: {value[:80]!r} is not a plain header value")
        lines.append(f"{name}: {value}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _answer(status: int, payload: bytes, ctype: str, close: bool, headers: dict[str, str] | None = None) -> bytes:
    # One write for status line, headers and body: a reader that takes the first segment gets the
    # whole answer, and no delayed ACK stalls a second small write.
    return _head(status, ctype, close, headers, length=len(payload)) + payload


def _error_answer(status: int, message: str) -> bytes:
    return _answer(status, json.dumps({"error": message}).encode(), "application/json", close=True)


class _Connection:
    """One client connection: its socket, the bytes read but not yet used, and its state."""

    __slots__ = ("sock", "buf", "scanned", "deadline", "idle", "closing")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.scanned = 0  # how far ``buf`` has been searched for the end of the head
        self.deadline = 0.0
        self.idle = False  # kept alive between requests: the idle timeout runs, not the header timeout
        self.closing = False  # refused: draining input until the peer closes or the linger ends

    def fill(self, deadline: float) -> None:
        """Read more bytes into ``buf`` (blocking), or raise ``_Gone`` past ``deadline`` or at EOF."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        self.sock.settimeout(remaining)
        data = self.sock.recv(1 << 16)
        if not data:
            raise _Gone
        self.buf += data

    def read_line(self, limit: int, deadline: float, what: str) -> bytes:
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 1]
                return line[:-1] if line.endswith(b"\r") else line
            if len(self.buf) > limit:
                raise _Refusal(400, f"{what} longer than {limit} bytes")
            self.fill(deadline)

    def read_exact(self, n: int, deadline: float) -> bytes:
        if len(self.buf) >= n:
            data = bytes(self.buf[:n])
            del self.buf[:n]
            return data
        out = bytearray(n)
        view = memoryview(out)
        have = len(self.buf)
        view[:have] = self.buf
        self.buf.clear()
        while have < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            got = self.sock.recv_into(view[have:], min(n - have, 1 << 20))
            if not got:
                raise _Gone
            have += got
        view.release()
        return bytes(out)


class _Server:
    """The listening socket, the selector that waits on idle connections, and the worker pool.

    Exposes the part of ``socketserver``'s interface that callers use: ``serve_forever``,
    ``shutdown``, ``server_close`` and ``server_address``.
    """

    def __init__(self, address: tuple[str, int], handle: Callable[[str, str, bytes], tuple[int, bytes, str]],
                 limits: HttpLimits, max_body_bytes: int):
        self.handle, self.limits, self.max_body_bytes = handle, limits, max_body_bytes
        self.listener = socket.create_server(address, backlog=4096)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self.connections: set[_Connection] = set()  # every open connection, waiting or being served
        self._returned: deque[_Connection] = deque()  # handed back by workers, for the selector
        self._stop = False
        self._closed = False
        self._running = threading.Event()
        self._stopped = threading.Event()
        self._accept_paused_until = 0.0
        self._pool = threading.Condition()
        self._jobs: deque[tuple[_Connection, int]] = deque()  # a connection and the length of its head
        self._workers = 0
        self._idle_workers = 0

    # -- the selector thread ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        if self._stop or self._closed:
            return
        self._stopped.clear()
        self._running.set()
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        next_scan = time.monotonic() + _SCAN_INTERVAL_S
        try:
            while not self._stop:
                for key, _ in self.selector.select(timeout=_SCAN_INTERVAL_S):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._take_returned()
                    else:
                        self._on_readable(key.data)
                now = time.monotonic()
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self.selector.register(self.listener, selectors.EVENT_READ, "listen")
                if now >= next_scan:
                    next_scan = now + _SCAN_INTERVAL_S
                    self._expire(now)
        finally:
            for key in list(self.selector.get_map().values()):
                self.selector.unregister(key.fileobj)
            self._running.clear()
            self._stopped.set()

    def _accept(self) -> None:
        for _ in range(256):  # a burst of connects is taken in one go, then the others get a turn
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EINVAL):  # the listener was closed
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of file descriptors: stop accepting for a moment instead of spinning on
                    # a listener that stays readable; the kernel's backlog holds the connects.
                    self.selector.unregister(self.listener)
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                continue  # a connect that was reset before it was accepted
            with self._lock:
                full = len(self.connections) >= self.limits.max_connections
            if full:
                self._send_now(sock, _error_answer(503, f"server busy: {self.limits.max_connections} open connections"))
                self._close_sock(sock)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small answers leave at once
            conn = _Connection(sock)
            with self._lock:
                self.connections.add(conn)
            conn.deadline = time.monotonic() + self.limits.header_timeout_s
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _take_returned(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn = self._returned.popleft()
            except IndexError:
                return
            now = time.monotonic()
            conn.idle = not conn.closing and not conn.buf
            if conn.closing:
                conn.deadline = now + _LINGER_S
            elif conn.idle:
                conn.deadline = now + self.limits.idle_timeout_s
            else:
                conn.deadline = now + self.limits.header_timeout_s
            try:
                conn.sock.setblocking(False)
                self.selector.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):  # cut by shutdown meanwhile
                self._close(conn)
                continue
            if not conn.closing:
                self._try_dispatch(conn)

    def _on_readable(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unregister(conn)
            self._close(conn)
            return
        if conn.closing:
            return  # drained and dropped
        if conn.idle:  # the first byte of the next request: its head must now arrive in time
            conn.idle = False
            conn.deadline = time.monotonic() + self.limits.header_timeout_s
        conn.buf += data
        self._try_dispatch(conn)

    def _try_dispatch(self, conn: _Connection) -> None:
        if conn.buf[:1] in (b"\r", b"\n"):  # blank lines between requests are allowed and ignored
            stripped = conn.buf.lstrip(b"\r\n")
            conn.scanned = max(0, conn.scanned - (len(conn.buf) - len(stripped)))
            conn.buf = stripped
            if not conn.buf:
                return
        found = _HEAD_END.search(conn.buf, max(0, conn.scanned - 3))
        if found is None:
            conn.scanned = len(conn.buf)
            limits = self.limits
            if len(conn.buf) > limits.max_request_line_bytes and conn.buf.find(b"\n", 0, limits.max_request_line_bytes + 2) < 0:
                self._refuse_waiting(conn, 414, f"request line longer than {limits.max_request_line_bytes} bytes")
            elif len(conn.buf) > limits.max_header_bytes:
                self._refuse_waiting(conn, 431, f"request line and headers longer than {limits.max_header_bytes} bytes")
            return
        conn.scanned = 0
        self._unregister(conn)
        self._submit(conn, found.end())

    def _refuse_waiting(self, conn: _Connection, status: int, message: str) -> None:
        self._send_now(conn.sock, _error_answer(status, message))
        self._linger(conn)

    def _linger(self, conn: _Connection) -> None:
        """Close after an error answer: stop writing, drain what the client still sends for a moment."""
        conn.closing = True
        conn.buf.clear()
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._unregister(conn)
            self._close(conn)
            return
        conn.deadline = time.monotonic() + _LINGER_S

    def _expire(self, now: float) -> None:
        for key in list(self.selector.get_map().values()):
            conn = key.data
            if isinstance(conn, _Connection) and now >= conn.deadline:
                self._unregister(conn)
                if not conn.idle and not conn.closing and conn.buf:  # a head that stopped coming
                    self._send_now(conn.sock, _error_answer(
                        408, f"request line and headers not received within {self.limits.header_timeout_s:g} s"))
                self._close(conn)  # an idle or lingering connection just closes

    def _unregister(self, conn: _Connection) -> None:
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    @staticmethod
    def _send_now(sock: socket.socket, data: bytes) -> None:
        """Best-effort write that never blocks the selector (an error answer fits the socket buffer)."""
        try:
            sock.setblocking(False)
            sock.send(data)
        except OSError:
            pass

    @staticmethod
    def _close_sock(sock: socket.socket) -> None:
        try:
            sock.close()
        except OSError:
            pass

    def _close(self, conn: _Connection) -> None:
        with self._lock:
            self.connections.discard(conn)
        self._close_sock(conn.sock)

    def _hand_back(self, conn: _Connection) -> None:
        """From a worker: the selector waits for the connection's next request (or its linger ends)."""
        if self._closed or self._stop:
            self._close(conn)
            return
        self._returned.append(conn)
        try:
            self._wake_w.send(b"x")
        except BlockingIOError:
            pass  # the selector has wake-ups pending already
        except OSError:
            self._close(conn)

    # -- the worker pool ---------------------------------------------------------------------------

    def _submit(self, conn: _Connection, head_end: int) -> None:
        with self._pool:
            self._jobs.append((conn, head_end))
            if len(self._jobs) > self._idle_workers and self._workers < self.limits.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name=f"http-{self.server_address[1]}-worker", daemon=True).start()
            self._pool.notify()

    def _work(self) -> None:
        while True:
            with self._pool:
                while not self._jobs:
                    self._idle_workers += 1
                    woke = self._pool.wait(timeout=_WORKER_IDLE_S)
                    self._idle_workers -= 1
                    if not woke and not self._jobs:
                        self._workers -= 1
                        return
                conn, head_end = self._jobs.popleft()
            try:
                self._serve(conn, head_end)
            except Exception:  # a bug in one request must not take a worker with it
                self._close(conn)

    def _serve(self, conn: _Connection, head_end: int) -> None:
        head = bytes(conn.buf[:head_end])
        del conn.buf[:head_end]
        try:
            method, target, keep_alive, framing, raw_headers = self._parse_head(head)
            body = self._read_body(conn, framing)
        except _Refusal as exc:
            self._refuse(conn, exc.status, str(exc))
            return
        except TimeoutError:
            self._refuse(conn, 408, f"request body not received within {self.limits.body_timeout_s:g} s")
            return
        except (_Gone, OSError):
            self._close(conn)
            return
        parts = urlsplit(target)
        headers = {name.decode("latin-1"): ", ".join(v.decode("latin-1") for v in values)
                   for name, values in raw_headers.items() if not name.startswith(b":")}
        result = self.handle(method, parts.path, parse_qs(parts.query), body, headers)
        status, payload, ctype = result[:3]
        extra = result[3] if len(result) > 3 else None
        if isinstance(payload, Stream):
            keep_alive = self._stream(conn, status, payload, extra, keep_alive,
                                      chunked=raw_headers[b":version"] == [b"HTTP/1.1"])
        else:
            try:
                answer = _answer(status, payload, ctype, close=not keep_alive, headers=extra)
            except ValueError as exc:  # a header value the handler should not have set
                answer, keep_alive = _error_answer(500, str(exc)), False
            try:
                self._write(conn, answer)
            except OSError:
                self._close(conn)
                return
        if keep_alive:
            self._hand_back(conn)
        else:
            self._close(conn)

    def _stream(self, conn: _Connection, status: int, stream: "Stream", extra: dict[str, str] | None,
                keep_alive: bool, chunked: bool) -> bool:
        """Send a streamed answer piece by piece; True when the connection can take another request.

        HTTP/1.1 clients get ``Transfer-Encoding: chunked``; an HTTP/1.0 client gets the pieces as
        they come and the connection closed at the end. Each write has ``body_timeout_s`` to leave,
        as any answer's: a client that stops reading is dropped. A stream that fails half way cuts
        the connection, so the client sees a truncated answer and never a well-framed partial one.
        """
        finished = False
        try:
            self._write(conn, _head(status, stream.content_type, close=not (keep_alive and chunked),
                                    headers={**stream.headers, **(extra or {})}, chunked=chunked))
            for piece in stream.pieces:
                if piece:
                    self._write(conn, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                self._write(conn, b"0\r\n\r\n")
            finished = True
        except Exception:  # the client went away, or the source of the pieces failed
            finished = False
        finally:
            close = getattr(stream.pieces, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    pass
        if not (finished and keep_alive and chunked):
            self._close(conn)
            return False
        return True

    def _write(self, conn: _Connection, data: bytes) -> None:
        conn.sock.settimeout(self.limits.body_timeout_s)
        conn.sock.sendall(data)

    def _refuse(self, conn: _Connection, status: int, message: str) -> None:
        try:
            self._write(conn, _error_answer(status, message))
        except OSError:
            self._close(conn)
            return
        conn.closing = True
        conn.buf.clear()
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._hand_back(conn)

    def _parse_head(self, head: bytes) -> tuple[str, str, bool, tuple[str, int, bool], dict[bytes, list[bytes]]]:
        """Method, target, keep-alive, the body's framing ``(kind, length, expect_continue)``, and the
        headers (lower-case names; the request line's version as ``b":version"``)."""
        limits = self.limits
        lines = head.split(b"\n")
        lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        while lines and not lines[-1]:
            lines.pop()
        request_line, header_lines = lines[0], lines[1:]
        if len(request_line) > limits.max_request_line_bytes:
            raise _Refusal(414, f"request line longer than {limits.max_request_line_bytes} bytes")
        if len(head) > limits.max_header_bytes:
            raise _Refusal(431, f"request line and headers longer than {limits.max_header_bytes} bytes")
        if len(header_lines) > limits.max_headers:
            raise _Refusal(431, f"more than {limits.max_headers} header lines")
        words = request_line.split(b" ")
        if len(words) != 3 or not all(words) or b"\r" in request_line or b"\0" in request_line:
            raise _Refusal(400, f"malformed request line {request_line[:80]!r}: expected METHOD TARGET HTTP/1.1")
        method_b, target_b, version_b = words
        if version_b not in (b"HTTP/1.1", b"HTTP/1.0"):
            if re.fullmatch(rb"HTTP/[0-9]\.[0-9]", version_b):
                raise _Refusal(505, f"HTTP version {version_b.decode()} not supported: use HTTP/1.1")
            raise _Refusal(400, f"malformed request line {request_line[:80]!r}: expected METHOD TARGET HTTP/1.1")
        if not _TOKEN.fullmatch(method_b):
            raise _Refusal(400, f"malformed method {method_b[:40]!r}")
        method, target = method_b.decode("ascii"), target_b.decode("latin-1")
        if method not in _METHODS:
            raise _Refusal(501, f"method {method} not supported (one of {', '.join(_METHODS)})")
        headers: dict[bytes, list[bytes]] = {}
        for line in header_lines:
            if line[:1] in (b" ", b"\t"):
                raise _Refusal(400, "folded header lines (starting with a space or tab) are not accepted")
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise _Refusal(400, f"malformed header line {line[:80]!r}: expected 'Name: value'")
            value = value.strip(b" \t")
            if b"\r" in value or b"\0" in value:
                raise _Refusal(400, f"header {name.decode('latin-1')!r} holds a control character")
            headers.setdefault(name.lower(), []).append(value)
        headers[b":version"] = [version_b]

        connection = {t.strip().lower() for v in headers.get(b"connection", []) for t in v.split(b",")}
        keep_alive = b"close" not in connection if version_b == b"HTTP/1.1" else b"keep-alive" in connection
        expect_continue = version_b == b"HTTP/1.1" and any(
            v.strip().lower() == b"100-continue" for v in headers.get(b"expect", []))
        codings = [t.strip().lower() for v in headers.get(b"transfer-encoding", []) for t in v.split(b",") if t.strip()]
        codings = [c for c in codings if c != b"identity"]
        lengths = headers.get(b"content-length", [])
        if codings:
            if codings != [b"chunked"]:
                raise _Refusal(400, f"Transfer-Encoding {b', '.join(codings).decode('latin-1')[:80]!r} not supported: "
                                    "send the body with Content-Length, or chunked")
            if lengths:
                raise _Refusal(400, "both Content-Length and Transfer-Encoding given: a body has one framing")
            if version_b != b"HTTP/1.1":
                raise _Refusal(400, "Transfer-Encoding: chunked needs HTTP/1.1")
            return method, target, keep_alive, ("chunked", 0, expect_continue), headers
        if len(lengths) > 1 or (lengths and b"," in lengths[0]):
            raise _Refusal(400, "more than one Content-Length given: a body has one length")
        if lengths:
            claimed = lengths[0]
            if not _DIGITS.fullmatch(claimed):
                raise _Refusal(400, f"Content-Length is not an integer: {claimed[:40].decode('latin-1')!r}")
            length = int(claimed)
            if length > self.max_body_bytes:
                # Refused before reading: a body is never buffered past the limit.
                raise _Refusal(413, f"Content-Length {length} outside 0..{self.max_body_bytes}")
            return method, target, keep_alive, ("length", length, expect_continue), headers
        if method in ("POST", "PUT"):
            raise _Refusal(411, f"{method} needs a Content-Length header (or Transfer-Encoding: chunked)")
        return method, target, keep_alive, ("length", 0, False), headers

    def _read_body(self, conn: _Connection, framing: tuple[str, int, bool]) -> bytes:
        kind, length, expect_continue = framing
        if expect_continue and (kind == "chunked" or len(conn.buf) < length):
            self._write(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        deadline = time.monotonic() + self.limits.body_timeout_s
        if kind == "length":
            return conn.read_exact(length, deadline) if length else b""
        chunks: list[bytes] = []
        total = 0
        while True:
            line = conn.read_line(4096, deadline, "chunk size line")
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_text):
                raise _Refusal(400, f"malformed chunk size {line[:40]!r}: expected hexadecimal digits")
            size = int(size_text, 16)
            total += size
            if total > self.max_body_bytes:
                raise _Refusal(413, f"chunked body longer than {self.max_body_bytes} bytes")
            if size == 0:
                break
            chunks.append(conn.read_exact(size, deadline))
            if conn.read_exact(2, deadline) != b"\r\n":
                raise _Refusal(400, "chunk data not followed by CRLF")
        for _ in range(self.limits.max_headers + 1):  # trailer fields, up to the blank line
            if not conn.read_line(self.limits.max_header_bytes, deadline, "trailer line"):
                return b"".join(chunks)
        raise _Refusal(431, f"more than {self.limits.max_headers} trailer lines")

    # -- stopping ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the selector loop (and wait for it, when it runs)."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket: new connects are refused from now on."""
        self._closed = True
        self._close_sock(self.listener)
        if not self._running.is_set():
            for sock in (self._wake_r, self._wake_w):
                self._close_sock(sock)
            try:
                self.selector.close()
            except OSError:
                pass

    def close_connections(self) -> None:
        """Cut every open connection, waiting or in the middle of a call."""
        with self._lock:
            conns = list(self.connections)
            self.connections.clear()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._close_sock(conn.sock)


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


class JsonServer:
    """An HTTP/1.1 server dispatching ``(method, path prefix)`` to handlers, each call on a worker thread."""

    def __init__(self, routes: dict[tuple[str, str], Route], host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES, limits: HttpLimits | None = None):
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.limits = limits or HttpLimits()
        self.httpd = _Server((host, port), self.dispatch, self.limits, max_body_bytes)
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None

    def open_connections(self) -> int:
        """How many client connections are open now (waiting for a request or being served)."""
        with self.httpd._lock:
            return len(self.httpd.connections)

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
            return 400, json.dumps({"error": str(exc)}).encode(), "application/json"
        except HttpError as exc:
            return exc.status, json.dumps({"error": str(exc)}).encode(), "application/json"
        except Exception as exc:  # an engine failure: 500 with the reason, the server keeps serving
            return 500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), "application/json"
        if isinstance(result, Stream):
            return 200, result, result.content_type, {}
        if isinstance(result, Reply):
            return 200, json.dumps(result.body).encode(), "application/json", dict(result.headers)
        if isinstance(result, Text):
            return 200, result.text.encode(), result.content_type, {}
        return 200, json.dumps(result).encode(), "application/json", {}

    def start(self) -> "JsonServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"http-{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_until_stopped(self) -> None:
        if self._thread is None:
            self.httpd.serve_forever()
        else:
            self._thread.join()

    def run_in_foreground(self, banner: str) -> int:
        """Print ``banner``, serve until interrupted, then shut down: the body of a server's ``__main__``."""
        print(banner, flush=True)
        try:
            self.serve_until_stopped()
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Stop listening and cut every open connection (calls in flight see a reset, as from a crash)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)


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


def session_routes(capture: CaptureStore) -> dict[tuple[str, str], Route]:
    """``GET /sessions`` (with the trainer credential only) and ``GET|DELETE /sessions/{id}`` (with
    the session's key or the trainer credential); any other caller gets 403."""

    def listing(req: Request) -> Any:
        if not capture.is_trainer(req.headers):
            raise HttpError(403, "listing sessions needs the trainer credential (Authorization: Bearer)")
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
        name, path = parse_adapter_load(req.json())
        self.engine.load_lora_adapter(name, path)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _unload(self, req: Request) -> Any:
        name = parse_adapter_name(req.json())
        self.engine.unload_lora_adapter(name)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _shard(self, req: Request) -> Any:
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
