"""Attacks on pxd's answer channel from the agent's side, run from inside real bubblewrap and gVisor
sandboxes: taking pxd's pipes (pidfd_getfd, /proc/<pid>/fd), tracing it, killing it, forging an
answer; and the host's client fed malformed or forged answer streams over a plain pipe.

Also the two /exec options the grader builds on: ``results_fd`` (a results channel of the
command's own) and ``kill_others`` (nothing the command left behind outlives the answer)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import tracemalloc

import pytest

import sandboxes
from sandboxes import PxdError
from sandboxes.runtimes import compiled_pxd
from sandboxes.client import PxdClient, PxdConnectionError

from .conftest import make_repo, runtime_params

LIMITS = sandboxes.Limits(cpus=1, memory_mib=512, pids=128, disk_mib=64, tmp_mib=32, wall_s=300)

# a well-formed answer to /exec that reports an all-passed run, as an attacker would forge it
FORGED_BODY = json.dumps({"exit_code": 0, "stdout": "FORGED 5 passed", "stderr": "", "truncated": False,
                          "timed_out": False, "duration_s": 0.1, "results_b64": "Rk9SR0VE",
                          "results_truncated": False}).encode()
FORGED = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pxd-Mac: " + b"0" * 64
          + b"\r\nContent-Length: %d\r\n\r\n" % len(FORGED_BODY) + FORGED_BODY)

# run inside the sandbox: every way a same-uid process could get at another process's descriptors,
# writing the forged answer into each one it gets; prints what it got as JSON
GRAB_SCRIPT = r"""
import ctypes, json, os, sys
forged = bytes.fromhex(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
me = os.getpid()
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me)
got, tried = [], {"pids": pids, "pidfd_open": 0, "errors": {}}

null = os.stat("/dev/null")

def wrote(how, fd):
    try:
        if os.path.samestat(os.fstat(fd), null):
            return  # a fresh open of /dev/null (gVisor lets /proc/<pid>/fd/<n> reopen what anyone may)
        os.write(fd, forged)
        got.append(how)
    except OSError as exc:
        tried["errors"][how] = exc.strerror
    finally:
        os.close(fd)

for pid in pids:
    # pidfd_open (434) then pidfd_getfd (438) of descriptors 0..31
    pidfd = libc.syscall(434, pid, 0)
    if pidfd < 0:
        tried["errors"][f"pidfd_open {pid}"] = os.strerror(ctypes.get_errno())
    else:
        tried["pidfd_open"] += 1
        for target in range(32):
            fd = libc.syscall(438, pidfd, target, 0)
            if fd >= 0:
                wrote(f"pidfd_getfd {pid}/{target}", fd)
        os.close(pidfd)
    # /proc/<pid>/fd/<n> reopened for writing
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        tried["errors"][f"/proc/{pid}/fd"] = exc.strerror
        names = [str(n) for n in range(32)]
    for name in names:
        try:
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        wrote(f"/proc/{pid}/fd/{name}", fd)
print(json.dumps({"got": got, **tried}))
"""

PTRACE_SCRIPT = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
out = {}
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
    for name, request in (("PTRACE_ATTACH", 16), ("PTRACE_SEIZE", 0x4206)):
        rc = libc.ptrace(request, pid, None, None)
        out[f"{name} {pid}"] = "ok" if rc == 0 else os.strerror(ctypes.get_errno())
        if rc == 0:
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.read(1)
        out[f"mem {pid}"] = "ok"
    except OSError as exc:
        out[f"mem {pid}"] = exc.strerror
    # gVisor shows any process's environ; pxd's holds nothing the command's own does not
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            theirs = set(f.read().split(b"\0")) - {b""}
        mine = {f"{k}={v}".encode() for k, v in os.environ.items()}
        out[f"environ {pid}"] = "ok" if theirs - mine else "nothing new"
    except OSError as exc:
        out[f"environ {pid}"] = exc.strerror
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=runtime_params())
def box(request, tmp_path_factory):
    """One sandbox per runtime for the attacks; each test checks that it still answers truly."""
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    repo = make_repo(root / "repo")
    store, cache = sandboxes.ImageStore(root / "images"), sandboxes.LayerCache(root / "cache")
    sb = sandboxes.start(repo, runtime=request.param, limits=LIMITS, store=store, cache=cache)
    yield sb
    sb.close()


def _still_true(sb) -> None:
    """The next answers are pxd's own: not the forged one, and the daemon is alive."""
    r = sb.exec("echo real")
    assert r.output == "real\n" and r.results is None
    assert sb.pxd.health()["pid"] == 1


