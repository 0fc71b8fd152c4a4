"""The harness side of ``pxd``: a small client over the daemon's HTTP/1.1 + JSON protocol.

A :class:`PxdClient` holds one connection (a pipe pair to the daemon's stdin/stdout, or a unix
socket) and sends one request at a time on it; it is safe to share between threads (calls are
serialized). Every call that fails in the daemon raises :class:`PxdError` with the daemon's message;
a daemon that died or stopped answering raises :class:`PxdConnectionError`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from sandboxes.errors import SandboxError

# margin on top of a request's own timeout before the client gives up on the daemon
ANSWER_MARGIN_S = 30.0
# what an answer may be: pxd's own cap on an answer body (``pxd.MAX_ANSWER_BYTES``) plus a margin,
# and at most this many header lines of at most this many bytes each (pxd sends three)
MAX_ANSWER_BODY_BYTES = 256 * 1024 * 1024 + 64 * 1024
MAX_HEADER_LINES = 100
MAX_LINE_BYTES = 8 * 1024
MAC_HEADER = "x-pxd-mac"


class _Malformed(Exception):
    """The answer stream broke the protocol; the message says how."""


class PxdError(RuntimeError):
    """The daemon refused a request (bad field, path outside the workspace, ...)."""

    def __init__(self, status: int, message: str, route: str):
        super().__init__(f"pxd {route}: {message} (HTTP {status})")
        self.status = status
        self.message = message
        self.route = route


class PxdConnectionError(SandboxError):
    """The daemon is gone (the sandbox died, was closed, or stopped answering)."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``output`` is stdout followed by stderr (one stream when merged)."""

    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    duration_s: float
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    results: bytes | None = None  # what the command wrote to its results_fd (None: no results_fd asked)
    results_truncated: bool = False
    others_killed: int | None = None  # with kill_others: how many other processes were killed

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def to_json(self) -> dict:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "truncated": self.truncated, "timed_out": self.timed_out, "duration_s": self.duration_s}

    @classmethod
    def from_answer(cls, a: dict) -> "ExecResult":
        """Build from pxd's answer; a field of the wrong type raises ``_Malformed`` naming it."""
        def get(name, kind, default=...):
            if name not in a and default is not ...:
                return default
            value = a.get(name)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise _Malformed(f"field {name!r} must be {getattr(kind, '__name__', kind)}, got {value!r:.80}")
            return value

        results = None
        if "results_b64" in a:
            try:
                results = base64.b64decode(get("results_b64", str), validate=True)
            except ValueError:
                raise _Malformed("field 'results_b64' is not base64") from None
        return cls(exit_code=get("exit_code", int), stdout=get("stdout", str), stderr=get("stderr", str),
                   truncated=get("truncated", bool), timed_out=get("timed_out", bool),
                   duration_s=float(get("duration_s", (int, float))),
                   stdout_bytes=get("stdout_bytes", int, 0), stderr_bytes=get("stderr_bytes", int, 0),
                   results=results, results_truncated=get("results_truncated", bool, False),
                   others_killed=get("others_killed", int, None))


@dataclass(frozen=True)
class GitFile:
    path: str
    index: str
    worktree: str


@dataclass(frozen=True)
class GitStatus:
    clean: bool
    files: list = field(default_factory=list)


@dataclass(frozen=True)
class CommitResult:
    committed: bool
    commit: str | None
    reason: str = ""


