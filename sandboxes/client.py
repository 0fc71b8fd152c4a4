"""The harness side of ``pxd``: a small client over the daemon's HTTP/1.1 + JSON protocol.

A :class:`PxdClient` holds one connection (a pipe pair to the daemon's stdin/stdout, or a unix
socket) and sends one request at a time on it; it is safe to share between threads (calls are
serialized). Every call that fails in the daemon raises :class:`PxdError` with the daemon's message;
a daemon that died or stopped answering raises :class:`PxdConnectionError`.
"""

from __future__ import annotations

import base64
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

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def to_json(self) -> dict:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "truncated": self.truncated, "timed_out": self.timed_out, "duration_s": self.duration_s}

    @classmethod
    def from_answer(cls, a: dict) -> "ExecResult":
        return cls(exit_code=a["exit_code"], stdout=a["stdout"], stderr=a["stderr"], truncated=a["truncated"],
                   timed_out=a["timed_out"], duration_s=a["duration_s"],
                   stdout_bytes=a.get("stdout_bytes", 0), stderr_bytes=a.get("stderr_bytes", 0))


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

    def readline(self, deadline: float) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line = bytes(self.buf[: i + 1])
                del self.buf[: i + 1]
                return line
            self._fill(deadline)

    def read(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


class PxdClient:
    """One connection to a pxd daemon. Build it with :meth:`over_fds` or :meth:`over_unix_socket`."""

    def __init__(self, read_fd: int, write_fd: int, *, name: str = "pxd", owned: tuple = ()):
        self._rstream = _FdStream(read_fd)
        self._write_fd = write_fd
        self._lock = threading.Lock()
        self._owned = owned
        self._closed = False
        self.name = name
        # set by the owner (a Sandbox) to explain a lost daemon: wall time, memory limit...
        self.explain_loss = lambda: ""

    @classmethod
    def over_fds(cls, read_fd: int, write_fd: int, name: str = "pxd") -> "PxdClient":
        return cls(read_fd, write_fd, name=name)

    @classmethod
    def over_unix_socket(cls, path: str, timeout_s: float = 10.0) -> "PxdClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.settimeout(None)
        return cls(sock.fileno(), sock.fileno(), name=f"pxd@{path}", owned=(sock,))

    def wait_ready(self, timeout_s: float) -> None:
        """Read the daemon's ``PXD-READY`` line (first line on a stdio connection)."""
        try:
            line = self._rstream.readline(time.monotonic() + timeout_s)
        except TimeoutError:
            raise PxdConnectionError(f"{self.name}: not ready after {timeout_s:g} s") from None
        except EOFError:
            raise PxdConnectionError(f"{self.name}: the daemon exited before it was ready") from None
        if not line.startswith(b"PXD-READY"):
            raise PxdConnectionError(f"{self.name}: unexpected first line {line[:200]!r}")

    def close(self) -> None:
        self._closed = True
        for obj in self._owned:
            obj.close()

    # -- the wire --------------------------------------------------------------------------------

    def request(self, method: str, route: str, body: dict | None = None, *, wait_s: float = ANSWER_MARGIN_S) -> dict:
        """Send one request and return the JSON answer; raise :class:`PxdError` on a 4xx/5xx."""
        payload = json.dumps(body or {}, separators=(",", ":")).encode()
        msg = (f"{method} {route} HTTP/1.1\r\nHost: pxd\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        with self._lock:
            if self._closed:
                why = self.explain_loss()
                raise PxdConnectionError(f"{self.name}: the connection is closed" + (f": {why}" if why else ""))
            deadline = time.monotonic() + wait_s
            try:
                view = memoryview(msg)
                while view:
                    n = os.write(self._write_fd, view)
                    view = view[n:]
                status_line = self._rstream.readline(deadline)
                length = 0
                while True:
                    line = self._rstream.readline(deadline)
                    if line in (b"\r\n", b"\n"):
                        break
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                data = self._rstream.read(length, deadline) if length else b""
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
                self._closed = True
                why = self.explain_loss()
                raise PxdConnectionError(f"{self.name}: the daemon is gone ({type(exc).__name__}) during {route}"
                                         + (f": {why}" if why else "")) from None
            except TimeoutError:
                self._closed = True  # the stream is out of step now
                raise PxdConnectionError(f"{self.name}: no answer to {route} within {wait_s:g} s") from None
        try:
            status = int(status_line.split()[1])
            answer = json.loads(data) if data else {}
        except (IndexError, ValueError):
            raise PxdConnectionError(f"{self.name}: malformed answer {status_line[:100]!r}") from None
        if status != 200:
            raise PxdError(status, answer.get("error", "unknown error"), route)
        return answer

    # -- the API ---------------------------------------------------------------------------------

    def health(self) -> dict:
        return self.request("GET", "/health")

    def exec(self, argv: list[str] | None = None, *, shell: str | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, timeout_s: float = 60.0,
             head_bytes: int = 32768, tail_bytes: int = 32768, merge_stderr: bool = False) -> ExecResult:
        """Run ``argv`` (a list) or ``shell`` (a ``/bin/sh -c`` string) in the workspace or ``cwd``."""
        body = {"argv": argv, "shell": shell, "cwd": cwd, "env": env, "stdin": stdin, "timeout_s": timeout_s,
                "head_bytes": head_bytes, "tail_bytes": tail_bytes, "merge_stderr": merge_stderr}
        answer = self.request("POST", "/exec", {k: v for k, v in body.items() if v is not None},
                              wait_s=timeout_s + ANSWER_MARGIN_S)
        return ExecResult.from_answer(answer)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The file's bytes (``max_bytes`` caps them; see :meth:`read_file_info` for the flag)."""
        a = self.read_file_info(path, max_bytes=max_bytes)
        return a["content"].encode() if a["encoding"] == "utf-8" else base64.b64decode(a["content"])

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
        return self.request("POST", "/file/write", body)["size"]

    def git_status(self, cwd: str | None = None) -> GitStatus:
        a = self.request("POST", "/git/status", {"cwd": cwd} if cwd else {})
        return GitStatus(clean=a["clean"], files=[GitFile(**f) for f in a["files"]])

    def git_diff(self, *, staged: bool = False, base: str | None = None, cwd: str | None = None) -> str:
        body = {"staged": staged, "base": base, "cwd": cwd}
        return self.request("POST", "/git/diff", {k: v for k, v in body.items() if v is not None})["diff"]

    def git_commit(self, message: str, *, add_all: bool = True, cwd: str | None = None) -> CommitResult:
        body = {"message": message, "add_all": add_all}
        if cwd:
            body["cwd"] = cwd
        a = self.request("POST", "/git/commit", body)
        return CommitResult(committed=a["committed"], commit=a.get("commit"), reason=a.get("reason", ""))

    def open_session(self, *, cwd: str | None = None, env: dict[str, str] | None = None) -> "ShellSession":
        body = {k: v for k, v in {"cwd": cwd, "env": env}.items() if v is not None}
        return ShellSession(self, self.request("POST", "/session/open", body)["session_id"])


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
        return ExecResult.from_answer(a)

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