def _run_script(sb, script: str, *args: str) -> dict:
    sb.write_file("attack.py", script)
    r = sb.exec(["python3", "attack.py", *args], timeout_s=60)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the channel cannot be reached -------------------------------------------------------------


def test_no_process_in_the_sandbox_lends_pxds_pipes(box):
    """pidfd_getfd on every descriptor of every other process, and every /proc/<pid>/fd/<n> opened
    for writing; each descriptor got is written the forged answer. None is got, pxd answers truly.
    (bwrap before: pxd shared uid 1000 and was dumpable; gVisor before: pxd's init parent kept the
    pipes and /proc/1/fd/1 opened for writing.)"""
    out = _run_script(box, GRAB_SCRIPT, FORGED.hex())
    assert out["pids"], "the attack saw no other process (pxd at least)"
    assert out["got"] == [], out
    _still_true(box)


def test_pxd_cannot_be_traced_nor_its_memory_or_environment_read(box):
    out = _run_script(box, PTRACE_SCRIPT)
    assert "PTRACE_ATTACH 1" in out and "mem 1" in out
    assert not [k for k, v in out.items() if v == "ok"], out
    _still_true(box)


@pytest.mark.parametrize("signal_name", ["KILL", "TERM", "INT", "HUP", "QUIT", "USR1", "STOP"])
def test_pxd_cannot_be_signalled_from_inside(box, signal_name):
    """Every process the command can see, and ``kill -1`` (all it may signal): pxd carries on."""
    pids = " ".join(map(str, _run_script(box, GRAB_SCRIPT, b"".hex())["pids"]))
    r = box.exec(f"for p in {pids}; do kill -{signal_name} $p; done; kill -{signal_name} -1; echo sent",
                 timeout_s=30)
    assert "sent" in r.output or r.exit_code == 137  # kill -1 may take the command's own shell
    _still_true(box)


def test_pxd_is_pid_1_and_no_runtime_process_is_inside(box):
    """pxd is the init of the sandbox's PID namespace: no bwrap or runsc process is in the sandbox
    (bwrap's own init used to be pid 1 there, holding pxd's pipes)."""
    listing = ("import os\n"
               "for p in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
               "    print(p, open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())\n")
    r = box.exec(["python3", "-c", listing])
    processes = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "pxd.py" in processes.pop("1") and r.exit_code == 0
    assert not [c for c in processes.values() if "bwrap" in c or "runsc" in c or "pxd.py" in c], processes
    _still_true(box)


# -- results_fd and kill_others ------------------------------------------------------------------


@pytest.mark.parametrize("runtime", runtime_params())
def test_results_fd_and_kill_others_on_a_real_sandbox(runtime, repo, store, cache):
    with sandboxes.start(repo, runtime=runtime, limits=LIMITS, store=store, cache=cache) as sb:
        r = sb.exec("echo report >&3; echo output", results_fd=3)
        assert (r.results, r.results_truncated, r.output) == (b"report\n", False, "output\n")
        r = sb.exec("echo on-stdout", results_fd=9)
        assert r.results == b"" and r.output == "on-stdout\n"
        # a daemon left behind in its own session touches a file and writes to results a second later
        left_behind = ("setsid sh -c 'echo up > started; sleep 1; touch late; echo late >&3' </dev/null >/dev/null 2>&1 &"
                       " while [ ! -e started ]; do sleep 0.01; done; echo early >&3")
        r = sb.exec(left_behind, results_fd=3, kill_others=True)
        assert r.results == b"early\n" and r.exit_code == 0
        assert r.others_killed >= 1  # the daemon's shell and its sleep
        r = sb.exec("sleep 2; test -e late && echo LATE; echo checked")
        assert r.output == "checked\n"
        # without kill_others the same daemon outlives the answer (the option is what ends it)
        r = sb.exec(left_behind.replace("started", "started2"), results_fd=3)
        assert r.results == b"early\n"
        r = sb.exec("for i in $(seq 100); do test -e late && break; sleep 0.1; done; test -e late && echo LATE")
        assert r.output == "LATE\n"


