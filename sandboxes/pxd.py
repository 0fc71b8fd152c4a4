"""pxd: the command daemon that runs inside every sandbox and answers the harness.

Run it locally (no sandbox, for debugging) on a folder, talking HTTP/1.1 over stdin/stdout, from
the repository's root (or run the one file a sandbox gets: ``posttrain sandbox shipped
sandboxes/pxd.py > /tmp/pxd.py``)::

    python3 -m sandboxes.pxd --workspace /tmp/ws --stdio
    # then type the key line, then requests:
    #   PXD-KEY 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f<LF>
    #   GET /health HTTP/1.1<CR><LF>Content-Length: 0<CR><LF><CR><LF>

or on a unix socket (several clients at once, one thread per connection; each connection starts
with its own ``PXD-KEY`` line)::

    python3 -m sandboxes.pxd --workspace /tmp/ws --socket /tmp/pxd.sock

The runtimes in ``sandboxes/runtimes.py`` start it as the first process of a sandbox with
``--stdio``: gVisor's sockets are not reachable from the host, a pipe is, and a pipe also ties the
daemon's life to the harness (stdin closes, pxd exits, the sandbox ends).

The protocol is HTTP/1.1 with JSON bodies and ``Content-Length`` framing, one request at a time per
connection (keep-alive). The connection's first line, before any request, is the client's
``PXD-KEY <64 hex digits>``: a random 32-byte key (on stdin, never in argv or the environment,
which other processes may read). Every answer then carries ``X-Pxd-Mac``, the hex HMAC-SHA256
under that key of ``b"%d\n%s\n" % (seq, status_line) + body``, where ``seq`` counts the answers on
the connection from 0 and ``status_line`` has no CRLF. The client rejects an answer with a
missing or wrong MAC, so an answer forged, replayed or reordered by anyone without the key is
never taken for pxd's. No answer body exceeds ``MAX_ANSWER_BYTES`` (a larger one becomes a 500).

Routes (all bodies JSON objects; errors are ``4xx`` with ``{"error": ...}``):

- ``GET /health``: pid, uptime, workspace, protocol version.
- ``POST /exec``: run ``argv`` (list) or ``shell`` (string, ``/bin/sh -c``) with ``cwd`` (inside the
  workspace), ``env``, ``stdin``, ``timeout_s``, ``head_bytes``/``tail_bytes`` (output caps per
  stream), ``merge_stderr``. Answers ``exit_code`` (128+N when killed by signal N), ``stdout``,
  ``stderr``, ``truncated``, ``timed_out``, ``stdout_bytes``/``stderr_bytes`` (totals produced),
  ``duration_s``. The command's whole process group is killed when it ends or times out.
  ``results_fd`` (3..9): the command also gets the write end of a fresh pipe at that descriptor,
  read while it runs up to ``results_cap_bytes`` (default 1 MiB, at most 16 MiB); the answer adds
  ``results_b64`` and ``results_truncated``. ``kill_others``: once the command ends (exit or
  timeout) every other process of the sandbox is SIGKILLed, then the pipes are drained and the
  answer adds ``others_killed`` (how many were alive); refused (400) unless pxd is PID 1, where
  ``kill(-1)`` reaches only the sandbox.
- ``POST /session/open``, ``/session/exec``, ``/session/close``: a persistent ``bash`` whose working
  folder and exported variables carry over between commands.
- ``POST /file/read``, ``/file/write``: paths relative to the workspace (absolute paths only when
  inside it); ``..`` components and symlinks are refused, size limits apply.
- ``POST /git/status``, ``/git/diff``, ``/git/commit``.

Who can reach the channel: only pxd holds the protocol pipes inside the sandbox (it closes what it
inherited; every descriptor it opens is close-on-exec; no parent or helper process stays inside).
pxd makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so a command of the same uid can
neither ptrace it, nor ``pidfd_getfd`` its descriptors, nor open its ``/proc/<pid>/fd``, ``mem`` or
``environ``. It is PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``; gVisor starts it so)
and installs no handler for a terminating signal there, so Linux drops every signal sent to it
from inside, SIGKILL included; the host ends it by closing stdin, by cgroup or with ``runsc kill``.
gVisor delivers such signals to its PID 1 anyway, so there pxd runs as gVisor's root with a few
capabilities and starts every command as the sandbox user (``--command-uid``), which may not signal
it. As PID 1 pxd reaps orphans when a child ends (SIGCHLD): it waits only for zombie children it
did not start (found in /proc), never stealing the exit status of its own commands.

This file uses only the standard library: it runs under whatever ``python3`` the sandbox has, as
one file. Its one import from the project, :mod:`sandboxes.standalone` (the stand-ins it shares
with the grader's probe), is written into the shipped copy in place of the import's block
(:func:`sandboxes.programs.shipped_source`), so the sandbox's copy imports nothing of the project's
tree; run from the repository as a file, it takes ``standalone.py`` from beside it. Two sandboxes start per episode, so its start-up is kept short: its imports are the
interpreter's built-in modules (``posix`` for the system calls, ``_thread``, ``_signal``, ``select``,
``_json`` for the JSON codec, ``_ctypes`` for ``prctl``), not ``os`` (whose collection ABCs cost about
1 ms of CPU a start: the few ``os.path`` functions pxd needs are standalone's ``realpath``,
``normpath`` and ``exec_candidates``), ``subprocess``, ``threading``, ``selectors``, ``signal``, ``json`` or ``ctypes``,
which pull in ``enum``, ``re``, ``locale``, ``struct`` and ``collections`` (about 10 ms of CPU a start on the host, more
under gVisor: docs/benchmarks.md, "pxd on built-in modules"). A command starts with
``posix_spawn``, or ``fork`` and ``execve`` where it runs in another folder or as another user
(:class:`_Child`). It loads ``re`` (through ``base64``) only to decode a base64 file
write, ``socket`` only for ``--socket``, ``json`` only where ``_json`` is missing or to word a
malformed body's error, and never OpenSSL (through ``hashlib``).
"""

from __future__ import annotations

import _io
import _thread
import binascii
import errno
import fcntl
import posix as os  # the C module: the os module imports _collections_abc and posixpath (sandboxes.standalone)
import select
import stat
import sys
import time

# >>> standalone: where pxd is shipped, sandboxes/standalone.py's text stands here (sandboxes.programs)
try:
    from sandboxes.standalone import exec_candidates, json_codec, make_not_dumpable, normpath, realpath
except ModuleNotFoundError:  # run as a file from the repository (bench/load_pxd.py): standalone.py is beside it
    sys.path.insert(0, __file__.rpartition("/")[0] or ".")
    from standalone import exec_candidates, json_codec, make_not_dumpable, normpath, realpath
    del sys.path[0]