class _FdStream:
    """Buffered reads from a file descriptor with a deadline (pipes and sockets alike)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        ready, _, _ = select.select([self.fd], [], [], remaining)
        if not ready:
            raise TimeoutError
        data = os.read(self.fd, 1 << 20)
        if not data:
            raise EOFError
        self.buf += data

    def readline(self, deadline: float, limit: int = MAX_LINE_BYTES) -> bytes:
        """One line, newline included; a line longer than ``limit`` raises ``_Malformed``."""
        while True:
            i = self.buf.find(b"\n", 0, limit)
            if i >= 0:
                line = bytes(self.buf[: i + 1])
                del self.buf[: i + 1]
                return line
            if len(self.buf) >= limit:
                raise _Malformed(f"a line longer than {limit} bytes: {bytes(self.buf[:80])!r}...")
            self._fill(deadline)

    def read(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


class PxdClient:
    """One connection to a pxd daemon. Build it with :meth:`over_fds` or :meth:`over_unix_socket`.

    The connection starts with a random key sent to the daemon (``PXD-KEY <hex>``, before any
    request); every answer must carry ``X-Pxd-Mac``, the HMAC-SHA256 under that key of its sequence
    number on this connection, its status line and its body. An answer that is malformed, too big,
    or fails that check raises :class:`PxdConnectionError` and closes the client: after one bad
    answer nothing more on the stream is trusted."""

    def __init__(self, read_fd: int, write_fd: int, *, name: str = "pxd", owned: tuple = (), key: bytes):
        self._rstream = _FdStream(read_fd)
        self._write_fd = write_fd
        self._lock = threading.Lock()
        self._owned = owned
        self._closed = False
        self._key = key
        self._seq = 0
        self.name = name
        # set by the owner (a Sandbox) to explain a lost daemon: wall time, memory limit...
        self.explain_loss = lambda: ""

    @classmethod
    def over_fds(cls, read_fd: int, write_fd: int, name: str = "pxd") -> "PxdClient":
        """A client on a daemon's stdout (``read_fd``) and stdin (``write_fd``); sends the key now."""
        client = cls(read_fd, write_fd, name=name, key=os.urandom(32))
        client._send_key()
        return client

    @classmethod
    def over_unix_socket(cls, path: str, timeout_s: float = 10.0) -> "PxdClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.settimeout(None)
        client = cls(sock.fileno(), sock.fileno(), name=f"pxd@{path}", owned=(sock,), key=os.urandom(32))
        client._send_key()
        return client

    def _send_key(self) -> None:
        try:
            self._write_all(b"PXD-KEY " + self._key.hex().encode() + b"\n")
        except OSError as exc:
            self.close()
            raise PxdConnectionError(f"{self.name}: cannot hand the daemon its key ({type(exc).__name__})") from None

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._write_fd, view)
            view = view[n:]

    def wait_ready(self, timeout_s: float) -> None:
        """Read the daemon's ``PXD-READY`` line (first line on a stdio connection)."""
        try:
            line = self._rstream.readline(time.monotonic() + timeout_s)
        except TimeoutError:
            raise PxdConnectionError(f"{self.name}: not ready after {timeout_s:g} s") from None
        except (EOFError, OSError):
            raise PxdConnectionError(f"{self.name}: the daemon exited before it was ready") from None
        except _Malformed as exc:
            self.close()
            raise PxdConnectionError(f"{self.name}: unexpected first line: {exc}") from None
        if not line.startswith(b"PXD-READY"):
            self.close()
            raise PxdConnectionError(f"{self.name}: unexpected first line {line[:200]!r}")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for obj in self._owned:
            obj.close()

    # -- the wire --------------------------------------------------------------------------------

    def request(self, method: str, route: str, body: dict | None = None, *, wait_s: float = ANSWER_MARGIN_S) -> dict:
        """Send one request and return the JSON answer; raise :class:`PxdError` on a 4xx/5xx and
        :class:`PxdConnectionError` (closing the client) when the daemon is gone or the answer is
        not a well-formed, authenticated one."""
        payload = json.dumps(body or {}, separators=(",", ":")).encode()
        msg = (f"{method} {route} HTTP/1.1\r\nHost: pxd\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        with self._lock:
            if self._closed:
                why = self.explain_loss()
                raise PxdConnectionError(f"{self.name}: the connection is closed" + (f": {why}" if why else ""))
            deadline = time.monotonic() + wait_s
            try:
                self._write_all(msg)
                status, answer = self._read_answer(deadline)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
                self._closed = True
                why = self.explain_loss()
                raise PxdConnectionError(f"{self.name}: the daemon is gone ({type(exc).__name__}) during {route}"
                                         + (f": {why}" if why else "")) from None
            except TimeoutError:
                self._closed = True  # the stream is out of step now
                raise PxdConnectionError(f"{self.name}: no answer to {route} within {wait_s:g} s") from None
            except _Malformed as exc:
                self.close()
                raise PxdConnectionError(f"{self.name}: malformed answer to {route}: {exc}; "
                                         "the connection is closed") from None
            self._seq += 1
        if status != 200:
            error = answer.get("error")
            raise PxdError(status, error if isinstance(error, str) else f"unknown error {answer!r:.200}", route)
        return answer

    def _read_answer(self, deadline: float) -> tuple:
        """(status, JSON object) of the next answer; any breach of the protocol raises ``_Malformed``."""
        status_line = self._rstream.readline(deadline)
        parts = status_line.rstrip(b"\r\n").split(b" ", 2)
        if len(parts) < 2 or parts[0] != b"HTTP/1.1" or not (parts[1].isdigit() and len(parts[1]) == 3):
            raise _Malformed(f"bad status line {status_line[:100]!r}")
        status = int(parts[1])
        headers = {}
        for _ in range(MAX_HEADER_LINES + 1):
            line = self._rstream.readline(deadline)
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise _Malformed(f"bad header line {line[:100]!r}")
            name = name.strip().lower()
            if name in headers and name in ("content-length", MAC_HEADER):
                raise _Malformed(f"header {name!r} given twice")
            headers[name] = value.strip()
        else:
            raise _Malformed(f"more than {MAX_HEADER_LINES} header lines")
        text = headers.get("content-length", "0")
        if not (text.isascii() and text.isdigit()) or len(text) > 12:
            raise _Malformed(f"Content-Length is not a non-negative integer: {text[:40]!r}")
        length = int(text)
        if length > MAX_ANSWER_BODY_BYTES:
            raise _Malformed(f"Content-Length {length} is over the cap of {MAX_ANSWER_BODY_BYTES} bytes")
        data = self._rstream.read(length, deadline) if length else b""
        mac = headers.get(MAC_HEADER)
        if mac is None:
            raise _Malformed(f"no X-Pxd-Mac header (answer {self._seq})")
        signed = b"%d\n%s\n" % (self._seq, status_line.rstrip(b"\r\n")) + data
        want = hmac.new(self._key, signed, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want.encode(), mac.lower().encode("latin-1")):
            raise _Malformed(f"bad X-Pxd-Mac (answer {self._seq}): forged, replayed or out of order")
        try:
            answer = json.loads(data) if data else {}
        except ValueError as exc:
            raise _Malformed(f"body is not JSON ({exc})") from None
        if not isinstance(answer, dict):
            raise _Malformed(f"body is a JSON {type(answer).__name__}, not an object")
        return status, answer

    def parse(self, route: str, answer: dict, build):
        """``build(answer)``; an answer without the fields it needs closes the client and raises
        :class:`PxdConnectionError` naming the route (pxd always sends them)."""
        try:
            return build(answer)
        except (KeyError, TypeError, ValueError, AttributeError, _Malformed) as exc:
            self.close()
            raise PxdConnectionError(f"{self.name}: malformed answer to {route}: "
                                     f"{type(exc).__name__}: {exc}; the connection is closed") from None

    # -- the API ---------------------------------------------------------------------------------

    def health(self) -> dict:
        return self.request("GET", "/health")

    def exec(self, argv: list[str] | None = None, *, shell: str | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, timeout_s: float = 60.0,
             head_bytes: int = 32768, tail_bytes: int = 32768, merge_stderr: bool = False,
             results_fd: int | None = None, results_cap_bytes: int | None = None,
             kill_others: bool = False) -> ExecResult:
        """Run ``argv`` (a list) or ``shell`` (a ``/bin/sh -c`` string) in the workspace or ``cwd``.

        ``results_fd`` (3..9) gives the command a pipe at that descriptor whose contents (up to
        ``results_cap_bytes``, default 1 MiB) come back as ``results``; ``kill_others`` kills every
        other process of the sandbox after the command ends and before the answer (PID-1 pxd only)."""
        body = {"argv": argv, "shell": shell, "cwd": cwd, "env": env, "stdin": stdin, "timeout_s": timeout_s,
                "head_bytes": head_bytes, "tail_bytes": tail_bytes, "merge_stderr": merge_stderr,
                "results_fd": results_fd, "results_cap_bytes": results_cap_bytes,
                "kill_others": kill_others or None}
        answer = self.request("POST", "/exec", {k: v for k, v in body.items() if v is not None},
                              wait_s=timeout_s + ANSWER_MARGIN_S)
        result = self.parse("/exec", answer, ExecResult.from_answer)
        if results_fd is not None and result.results is None:
            self.parse("/exec", answer, lambda a: a["results_b64"])
        return result

    def run(self, command: str | list[str], *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
            cwd: str | None = None, env: dict[str, str] | None = None, results_fd: int | None = None,
            kill_others: bool = False) -> ExecResult:
        """:meth:`exec` as sandboxes offer it to the harness: a shell string (``/bin/sh -c``) or an argv
        list, stdout and stderr merged into ``stdout``, capped to the first and last
        ``output_cap_bytes / 2``."""
        head = output_cap_bytes // 2
        kwargs = dict(cwd=cwd, env=env, timeout_s=timeout_s, head_bytes=head, tail_bytes=output_cap_bytes - head,
                      merge_stderr=True, results_fd=results_fd, kill_others=kill_others)
        if isinstance(command, str):
            return self.exec(shell=command, **kwargs)
        return self.exec(list(command), **kwargs)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The file's bytes (``max_bytes`` caps them; see :meth:`read_file_info` for the flag)."""
        a = self.read_file_info(path, max_bytes=max_bytes)
        return self.parse("/file/read", a, lambda a: a["content"].encode() if a["encoding"] == "utf-8"
                          else base64.b64decode(a["content"], validate=True))

    def read_file_info(self, path: str, *, max_bytes: int | None = None) -> dict:
        body = {"path": path}
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        return self.request("POST", "/file/read", body)

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, make_dirs: bool = True) -> int:
        """Write atomically (temporary name, then rename); returns the size written."""
        if isinstance(data, str):
            body = {"path": path, "content": data, "encoding": "utf-8"}
        else:
            body = {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"}
        body.update(mode=mode, make_dirs=make_dirs)
        return self.parse("/file/write", self.request("POST", "/file/write", body), lambda a: int(a["size"]))

    def git_status(self, cwd: str | None = None) -> GitStatus:
        a = self.request("POST", "/git/status", {"cwd": cwd} if cwd else {})
        return self.parse("/git/status", a, lambda a: GitStatus(clean=a["clean"], files=[GitFile(**f) for f in a["files"]]))

    def git_diff(self, *, staged: bool = False, base: str | None = None, cwd: str | None = None) -> str:
        body = {"staged": staged, "base": base, "cwd": cwd}
        a = self.request("POST", "/git/diff", {k: v for k, v in body.items() if v is not None})
        return self.parse("/git/diff", a, lambda a: a["diff"])

    def git_commit(self, message: str, *, add_all: bool = True, cwd: str | None = None) -> CommitResult:
        body = {"message": message, "add_all": add_all}
        if cwd:
            body["cwd"] = cwd
        a = self.request("POST", "/git/commit", body)
        return self.parse("/git/commit", a, lambda a: CommitResult(committed=a["committed"], commit=a.get("commit"),
                                                                    reason=a.get("reason", "")))

    def open_session(self, *, cwd: str | None = None, env: dict[str, str] | None = None) -> "ShellSession":
        body = {k: v for k, v in {"cwd": cwd, "env": env}.items() if v is not None}
        a = self.request("POST", "/session/open", body)
        return ShellSession(self, self.parse("/session/open", a, lambda a: str(a["session_id"])))


class ShellSession:
    """A persistent shell in the sandbox; ``cd`` and ``export`` carry over between :meth:`run` calls.

    A command that times out ends the session (its shell is killed); open a new one."""

    def __init__(self, client: PxdClient, session_id: str):
        self.client = client
        self.session_id = session_id

    def run(self, command: str, *, timeout_s: float = 60.0, head_bytes: int = 32768,
            tail_bytes: int = 32768) -> ExecResult:
        a = self.client.request("POST", "/session/exec", {
            "session_id": self.session_id, "command": command, "timeout_s": timeout_s,
            "head_bytes": head_bytes, "tail_bytes": tail_bytes}, wait_s=timeout_s + ANSWER_MARGIN_S)
        return self.client.parse("/session/exec", a, ExecResult.from_answer)

    def close(self) -> None:
        try:
            self.client.request("POST", "/session/close", {"session_id": self.session_id})
        except PxdError as exc:
            if exc.status != 404:
                raise

    def __enter__(self) -> "ShellSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