def test_results_are_capped_and_results_fd_is_checked(pxd_proc):
    client, _ = pxd_proc
    r = client.exec(shell="head -c 100000 /dev/zero >&4", results_fd=4, results_cap_bytes=10)
    assert r.results == b"\0" * 10 and r.results_truncated and r.exit_code == 0
    for bad in (2, 10):
        with pytest.raises(PxdError, match="results_fd"):
            client.exec(shell="true", results_fd=bad)
    with pytest.raises(PxdError, match="results_cap_bytes"):
        client.exec(shell="true", results_fd=3, results_cap_bytes=1 << 30)


def test_kill_others_is_refused_when_pxd_is_not_pid_1(pxd_proc):
    """Unisolated pxd is a host process: kill(-1) there would kill the host's processes."""
    client, _ = pxd_proc
    with pytest.raises(PxdError, match="kill_others needs pxd to be PID 1") as err:
        client.exec(shell="true", kill_others=True)
    assert err.value.status == 400
    assert client.exec(shell="echo fine").stdout == "fine\n"


# -- the client against a hostile stream ---------------------------------------------------------

KEY = bytes(range(32))


def _mac(seq: int, status_line: bytes, body: bytes) -> bytes:
    return hmac.new(KEY, b"%d\n%s\n" % (seq, status_line) + body, hashlib.sha256).hexdigest().encode()