# <<< standalone

NULL_DEVICE = "/dev/null"  # os.devnull


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def _isdir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _environ() -> dict:
    """``dict(os.environ)``: the environment decoded as ``os`` decodes it."""
    encoding = sys.getfilesystemencoding()
    return {k.decode(encoding, "surrogateescape"): v.decode(encoding, "surrogateescape")
            for k, v in os.environ.items()}


try:
    import _signal as signal  # the C module: the signal module wraps its numbers in enums (enum, re)
except ImportError:  # pragma: no cover - an interpreter without it
    import signal

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_CAP_BYTES = 32 * 1024
MAX_CAP_BYTES = 16 * 1024 * 1024
DEFAULT_RESULTS_CAP_BYTES = 1024 * 1024
MAX_RESULTS_CAP_BYTES = 16 * 1024 * 1024
# no answer body is larger (a bigger one becomes a 500); the client refuses anything above this plus
# a margin, so a forged Content-Length cannot make the host buffer more
MAX_ANSWER_BYTES = 256 * 1024 * 1024
KEY_PREFIX = b"PXD-KEY "
MAC_HEADER = "X-Pxd-Mac"
DRAIN_AFTER_EXIT_S = 0.5  # how long output pipes may stay open after the command's group is killed
DRAIN_AFTER_KILL_S = 5.0  # the same after kill_others, when every writer is dead
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           409: "Conflict", 413: "Payload Too Large", 500: "Internal Server Error"}


json_loads, json_dumps = json_codec(",", ":")


class RequestError(Exception):
    """A request pxd refuses; the message names the field and what was expected."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 framing over any byte stream (a pipe pair or a socket)


def read_message(rfile):
    """Read one HTTP/1.1 message: returns (start_line, headers, body) or None at end of stream."""
    line = rfile.readline(65536)
    while line in (b"\r\n", b"\n"):
        line = rfile.readline(65536)
    if not line:
        return None
    headers = {}
    while True:
        h = rfile.readline(65536)
        if not h:
            raise RequestError("connection closed inside the headers")
        if h in (b"\r\n", b"\n"):
            break
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep:
            raise RequestError(f"malformed header line {h[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise RequestError(f"Content-Length is not an integer: {headers.get('content-length')!r}")
    if length < 0 or length > MAX_REQUEST_BYTES:
        raise RequestError(f"Content-Length {length} outside 0..{MAX_REQUEST_BYTES}", 413)
    body = rfile.read(length) if length else b""
    if len(body) != length:
        raise RequestError("connection closed inside the body")
    return line.decode("latin-1").rstrip("\r\n"), headers, body


def _sha256_builtin():
    """The interpreter's own SHA-256 (``_sha256`` up to Python 3.11, ``_sha2`` after): loading
    OpenSSL for ``hashlib`` costs more than all the daemon's other imports."""
    try:
        from _sha2 import sha256
    except ImportError:
        from _sha256 import sha256
    return sha256


_SHA256 = _sha256_builtin()
_HMAC_BLOCK = 64  # SHA-256's block size in bytes
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


def hmac_sha256(key: bytes, message: bytes) -> str:
    """HMAC-SHA256 (RFC 2104) of ``message`` under ``key``, in hex; equal to
    ``hmac.new(key, message, hashlib.sha256).hexdigest()`` (tests/sandboxes check it)."""
    if len(key) > _HMAC_BLOCK:
        key = _SHA256(key).digest()
    key = key.ljust(_HMAC_BLOCK, b"\0")
    inner = _SHA256(key.translate(_IPAD) + message).digest()
    return _SHA256(key.translate(_OPAD) + inner).hexdigest()


def answer_mac(key: bytes, seq: int, status_line: bytes, body: bytes) -> str:
    """The MAC of one answer: HMAC-SHA256 over the decimal sequence number, a newline, the status line
    (without its CRLF), a newline and the body. The client checks it against its own count."""
    return hmac_sha256(key, b"%d\n%s\n" % (seq, status_line) + body)