def _answer(body: bytes, seq: int = 0, status_line: bytes = b"HTTP/1.1 200 OK", mac: bytes | None = None) -> bytes:
    mac = _mac(seq, status_line, body) if mac is None else mac
    return (status_line + b"\r\nX-Pxd-Mac: " + mac + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


@pytest.fixture
def wire():
    """A client whose answers come from a pipe the test writes (as a hostile daemon would); its
    requests go to a pipe nobody reads (they are small: the pipe's buffer holds them)."""
    answers_r, answers_w = os.pipe()
    requests_r, requests_w = os.pipe()
    client = PxdClient(answers_r, requests_w, name="hostile", key=KEY)
    yield client, answers_w
    for fd in (answers_r, answers_w, requests_r, requests_w):
        os.close(fd)


def _must_break(client, match: str, route: str = "/health") -> None:
    with pytest.raises(PxdConnectionError, match=match) as err:
        client.request("GET", route, wait_s=5) if route == "/health" else client.exec(shell="true", timeout_s=1)
    assert route in str(err.value)
    assert client.closed
    with pytest.raises(PxdConnectionError, match="closed"):
        client.health()  # never desync: nothing more is read from that stream


OK_BODY = b'{"ok":true}'


@pytest.mark.parametrize("stream, match", [
    (b"SPAM\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 2xx OK\r\nContent-Length: 0\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "Content-Length is not a non-negative integer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "Content-Length is not a non-negative integer"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Filler: y\r\n" * 1000 + b"Content-Length: 0\r\n\r\n", "more than 100 header lines"),
    (b"HTTP/1.1 200 OK\r\nX-Long: " + b"y" * 20_000, "a line longer than 8192 bytes"),
    (_answer(b"[1, 2, 3]"), "JSON list, not an object"),
    (_answer(b'"just a string"'), "JSON str, not an object"),
    (_answer(b"{not json"), "body is not JSON"),
    (_answer(OK_BODY, mac=b"f" * 64), "bad X-Pxd-Mac"),
    (_answer(OK_BODY, mac=b"\xff\xfe not hex"), "bad X-Pxd-Mac"),
    (_answer(OK_BODY, seq=1), "bad X-Pxd-Mac"),  # the right key, the wrong place in the sequence
    (_answer(OK_BODY).replace(b"X-Pxd-Mac", b"X-Other"), "no X-Pxd-Mac header"),
    (_answer(OK_BODY).replace(b"HTTP/1.1 200 OK", b"HTTP/1.1 500 OK", 1), "bad X-Pxd-Mac"),  # status swapped
], ids=["not-http", "status-not-a-number", "length-not-a-number", "length-negative", "header-without-colon",
        "1000-header-lines", "endless-header-line", "json-array", "json-string", "not-json", "wrong-mac",
        "mac-not-hex", "mac-of-another-sequence-number", "no-mac", "status-changed-under-the-mac"])
def test_malformed_or_forged_answers_close_the_client(wire, stream, match):
    client, answers_w = wire
    os.write(answers_w, stream)
    _must_break(client, match)


def test_a_replayed_answer_is_refused(wire):
    client, answers_w = wire
    os.write(answers_w, _answer(OK_BODY, seq=0) + _answer(OK_BODY, seq=0))
    assert client.health() == {"ok": True}
    _must_break(client, "bad X-Pxd-Mac")


def test_an_answer_with_fields_of_the_wrong_type_is_a_connection_error(wire):
    client, answers_w = wire
    os.write(answers_w, _answer(b'{"exit_code": "zero", "stdout": 1}'))
    _must_break(client, "malformed answer to /exec", route="/exec")


def test_a_huge_content_length_fails_fast_without_buffering():
    """100 GB announced and data streaming behind it: refused at the header, before the body."""
    answers_r, answers_w = os.pipe()
    requests_r, requests_w = os.pipe()
    client = PxdClient(answers_r, requests_w, name="hostile", key=KEY)

    def flood():
        chunk = b"x" * (1 << 20)
        try:
            os.write(answers_w, b"HTTP/1.1 200 OK\r\nX-Pxd-Mac: 00\r\nContent-Length: 100000000000\r\n\r\n")
            for _ in range(256):  # up to 256 MiB, as fast as the client reads it
                os.write(answers_w, chunk)
        except OSError:  # the client's end is closed
            return

    writer = threading.Thread(target=flood, daemon=True)
    tracemalloc.start()
    try:
        writer.start()
        with pytest.raises(PxdConnectionError, match="Content-Length 100000000000 is over the cap"):
            client.request("GET", "/health", wait_s=30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.close(answers_r)  # the writer's next write fails: it ends
        writer.join(30)
        for fd in (answers_w, requests_r, requests_w):
            os.close(fd)
    assert peak < 8 * 1024 * 1024, f"the client buffered {peak} bytes"
    assert client.closed


def test_pxd_requires_the_key_before_any_request(tmp_path):
    """No key line, no answers: a request sent first is refused and pxd exits."""
    import subprocess
    import sys
    from pathlib import Path

    ws = make_repo(tmp_path / "ws")
    done = subprocess.run([sys.executable, "-I", "-S", str(compiled_pxd(sys.executable)),
                           "--workspace", str(ws), "--stdio"],
                          input=b"GET /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n", capture_output=True, timeout=30)
    assert done.returncode == 2 and done.stdout == b""
    assert b"PXD-KEY" in done.stderr


@pytest.mark.parametrize("runtime", runtime_params())
def test_pid_1_reaps_orphans_and_keeps_each_commands_exit_status(runtime, repo, store, cache):
    """Commands that leave orphans behind (re-parented to pxd as PID 1): each command's own exit
    status still comes back, and no zombie is left for the next command to see."""
    with sandboxes.start(repo, runtime=runtime, limits=LIMITS, store=store, cache=cache) as sb:
        for code in range(1, 9):
            r = sb.exec(f"(sleep 0.01 &); (sh -c 'sleep 0.02' &); (true &); exit {code}")
            assert r.exit_code == code, r
        # Every process but this probe, with its state. pxd itself may read as running ('R': under
        # gVisor it is serving this very exec) or sleeping ('S'). An orphan still running on a loaded
        # machine, or one pxd has not reaped yet, goes by itself within moments; a zombie left
        # unreaped stays, and the check fails after 5 s.
        states = ("import os, time\n"
                  "def others():\n"
                  "    return sorted(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
                  "                  for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid())\n"
                  "for _ in range(100):\n"
                  "    if len(others()) == 1:\n"
                  "        break\n"
                  "    time.sleep(0.05)\n"
                  "print(others())")
        left = sb.exec(["python3", "-c", states]).stdout
        assert left in ("['S']\n", "['R']\n"), left  # pxd alone, no zombie