def write_response(wfile, status: int, obj, key: bytes | None = None, seq: int = 0) -> None:
    """Write one answer; with ``key``, add its ``X-Pxd-Mac`` (answer number ``seq`` on this connection)."""
    body = json_dumps(obj).encode()
    if len(body) > MAX_ANSWER_BYTES:
        status = 500
        body = json_dumps({"error": f"the answer is {len(body)} bytes, over pxd's cap of {MAX_ANSWER_BYTES}; "
                                    "ask for less (smaller head_bytes/tail_bytes/max_bytes)"}).encode()
    status_line = f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}".encode()
    mac = f"{MAC_HEADER}: {answer_mac(key, seq, status_line, body)}\r\n".encode() if key is not None else b""
    head = (status_line + b"\r\nContent-Type: application/json\r\n" + mac
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    wfile.write(head + body)
    wfile.flush()


def read_key(rfile) -> bytes:
    """The connection's first line, ``PXD-KEY <64 hex digits>``: the key that authenticates answers."""
    line = rfile.readline(256)
    hexkey = line[len(KEY_PREFIX):].strip() if line.startswith(KEY_PREFIX) else b""
    try:
        key = bytes.fromhex(hexkey.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise RequestError("the first line must be 'PXD-KEY <64 hex digits>' (the answer key)")
    return key


# ---------------------------------------------------------------------------------------------
# request fields


def _field(body: dict, name: str, kind, default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise RequestError(f"field {name!r} is required")
        return default
    value = body[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise RequestError(f"field {name!r} must be {want}, got {type(value).__name__}")
    return value


def _bounded(body: dict, name: str, default, low, high, kind=int):
    value = _field(body, name, kind, default)
    if not (low <= value <= high):
        raise RequestError(f"field {name!r} must be between {low} and {high}, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# output capture with a head and a tail


class Capture:
    """Keeps the first ``head`` and the last ``tail`` bytes of a stream and counts the rest."""

    def __init__(self, head: int, tail: int):
        self.head_cap, self.tail_cap = head, tail
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap + 65536:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + min(len(self.tail), self.tail_cap)

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap:]) if self.tail_cap else b""
        if self.truncated:
            omitted = self.total - len(self.head) - len(tail)
            joined = bytes(self.head) + f"\n[... {omitted} bytes omitted ...]\n".encode() + tail
        else:
            joined = bytes(self.head) + tail
        return joined.decode("utf-8", errors="replace")


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# the daemon


class Daemon:
    def __init__(self, workspace: str, *, max_file_bytes: int = 8 * 1024 * 1024, shell: str = "/bin/bash"):
        self.workspace = realpath(workspace)
        if not _isdir(self.workspace):
            raise SystemExit(f"pxd: workspace {workspace!r} is not a folder")
        self.max_file_bytes = max_file_bytes
        self.shell = shell if _exists(shell) else "/bin/sh"
        self.started = time.monotonic()
        self.sessions: dict[str, Session] = {}
        self.lock = _thread.allocate_lock()
        self.base_env = _environ()
        self.base_env.setdefault("HOME", self.workspace)

    # -- routing --------------------------------------------------------------------------------

    def handle(self, start_line: str, body_bytes: bytes):
        try:
            method, target, _version = start_line.split(" ", 2)
        except ValueError:
            return 400, {"error": f"malformed request line {start_line[:80]!r}"}
        route = ROUTES.get(target.split("?", 1)[0])
        if route is None:
            return 404, {"error": f"no route {target!r}; routes: {', '.join(sorted(ROUTES))}"}
        want_method, fn = route
        if method != want_method:
            return 405, {"error": f"{target} takes {want_method}, not {method}"}
        try:
            body = json_loads(body_bytes) if body_bytes else {}
        except ValueError as exc:
            return 400, {"error": f"body is not JSON: {exc}"}
        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        try:
            return 200, fn(self, body)
        except RequestError as exc:
            return exc.status, {"error": str(exc)}
        except Exception as exc:  # a daemon bug must not end the sandbox; report it
            return 500, {"error": f"{type(exc).__name__}: {exc}"}

    # -- paths ------------------------------------------------------------------------------------

    def _relparts(self, path: str, field: str = "path") -> list:
        if not isinstance(path, str) or not path:
            raise RequestError(f"field {field!r} must be a non-empty string")
        if "\x00" in path:
            raise RequestError(f"field {field!r} contains a NUL byte")
        if path.startswith("/"):
            norm = normpath(path)
            inside = self.workspace.rstrip("/") + "/"
            if norm != self.workspace and not norm.startswith(inside):
                raise RequestError(f"{field} {path!r} is outside the workspace {self.workspace}")
            path = norm[len(inside):] if norm != self.workspace else "."
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise RequestError(f"{field} {path!r} has a '..' component; paths stay inside the workspace")
        return parts

    def _open_dir(self, parts: list, field: str, create: bool = False) -> int:
        """Open the folder ``parts`` below the workspace without following any symlink."""
        fd = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, comp in enumerate(parts):
                nfd = self._open_component(fd, comp, "/".join(parts[: i + 1]), field, create)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _open_component(fd: int, comp: str, where: str, field: str, create: bool) -> int:
        """Open folder ``comp`` in ``fd`` without following a symlink, making it first with ``create``.
        A folder another request made between the two steps is opened like any other."""
        try:
            return _open_nofollow(fd, comp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                raise RequestError(f"{field}: folder {where!r} does not exist", 404)
        except _Symlink:
            raise RequestError(f"{field}: {where!r} is a symlink; pxd does not follow symlinks")
        except NotADirectoryError:
            raise RequestError(f"{field}: {where!r} is not a folder")
        try:
            os.mkdir(comp, 0o755, dir_fd=fd)
            _chown_new(comp, fd)
        except FileExistsError:
            pass  # a concurrent request made it first
        return Daemon._open_component(fd, comp, where, field, create=False)

    def resolve_dir(self, path, field: str = "cwd") -> str:
        if path is None:
            return self.workspace
        parts = self._relparts(path, field)
        os.close(self._open_dir(parts, field))
        return "/".join((self.workspace.rstrip("/"), *parts)) if parts else self.workspace

    # -- exec -----------------------------------------------------------------------------------

    def _command(self, body: dict) -> tuple:
        argv = _field(body, "argv", list)
        shell = _field(body, "shell", str)
        if (argv is None) == (shell is None):
            raise RequestError("give exactly one of 'argv' (list of strings) or 'shell' (string)")
        if argv is not None:
            if not argv or not all(isinstance(a, str) for a in argv):
                raise RequestError("field 'argv' must be a non-empty list of strings")
            return argv
        return ["/bin/sh", "-c", shell]

    def _env(self, body: dict) -> dict:
        env = dict(self.base_env)
        extra = _field(body, "env", dict, {})
        for key, value in extra.items():
            if not isinstance(value, str) or not key or "=" in key:
                raise RequestError(f"env entry {key!r} must map a name without '=' to a string")
            env[key] = value
        return env

    def exec(self, body: dict) -> dict:
        argv = self._command(body)
        cwd = self.resolve_dir(_field(body, "cwd", str), "cwd")
        env = self._env(body)
        timeout_s = _bounded(body, "timeout_s", DEFAULT_TIMEOUT_S, 0.001, MAX_TIMEOUT_S, float)
        head = _bounded(body, "head_bytes", DEFAULT_CAP_BYTES, 0, MAX_CAP_BYTES)
        tail = _bounded(body, "tail_bytes", DEFAULT_CAP_BYTES, 0, MAX_CAP_BYTES)
        stdin = _field(body, "stdin", str)
        merge = _field(body, "merge_stderr", bool, False)
        results_fd = _field(body, "results_fd", int)
        if results_fd is not None and not 3 <= results_fd <= 9:
            raise RequestError(f"field 'results_fd' must be between 3 and 9, got {results_fd}")
        results_cap = _bounded(body, "results_cap_bytes", DEFAULT_RESULTS_CAP_BYTES, 0, MAX_RESULTS_CAP_BYTES)
        kill_others = _field(body, "kill_others", bool, False)
        if kill_others and not is_init():
            raise RequestError("kill_others needs pxd to be PID 1 of the sandbox's PID namespace; this pxd is "
                               f"pid {os.getpid()} (the unisolated debug runtime?) and would kill host processes")
        return run_command(argv, cwd, env, timeout_s, head, tail, stdin, merge,
                           results_fd=results_fd, results_cap=results_cap, kill_others=kill_others)

    # -- sessions -------------------------------------------------------------------------------

    def session_open(self, body: dict) -> dict:
        cwd = self.resolve_dir(_field(body, "cwd", str), "cwd")
        session = Session(self.shell, cwd, self._env(body))
        with self.lock:
            self.sessions[session.id] = session
        return {"session_id": session.id}

    def _session(self, body: dict) -> "Session":
        sid = _field(body, "session_id", str, required=True)
        with self.lock:
            session = self.sessions.get(sid)
        if session is None:
            raise RequestError(f"no session {sid!r} (closed, timed out, or never opened)", 404)
        return session

    def session_exec(self, body: dict) -> dict:
        session = self._session(body)
        command = _field(body, "command", str, required=True)
        timeout_s = _bounded(body, "timeout_s", DEFAULT_TIMEOUT_S, 0.001, MAX_TIMEOUT_S, float)
        head = _bounded(body, "head_bytes", DEFAULT_CAP_BYTES, 0, MAX_CAP_BYTES)
        tail = _bounded(body, "tail_bytes", DEFAULT_CAP_BYTES, 0, MAX_CAP_BYTES)
        result = session.run(command, timeout_s, head, tail)
        if not session.alive:
            with self.lock:
                self.sessions.pop(session.id, None)
        return result

    def session_close(self, body: dict) -> dict:
        session = self._session(body)
        with self.lock:
            self.sessions.pop(session.id, None)
        session.close()
        return {"closed": True}

    # -- files ----------------------------------------------------------------------------------

    def file_read(self, body: dict) -> dict:
        parts = self._relparts(_field(body, "path", str, required=True))
        if not parts:
            raise RequestError("path names the workspace folder itself, not a file")
        max_bytes = _bounded(body, "max_bytes", self.max_file_bytes, 0, self.max_file_bytes)
        dfd = self._open_dir(parts[:-1], "path")
        try:
            try:
                fd = _open_nofollow(dfd, parts[-1], os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                raise RequestError(f"path {'/'.join(parts)!r} does not exist", 404)
            except _Symlink:
                raise RequestError(f"path {'/'.join(parts)!r} is a symlink; pxd does not follow symlinks")
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RequestError(f"path {'/'.join(parts)!r} is not a regular file")
        with _io.open(fd, "rb") as f:
            data = f.read(max_bytes + 1)
        truncated = len(data) > max_bytes
        data = data[:max_bytes]
        out = {"path": "/".join(parts), "size": st.st_size, "truncated": truncated}
        try:
            out["content"] = data.decode("utf-8")
            out["encoding"] = "utf-8"
        except UnicodeDecodeError:
            out["content"] = binascii.b2a_base64(data, newline=False).decode()
            out["encoding"] = "base64"
        return out

    def file_write(self, body: dict) -> dict:
        parts = self._relparts(_field(body, "path", str, required=True))
        if not parts:
            raise RequestError("path names the workspace folder itself, not a file")
        encoding = _field(body, "encoding", str, "utf-8")
        content = _field(body, "content", str, required=True)
        if encoding == "utf-8":
            data = content.encode()
        elif encoding == "base64":
            try:
                import base64  # only here: it imports re

                data = base64.b64decode(content, validate=True)
            except ValueError as exc:
                raise RequestError(f"content is not valid base64: {exc}")
        else:
            raise RequestError(f"field 'encoding' must be 'utf-8' or 'base64', got {encoding!r}")
        if len(data) > self.max_file_bytes:
            raise RequestError(f"content is {len(data)} bytes, over the limit of {self.max_file_bytes}", 413)
        mode = _bounded(body, "mode", 0o644, 0, 0o7777)
        dfd = self._open_dir(parts[:-1], "path", create=_field(body, "make_dirs", bool, True))
        try:
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise RequestError(f"path {'/'.join(parts)!r} is a symlink; pxd does not follow symlinks")
                if not stat.S_ISREG(st.st_mode):
                    raise RequestError(f"path {'/'.join(parts)!r} exists and is not a regular file")
            except FileNotFoundError:
                pass
            tmp = f".pxd-{os.urandom(6).hex()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dfd)
            try:
                with _io.open(fd, "wb") as f:
                    f.write(data)
                    if COMMAND_IDS is not None:
                        os.fchown(f.fileno(), *COMMAND_IDS)
                    os.fchmod(f.fileno(), mode)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
            os.rename(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
        return {"path": "/".join(parts), "size": len(data)}

    # -- git ------------------------------------------------------------------------------------

    def _git(self, args: list, cwd: str, head: int = MAX_CAP_BYTES, timeout_s: float = 120.0) -> dict:
        env = dict(self.base_env)
        env.update(GIT_ENV)
        argv = ["git", "-c", "safe.directory=*", "-c", "core.pager=cat", *args]
        return run_command(argv, cwd, env, timeout_s, head, 0, None, False)

    def _repo(self, body: dict) -> str:
        return self.resolve_dir(_field(body, "cwd", str), "cwd")

    def git_status(self, body: dict) -> dict:
        r = self._git(["status", "--porcelain=v1", "-z", "--untracked-files=all"], self._repo(body))
        if r["exit_code"] != 0:
            raise RequestError(f"git status failed: {r['stderr'].strip()}", 409)
        files = []
        for entry in r["stdout"].split("\x00"):
            if len(entry) >= 4:
                files.append({"index": entry[0], "worktree": entry[1], "path": entry[3:]})
        return {"clean": not files, "files": files}

    def git_diff(self, body: dict) -> dict:
        cap = _bounded(body, "max_bytes", DEFAULT_CAP_BYTES * 8, 0, MAX_CAP_BYTES)
        args = ["diff", "--no-color", "--no-ext-diff"]
        if _field(body, "staged", bool, False):
            args.append("--cached")
        base = _field(body, "base", str)
        if base is not None:
            if base.startswith("-"):
                raise RequestError(f"field 'base' must name a revision, got {base!r}")
            args.append(base)
        r = self._git(args, self._repo(body), head=cap)
        if r["exit_code"] != 0:
            raise RequestError(f"git diff failed: {r['stderr'].strip()}", 409)
        return {"diff": r["stdout"], "truncated": r["truncated"]}

    def git_commit(self, body: dict) -> dict:
        message = _field(body, "message", str, required=True)
        if not message.strip():
            raise RequestError("field 'message' must not be empty")
        cwd = self._repo(body)
        if _field(body, "add_all", bool, True):
            r = self._git(["add", "-A"], cwd)
            if r["exit_code"] != 0:
                raise RequestError(f"git add failed: {r['stderr'].strip()}", 409)
        staged = self._git(["diff", "--cached", "--quiet"], cwd)
        if staged["exit_code"] == 0:
            head = self._git(["rev-parse", "HEAD"], cwd)
            return {"committed": False, "commit": head["stdout"].strip() or None, "reason": "nothing to commit"}
        r = self._git(["commit", "-q", "--no-verify", "-m", message], cwd)
        if r["exit_code"] != 0:
            raise RequestError(f"git commit failed: {(r['stderr'] or r['stdout']).strip()}", 409)
        head = self._git(["rev-parse", "HEAD"], cwd)
        return {"committed": True, "commit": head["stdout"].strip()}

    def health(self, body: dict) -> dict:
        return {"ok": True, "pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started, 3),
                "workspace": self.workspace, "protocol": PROTOCOL_VERSION, "sessions": len(self.sessions)}

    def close(self) -> None:
        with self.lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for s in sessions:
            s.close()


class _Symlink(Exception):
    pass


def _open_nofollow(dir_fd: int, name: str, flags: int) -> int:
    """Open ``name`` in ``dir_fd`` only if it is not a symlink, and prove the opened file is the one
    inspected (same device and inode): ``O_NOFOLLOW`` alone is not honoured by every kernel (gVisor
    20221219 follows a symlink opened with ``O_DIRECTORY | O_NOFOLLOW``)."""
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(before.st_mode):
        raise _Symlink(name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Symlink(name)
        raise
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise _Symlink(name)  # swapped for a symlink (or another file) between the two looks
    return fd


GIT_ENV = {
    "GIT_AUTHOR_NAME": "posttrain", "GIT_AUTHOR_EMAIL": "posttrain@localhost",
    "GIT_COMMITTER_NAME": "posttrain", "GIT_COMMITTER_EMAIL": "posttrain@localhost",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


def run_command(argv, cwd, env, timeout_s, head, tail, stdin, merge, *, results_fd=None,
                results_cap=DEFAULT_RESULTS_CAP_BYTES, kill_others=False) -> dict:
    """Run one command in its own process group; capture head and tail; kill the group at the end.

    With ``results_fd`` the command also gets the write end of a fresh pipe at that descriptor,
    read up to ``results_cap`` bytes. With ``kill_others`` every other process of the sandbox is
    killed once the command ends, before the pipes are drained and the answer is made."""
    started = time.monotonic()
    results_r = results_w = None
    spawned = False
    if results_fd is not None:
        # the write end lands at results_fd in the child; every descriptor pxd opened is close-on-exec
        # (pxd closed what it inherited at start), so nothing else reaches the command
        results_r, results_w = os.pipe()
    try:
        proc = _Child(argv, cwd=cwd, env=env, stdin=PIPE if stdin is not None else DEVNULL,
                      stderr=STDOUT if merge else PIPE,
                      keep_fd=(results_w, results_fd) if results_fd is not None else None)
        spawned = True
    except FileNotFoundError:
        raise RequestError(f"command not found: {argv[0]!r}")
    except PermissionError:
        raise RequestError(f"command not executable: {argv[0]!r}")
    except OSError as exc:
        raise RequestError(f"cannot start {argv[0]!r}: {exc.strerror}")
    finally:
        if results_w is not None:
            os.close(results_w)
            if not spawned:
                os.close(results_r)
    out, err = Capture(head, tail), Capture(head, tail)
    results = Capture(results_cap, 0)
    reading = {proc.stdout.fileno(): out}  # descriptor -> where its bytes go, until its EOF
    if not merge:
        reading[proc.stderr.fileno()] = err
    if results_r is not None:
        reading[results_r] = results
    poller = select.poll()
    for fd in reading:
        poller.register(fd, select.POLLIN)
    if stdin is not None:
        _thread.start_new_thread(_feed, (proc.stdin, stdin.encode()))
    deadline = started + timeout_s
    timed_out = False
    exited_at = None
    drain_s = DRAIN_AFTER_EXIT_S
    others_killed = None
    try:
        while reading:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                # the command is done: anything it left behind goes with it
                exited_at = now
                _kill_group(proc.pid)
            if exited_at is None and now >= deadline:
                timed_out = True
                _kill_group(proc.pid)
                exited_at = now
            if exited_at is not None and kill_others and others_killed is None:
                others_killed = kill_other_processes()
                exited_at, drain_s = time.monotonic(), DRAIN_AFTER_KILL_S
            if exited_at is not None and now - exited_at > drain_s:
                break  # a writer escaped the process group; stop waiting for its EOF
            wait = 0.05 if exited_at is None else 0.01
            if exited_at is None:
                wait = min(wait, max(0.0, deadline - now))
            for fd, _ in poller.poll(wait * 1000):
                data = os.read(fd, 65536)
                if data:
                    reading[fd].add(data)
                else:
                    poller.unregister(fd)
                    del reading[fd]
        if not timed_out and exited_at is None:
            # every pipe closed; the command may still be running
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except _Timeout:
                timed_out = True
        if kill_others and others_killed is None:
            others_killed = kill_other_processes()
    finally:
        _kill_group(proc.pid)
        returncode = proc.wait()
        if is_init():
            settle_group(proc.pid)
        for f in (proc.stdout, proc.stderr, proc.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        if results_r is not None:
            os.close(results_r)
    answer = {
        "exit_code": _exit_code(returncode), "timed_out": timed_out,
        "stdout": out.text(), "stderr": "" if merge else err.text(),
        "truncated": out.truncated or err.truncated,
        "stdout_bytes": out.total, "stderr_bytes": err.total,
        "duration_s": round(time.monotonic() - started, 6),
    }
    if results_r is not None:
        answer["results_b64"] = binascii.b2a_base64(bytes(results.head), newline=False).decode()
        answer["results_truncated"] = results.total > len(results.head)
    if others_killed is not None:
        answer["others_killed"] = others_killed
    return answer


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass


class Session:
    """A persistent shell: ``cd`` and ``export`` carry over from one command to the next."""

    def __init__(self, shell: str, cwd: str, env: dict):
        self.id = os.urandom(8).hex()
        self.proc = _Child([shell] + (["--noprofile", "--norc"] if shell.endswith("bash") else []),
                           cwd=cwd, env=env, stdin=PIPE, stderr=PIPE)
        self.alive = True
        self.lock = _thread.allocate_lock()

    def run(self, command: str, timeout_s: float, head: int, tail: int) -> dict:
        with self.lock:
            if not self.alive or self.proc.poll() is not None:
                self.alive = False
                raise RequestError(f"session {self.id} has ended", 409)
            marker = f"__pxd_done_{os.urandom(16).hex()}__"
            quoted = "'" + command.replace("'", "'\"'\"'") + "'"
            script = (f"eval {quoted} </dev/null\n__pxd_rc=$?\n"
                      f"printf '%s %d\\n' {marker} $__pxd_rc\nprintf '%s\\n' {marker} >&2\n")
            started = time.monotonic()
            try:
                self.proc.stdin.write(script.encode())
                self.proc.stdin.flush()
            except OSError:
                self.alive = False
                raise RequestError(f"session {self.id} has ended", 409)
            streams = {self.proc.stdout.fileno(): _MarkedStream(marker, head, tail),
                       self.proc.stderr.fileno(): _MarkedStream(marker, head, tail)}
            deadline = started + timeout_s
            timed_out = False
            while not all(s.done for s in streams.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                ready = readable([fd for fd, s in streams.items() if not s.done], remaining)
                for fd in ready:
                    data = os.read(fd, 65536)
                    if not data:
                        streams[fd].done = True
                        self.alive = False
                    else:
                        streams[fd].add(data)
            out, err = streams[self.proc.stdout.fileno()], streams[self.proc.stderr.fileno()]
            if timed_out or not self.alive:
                self.close()
                exit_code = 137 if timed_out else _exit_code(self.proc.wait())
            else:
                exit_code = out.exit_code
            return {"exit_code": exit_code, "timed_out": timed_out, "stdout": out.capture.text(),
                    "stderr": err.capture.text(), "truncated": out.capture.truncated or err.capture.truncated,
                    "stdout_bytes": out.capture.total, "stderr_bytes": err.capture.total,
                    "duration_s": round(time.monotonic() - started, 6), "session_alive": self.alive}

    def close(self) -> None:
        self.alive = False
        _kill_group(self.proc.pid)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


def readable(fds: list, timeout: float) -> list:
    """Those of ``fds`` with bytes to read or at their end, waiting up to ``timeout`` seconds."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout * 1000)]


class _MarkedStream:
    """Output of one session command: everything up to the end marker the shell prints after it."""

    def __init__(self, marker: str, head: int, tail: int):
        self.marker = marker.encode()
        self.capture = Capture(head, tail)
        self.pending = bytearray()  # bytes that might be the start of the marker
        self.done = False
        self.exit_code = None

    def add(self, data: bytes) -> None:
        self.pending += data
        idx = self.pending.find(self.marker)
        if idx >= 0:
            self.capture.add(bytes(self.pending[:idx]))
            rest = bytes(self.pending[idx + len(self.marker):]).split(b"\n", 1)[0].strip()
            if rest.isdigit():
                self.exit_code = int(rest)
            elif b"\n" not in self.pending[idx:]:
                return  # the exit code is still on its way
            self.done = True
            self.pending.clear()
            return
        keep = len(self.marker) + 8
        if len(self.pending) > keep:
            self.capture.add(bytes(self.pending[:-keep]))
            del self.pending[:-keep]


# ---------------------------------------------------------------------------------------------
# pxd's own processes, the orphans it reaps as PID 1, and its protection


COMMAND_IDS = None  # (uid, gid) commands run as when pxd itself runs as another user (gVisor: root)


def set_command_ids(uid: int) -> None:
    """Run every command as ``uid`` (its group the same number), pxd staying the user it is: a
    command then cannot signal pxd at all (gVisor delivers signals to its PID 1 from inside)."""
    global COMMAND_IDS
    if os.getuid() == uid:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"pxd: --command-uid {uid} needs pxd to run as root (it runs as uid {os.getuid()})")
    COMMAND_IDS = (uid, uid)


def _chown_new(name: str, dir_fd: int) -> None:
    """Give what pxd just made to the command user, so the agent's commands may change it."""
    if COMMAND_IDS is not None:
        os.chown(name, *COMMAND_IDS, dir_fd=dir_fd, follow_symlinks=False)


class _Timeout(Exception):
    """A :meth:`_Child.wait` with a timeout that ran out."""


PIPE, DEVNULL, STDOUT = -1, -3, -2  # what a _Child's standard stream is (subprocess's numbers)


class _Child:
    """A process pxd starts and waits for itself; the orphan reaper leaves its exit status alone.

    Started with ``posix_spawn`` when it runs in pxd's own folder as pxd's user (the usual case on
    bwrap), else with ``fork`` and ``execve`` (``subprocess`` costs its imports at every sandbox's start):
    in a session of its own (its own process group, which pxd kills when it is done), in ``cwd``
    with exactly ``env``, as the command user when pxd has one (:func:`set_command_ids`: no
    supplementary groups), stdin a pipe or ``/dev/null``, stdout a pipe, stderr a pipe or the stdout
    pipe. Only descriptors 0-2 and ``keep_fd`` (``(fd, target)``: ``fd`` made descriptor ``target``)
    reach the command: every other descriptor pxd holds is close-on-exec (it closed what it
    inherited at start). Why a start failed (the command missing, not executable, ``cwd`` gone)
    comes back over a close-on-exec pipe and is raised here as the ``OSError`` it was."""

    def __init__(self, argv: list, *, cwd: str, env: dict, stdin: int = DEVNULL, stderr: int = PIPE,
                 keep_fd: tuple | None = None):
        self.returncode = None
        child_ends, own_ends = [], []  # the pipes' ends the command gets, and pxd's
        try:
            if stdin == PIPE:
                in_r, in_w = os.pipe()
                own_ends.append(in_w)
            else:
                in_r, in_w = os.open(NULL_DEVICE, os.O_RDONLY | os.O_CLOEXEC), None
            child_ends.append(in_r)
            out_r, out_w = os.pipe()
            child_ends.append(out_w)
            own_ends.append(out_r)
            err_r, err_w = None, out_w
            if stderr == PIPE:
                err_r, err_w = os.pipe()
                child_ends.append(err_w)
                own_ends.append(err_r)
            env = {str(k): str(v) for k, v in env.items()}
            fail_r = None
            if COMMAND_IDS is None and cwd == os.getcwd():
                # posix_spawn: the C library's vfork-like clone, no copy of pxd's memory to fault on
                # (a fork and Python code in the child cost 1.6 ms more a command on bwrap)
                actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
                           (os.POSIX_SPAWN_DUP2, err_w, 2)]
                if keep_fd is not None:
                    actions.append((os.POSIX_SPAWN_DUP2, *keep_fd))
                with _children_lock:
                    self.pid = _spawn(argv, env, actions)
                    _children[self.pid] = self
            else:  # another folder or another user: posix_spawn can do neither here
                fail_r, fail_w = os.pipe()
                child_ends.append(fail_w)
                own_ends.append(fail_r)
                with _children_lock:
                    self.pid = os.fork()
                    if self.pid == 0:  # the child: only os calls from here to the exec
                        _exec_child(argv, cwd, env, in_r, out_w, err_w, fail_w, keep_fd)
                    _children[self.pid] = self
        except BaseException:
            for fd in child_ends + own_ends:
                os.close(fd)
            raise
        for fd in child_ends:
            os.close(fd)
        failure = b""
        if fail_r is not None:
            while chunk := os.read(fail_r, 4096):  # EOF at the exec (close-on-exec) or the child's exit
                failure += chunk
            os.close(fail_r)
        self.stdin = open(in_w, "wb") if in_w is not None else None
        self.stdout = open(out_r, "rb", buffering=0)
        self.stderr = open(err_r, "rb", buffering=0) if err_r is not None else None
        if failure:
            self.wait()
            for f in (self.stdin, self.stdout, self.stderr):
                if f is not None:
                    f.close()
            number, _, where = failure.decode(errors="replace").partition(":")
            raise OSError(int(number), os.strerror(int(number)), where)

    def poll(self):
        """The exit status (``-N`` for signal N) once the process ended, else None."""
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout(f"pid {self.pid} still runs after {timeout} s")
            time.sleep(min(delay, remaining, 0.05))
            delay *= 2
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # waited for elsewhere; its status is lost (subprocess says 0 too)
            self.returncode = 0
            return
        except InterruptedError:
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


def _first_found(argv: list, env: dict, run):
    """``run(path)`` for the command ``argv[0]`` at each place it is looked for, as ``os.execvpe``
    and ``subprocess`` look: ``argv[0]`` itself when it has a slash, else in each folder of
    ``env``'s ``PATH`` in turn (``os.get_exec_path``); the first call that does not raise answers.
    When none runs, the first error other than a missing file is raised, else the last."""
    name = argv[0]
    paths = exec_candidates(name, env)
    missing = (FileNotFoundError, NotADirectoryError)
    first_other = last = None
    for path in paths:
        try:
            return run(path)
        except OSError as exc:
            last = exc
            if first_other is None and not isinstance(exc, missing):
                first_other = exc
    raise first_other or last or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def _spawn(argv: list, env: dict, actions: list) -> int:
    """``posix_spawn`` ``argv`` in a session of its own with SIGPIPE and SIGXFSZ at their defaults,
    its descriptors as ``actions`` make them, found as :func:`_first_found` finds it."""
    return _first_found(argv, env, lambda path: os.posix_spawn(
        path, argv, env, file_actions=actions, setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ)))


def _exec_child(argv, cwd, env, stdin_fd, stdout_fd, stderr_fd, fail_fd, keep_fd) -> None:
    """The forked child's side of :class:`_Child`: never returns (exec, or ``_exit(127)`` after
    writing ``errno:where`` to ``fail_fd``)."""
    try:
        where = "setsid"
        os.setsid()
        where = "dup2"
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        if keep_fd is not None:
            os.dup2(keep_fd[0], keep_fd[1], inheritable=True)
        where = cwd
        os.chdir(cwd)
        if COMMAND_IDS is not None:
            where = "setuid"
            os.setgroups([])
            os.setresgid(COMMAND_IDS[1], COMMAND_IDS[1], COMMAND_IDS[1])
            os.setresuid(COMMAND_IDS[0], COMMAND_IDS[0], COMMAND_IDS[0])
        # exec resets handled signals to their default, not ignored ones: Python ignores these two
        for number in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(number, signal.SIG_DFL)
        where = argv[0]
        _first_found(argv, env, lambda path: os.execve(path, argv, env))  # PATH as env's, as subprocess
    except BaseException as exc:
        number = getattr(exc, "errno", None) or errno.EINVAL
        try:
            os.write(fail_fd, f"{number}:{where}".encode(errors="replace"))
        finally:
            os._exit(127)


_children_lock = _thread.allocate_lock()
_children: dict = {}  # pid -> _Child not yet known to be waited for


def is_init() -> bool:
    """Whether pxd is PID 1 of its PID namespace (bwrap --as-pid-1, gVisor), where the kernel drops
    every signal sent from inside the namespace that pxd has no handler for, SIGKILL included."""
    return os.getpid() == 1


def _proc_table() -> list:
    """(pid, state, ppid, process group) of every process visible in /proc."""
    table = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        table.append((int(name), fields[0].decode(), int(fields[1]), int(fields[2])))
    return table


def reap_orphans() -> int:
    """Wait for every zombie child of pxd it did not start itself (orphans re-parented to PID 1);
    pxd's own children are left to the code that started them, which needs their exit status."""
    me, reaped = os.getpid(), 0
    with _children_lock:
        for pid in [pid for pid, child in _children.items() if child.returncode is not None]:
            del _children[pid]
        for pid, state, ppid, _ in _proc_table():
            if state == "Z" and ppid == me and pid not in _children:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        reaped += 1
                except ChildProcessError:
                    pass
    return reaped


def settle_group(pgid: int, give_up_s: float = 1.0) -> None:
    """After a command's group is killed: wait for its members to die and reap the orphans among
    them, so the next command sees none of them (not even as zombies)."""
    give_up = time.monotonic() + give_up_s
    me = os.getpid()
    while time.monotonic() < give_up:
        reap_orphans()
        left = [pid for pid, state, ppid, group in _proc_table()
                if group == pgid and (state not in ("Z", "X") or ppid == me)]
        with _children_lock:
            left = [pid for pid in left if pid not in _children]
        if not left:
            return
        time.sleep(0.002)


def start_reaper() -> None:
    """Reap orphans when a child ends, not on a timer: a SIGCHLD handler (main thread only) makes
    Python write the signal to a pipe whichever thread the kernel delivered it to, and a thread
    waits on that pipe. A sandbox that runs nothing costs no CPU (polling /proc four times a
    second did, about 7 ms a second under gVisor's ptrace platform). A SIGCHLD sent from inside
    only makes pxd look for zombies, in the sandbox's own CPU quota."""
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    _thread.start_new_thread(_reaper_loop, (wake_r,))


def _reaper_loop(wake_fd: int) -> None:
    while True:
        os.read(wake_fd, 4096)  # the signals since the last pass; one that comes during it wakes the next
        try:
            reap_orphans()
        except OSError:
            pass


def kill_other_processes(give_up_s: float = 5.0) -> int:
    """SIGKILL every process in the sandbox but pxd (repeated until none is left alive, so a fork
    bomb's newest children go too) and reap the orphans; returns how many distinct processes were
    alive. Only as PID 1: ``kill(-1)`` spares the caller and the namespace's init, nothing else."""
    me = os.getpid()
    seen = set()
    give_up = time.monotonic() + give_up_s
    while time.monotonic() < give_up:
        alive = {pid for pid, state, _, _ in _proc_table() if pid != me and state not in ("Z", "X")}
        if not alive:
            break
        seen |= alive
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap_orphans()
        time.sleep(0.005)
    reap_orphans()
    return len(seen)


def protect_self() -> None:
    """Make pxd non-dumpable (:func:`make_not_dumpable`): no command of its uid can ptrace it or
    take its descriptors; pxd does not start without it."""
    try:
        make_not_dumpable()
    except OSError as exc:
        raise SystemExit(f"pxd: {exc.strerror}") from None


def close_inherited_fds() -> None:
    """Close every descriptor above 2 that pxd inherited: what pxd opens later is close-on-exec, so
    then nothing but what a request asks for reaches a command."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor


def reserve_results_fds() -> None:
    """Hold descriptors 3..9 with close-on-exec placeholders, so that no pipe pxd makes (nor
    a _Child's own failure pipe) lands there and a command's ``results_fd`` replaces only a placeholder."""
    placeholder = os.open(NULL_DEVICE, os.O_RDONLY | os.O_CLOEXEC)
    for fd in range(3, 10):
        if fd != placeholder:
            os.dup2(placeholder, fd, inheritable=False)
    if placeholder > 9:
        os.close(placeholder)


ROUTES = {
    "/health": ("GET", Daemon.health),
    "/exec": ("POST", Daemon.exec),
    "/session/open": ("POST", Daemon.session_open),
    "/session/exec": ("POST", Daemon.session_exec),
    "/session/close": ("POST", Daemon.session_close),
    "/file/read": ("POST", Daemon.file_read),
    "/file/write": ("POST", Daemon.file_write),
    "/git/status": ("POST", Daemon.git_status),
    "/git/diff": ("POST", Daemon.git_diff),
    "/git/commit": ("POST", Daemon.git_commit),
}


def serve_stream(daemon: Daemon, rfile, wfile, key: bytes | None = None) -> None:
    """Answer requests on one connection until it closes; with ``key``, every answer carries its MAC
    over its sequence number on this connection (0, 1, 2, ...)."""
    seq = 0
    while True:
        try:
            message = read_message(rfile)
        except RequestError as exc:
            write_response(wfile, exc.status, {"error": str(exc)}, key, seq)
            return
        if message is None:
            return
        start_line, _headers, body = message
        status, obj = daemon.handle(start_line, body)
        write_response(wfile, status, obj, key, seq)
        seq += 1


def listen_unix(path: str):
    import socket

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if _exists(path):
        os.unlink(path)
    server.bind(path)
    server.listen(64)
    return server


def serve_socket(daemon: Daemon, server) -> None:
    """One thread per connection; each connection starts with its client's ``PXD-KEY`` line."""

    def one(conn):
        with conn, conn.makefile("rb") as r, conn.makefile("wb") as w:
            try:
                key = read_key(r)
            except RequestError as exc:
                write_response(w, exc.status, {"error": str(exc)})
                return
            try:
                serve_stream(daemon, r, w, key)
            except (BrokenPipeError, ConnectionResetError):
                pass

    while True:
        conn, _ = server.accept()
        _thread.start_new_thread(one, (conn,))


USAGE = "usage: pxd.py --workspace DIR (--stdio | --socket PATH) [--max-file-bytes N] [--command-uid UID]"


def parse_args(argv: list) -> dict:
    """``--name value`` pairs and the ``--stdio`` switch (no argparse: it costs startup time in every sandbox)."""
    opts = {"workspace": None, "socket": None, "stdio": False, "max_file_bytes": 8 * 1024 * 1024,
            "command_uid": None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--stdio":
            opts["stdio"] = True
        elif arg in ("--workspace", "--socket", "--max-file-bytes", "--command-uid") and i + 1 < len(argv):
            opts[arg[2:].replace("-", "_")] = argv[i + 1]
            i += 1
        elif arg in ("-h", "--help"):
            print(__doc__ + "\n" + USAGE)
            sys.exit(0)
        else:
            sys.exit(f"pxd: unexpected argument {arg!r}\n{USAGE}")
        i += 1
    if not opts["workspace"] or opts["stdio"] == bool(opts["socket"]):
        sys.exit(f"pxd: give --workspace and exactly one of --stdio or --socket\n{USAGE}")
    try:
        opts["max_file_bytes"] = int(opts["max_file_bytes"])
    except ValueError:
        sys.exit(f"pxd: --max-file-bytes must be an integer, got {opts['max_file_bytes']!r}")
    if opts["command_uid"] is not None:
        if not opts["command_uid"].isdigit():
            sys.exit(f"pxd: --command-uid must be a user id, got {opts['command_uid']!r}")
        opts["command_uid"] = int(opts["command_uid"])
    return opts


def reset_inherited_ignores() -> None:
    """Every standard signal the host left ignored goes back to its default, for pxd and so for the
    commands it starts: a sandbox's signals must not depend on how the process that started it was
    started (a trainer under ``nohup`` ignores SIGHUP, and an ignored signal survives exec). SIGPIPE
    and SIGXFSZ stay as Python set them for pxd itself; each command gets them at their defaults."""
    keep = (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ)
    for number in range(1, 32):
        if number not in keep and signal.getsignal(number) == signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    close_inherited_fds()
    reset_inherited_ignores()
    reserve_results_fds()
    protect_self()
    if args["command_uid"] is not None:
        set_command_ids(args["command_uid"])
    if is_init():
        # PID 1 of the sandbox: no handler for any terminating signal, so none sent from inside the
        # namespace is delivered (Python's own SIGINT handler goes too); the host ends the sandbox
        # by closing stdin, by its cgroup or with runsc kill. Orphans are reaped here.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        start_reaper()
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    daemon = Daemon(args["workspace"], max_file_bytes=args["max_file_bytes"])
    try:
        if args["stdio"]:
            rfile = sys.stdin.buffer
            try:
                key = read_key(rfile)
            except RequestError as exc:
                sys.stderr.write(f"pxd: {exc}\n")
                return 2
            # commands must never write into the protocol stream: move stdout away from fd 1, above
            # the descriptors a command may ask for as its results_fd
            proto_out = _io.open(fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 10), "wb")
            devnull = os.open(NULL_DEVICE, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
            write_ready(proto_out)
            serve_stream(daemon, rfile, proto_out, key)
        else:
            server = listen_unix(args["socket"])  # listening before the ready line goes out
            _thread.start_new_thread(serve_socket, (daemon, server))
            write_ready(sys.stdout.buffer)
            while sys.stdin.buffer.read(65536):  # the lifeline: exit when the parent goes away
                pass
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        daemon.close()
    return 0


def write_ready(wfile) -> None:
    """The first line on stdout tells the host the daemon is up (and for a socket, listening)."""
    wfile.write(b"PXD-READY %d\n" % PROTOCOL_VERSION)
    wfile.flush()


if __name__ == "__main__":
    sys.exit(main())
