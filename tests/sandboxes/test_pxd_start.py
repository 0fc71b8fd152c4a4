"""pxd's start imports only the interpreter's built-in modules, and the commands it starts itself
(fork and exec, no ``subprocess``) get what ``subprocess`` gave them: their own session, default
SIGPIPE, only descriptors 0-2 (and a results descriptor when asked), the command user, clear
errors for a command that cannot start.

Every sandbox starts a pxd, and its imports were two thirds of the CPU of a bwrap start+stop
(docs/benchmarks.md, "pxd on built-in modules")."""

from __future__ import annotations

import subprocess

import pytest

import sandboxes
from sandboxes.runtimes import compiled_pxd
from sandboxes.toolchain import SANDBOX_PYTHON
from tests.sandboxes.conftest import runtime_params

# what the pure-Python modules behind subprocess, threading, selectors, signal, json and ctypes load
# the descriptors a command holds (``ls /proc/self/fd`` fails under gVisor 20221219)
FDS = "python3 -I -S -c \"import os; print('fds:', *sorted(map(int, os.listdir('/proc/self/fd'))))\""
STANDARD_SIGNALS = (1 << 31) - 1  # signals 1-31 in /proc's SigIgn mask (bit N-1 is signal N)
SLOW_MODULES = {"subprocess", "threading", "selectors", "signal", "json", "json.decoder", "enum", "re", "locale",
                "collections", "contextlib", "warnings", "base64", "socket", "hashlib", "ctypes", "struct"}


def test_pxd_start_imports_no_slow_module(tmp_path):
    """The sandbox's interpreter starting the compiled daemon as the runtimes do, through its
    ready line and one request to its exit: none of the modules that cost most of its start is
    loaded."""
    proc = subprocess.Popen([SANDBOX_PYTHON, "-I", "-S", "-X", "importtime", str(compiled_pxd()), "--workspace",
                             str(tmp_path), "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out, err = proc.communicate(b"PXD-KEY " + b"ab" * 32 + b"\nGET /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                                timeout=60)
    assert out.startswith(b"PXD-READY 1\n") and b'"ok":true' in out, (out, err[-2000:])
    loaded = {line.rsplit("|", 1)[1].strip() for line in err.decode().splitlines() if line.startswith("import time:")}
    assert {"_json", "_ctypes"} <= loaded  # the listing is read right: the codec's and prctl's modules
    assert not loaded & SLOW_MODULES, sorted(loaded & SLOW_MODULES)


def test_pxd_start_runs_on_posix_not_os(tmp_path):
    """18f84c2's pxd imported ``os``, whose ``_collections_abc`` and ``posixpath`` were about 1 ms of
    CPU of every start (issue 55, fifth session): the daemon runs on ``posix`` through its ready
    line, a command and a file written and read."""
    proc = subprocess.Popen([SANDBOX_PYTHON, "-I", "-S", "-X", "importtime", str(compiled_pxd()), "--workspace",
                             str(tmp_path), "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    bodies = [b'{"argv": ["true"]}', b'{"path": "a.txt", "content": "hi"}', b'{"path": "a.txt"}']
    requests = b"".join(b"POST %s HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (route, len(body), body)
                        for route, body in zip((b"/exec", b"/file/write", b"/file/read"), bodies))
    out, err = proc.communicate(b"PXD-KEY " + b"ab" * 32 + b"\n" + requests, timeout=60)
    assert out.startswith(b"PXD-READY 1\n") and out.count(b"HTTP/1.1 200") == 3, (out, err[-2000:])
    assert (tmp_path / "a.txt").read_text() == "hi"
    loaded = {line.rsplit("|", 1)[1].strip() for line in err.decode().splitlines() if line.startswith("import time:")}
    assert "_json" in loaded  # the listing is read right
    assert not loaded & {"os", "posixpath", "genericpath", "_collections_abc"}, sorted(loaded)


def test_pxd_paths_on_posix_are_os_paths(tmp_path):
    """What pxd does with paths on ``posix`` is what it did with ``os.path``: a workspace named
    through a symbolic link and ``..`` is its real folder, a command runs there with its variables,
    an absolute path inside it is taken, one outside (or leaving it by ``..``) refused."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    proc = subprocess.Popen([SANDBOX_PYTHON, "-I", "-S", str(compiled_pxd()), "--workspace",
                             str(tmp_path / "link" / "." / "sub" / ".."), "--stdio"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    client = sandboxes.PxdClient.over_fds(proc.stdout.fileno(), proc.stdin.fileno())
    try:
        client.wait_ready(30)
        assert client.health()["workspace"] == str(real)
        assert client.run(["sh", "-c", "pwd; echo $PT_V"], env={"PT_V": "v"}, timeout_s=30).output.split() == [
            str(real), "v"]
        client.write_file(f"{real}/sub/../a.txt", "hi")
        assert client.read_file("a.txt") == b"hi" and (real / "a.txt").read_text() == "hi"
        for outside in (f"{tmp_path}/x", f"{real}/../x", f"/{real}/a.txt"):
            with pytest.raises(sandboxes.PxdError, match="outside the workspace"):
                client.read_file(outside)
    finally:
        client.close()
        try:
            proc.stdin.close()  # pxd sees EOF and exits
        except OSError:
            pass
        proc.wait(timeout=30)


def test_the_json_codec_is_the_json_packages():
    """pxd's codec on ``_json`` answers as ``json.loads`` / ``json.dumps(separators=(",", ":"))`` on
    what requests and answers hold, and refuses what json refuses with a ValueError."""
    import json

    from sandboxes import pxd

    for value in ({"argv": ["sh", "-c", "echo \u00e9 \"q\" \\\\ \x01"], "timeout_s": 1.5, "env": {}, "n": -3},
                  {"nested": [[], {}, [None, True, False]], "big": 10 ** 30, "f": 1e-7, "s": "\ud800"[:0] + "\u2603"}):
        assert pxd.json_dumps(value) == json.dumps(value, separators=(",", ":"))
        assert pxd.json_loads(json.dumps(value, indent=2).encode()) == value
    for bad in (b"", b"{not json", b"{} {}", b"[1,]", b"\xff", b"{\"a\": 1"):
        with pytest.raises(ValueError):
            pxd.json_loads(bad)
    with pytest.raises(TypeError, match="not JSON serializable"):
        pxd.json_dumps({"x": object()})


@pytest.mark.parametrize("runtime", runtime_params())
def test_commands_pxd_starts_get_what_subprocess_gave_them(repo, store, cache, runtime):
    """In a real sandbox: a command runs in a session of its own, with SIGPIPE at its default (a
    reader that goes away ends ``yes``), as the sandbox user, in the asked folder with the asked
    variables, sees only descriptors 0-2 (3 with ``results_fd``, holding what it wrote), reads
    its stdin; a missing command, a non-executable file and a missing folder are clear errors,
    and the sandbox answers afterwards."""
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
        r = sb.exec("ps -o sid= -p $$; ps -o pid= -p $$; grep -E '^(SigIgn|Uid)' /proc/self/status; "
                    f"{FDS}; pwd; echo \"$PT_X\"",
                    cwd="/workspace", env={"PT_X": "seen"})
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        if lines[0].strip().isdigit():  # ps exists in the sandbox's /usr
            assert lines[0].strip() == lines[1].strip(), lines  # the shell leads its own session
        status = dict(line.split(":", 1) for line in lines if line.startswith(("SigIgn", "Uid")))
        if "SigIgn" in status:  # gVisor's /proc does not show it; the yes | head below does
            # no standard signal ignored (SIGPIPE, SIGXFSZ at their defaults); the C library's posix_spawn
            # leaves its own two real-time signals (32, 33) ignored, which its start-up in the program resets
            assert int(status["SigIgn"].strip(), 16) & STANDARD_SIGNALS == 0, status
        assert status["Uid"].split() == ["1000"] * 4, status
        fds = [line for line in lines if line.startswith("fds:")][0].split()[1:]
        assert fds == ["0", "1", "2", "3"], fds  # 0-2 and the listing's own descriptor
        assert lines[-2:] == ["/workspace", "seen"]
        r = sb.exec(["/bin/bash", "-c", "yes | head -c 3 >/dev/null; echo ${PIPESTATUS[0]}"], timeout_s=20)
        assert r.stdout.strip() == "141", r.output  # yes ended by SIGPIPE (128 + 13)
        r = sb.exec(["/bin/sh", "-c", FDS + "; printf done >&4"], results_fd=4)
        assert r.stdout.split() == ["fds:", "0", "1", "2", "3", "4"] and r.results == b"done", (r.output, r.results)
        r = sb.pxd.exec(["cat"], stdin="fed through stdin")
        assert r.stdout == "fed through stdin"
        for argv, words in ((["no-such-command-xyz"], "command not found"), (["/workspace/calc.py"], "not executable")):
            with pytest.raises(Exception, match=words):
                sb.pxd.exec(argv)
        with pytest.raises(Exception, match="no-such-dir|not a folder|does not exist|not found"):
            sb.pxd.exec(["true"], cwd="/workspace/no-such-dir")
        # a folder other than pxd's own (started by fork and exec, not posix_spawn): the same
        sb.exec("mkdir -p sub/deeper")
        r = sb.exec(f"{FDS}; pwd; ps -o sid= -p $$ || true; echo $$; grep -E '^(SigIgn|Uid)' /proc/self/status",
                    cwd="/workspace/sub/deeper")
        lines = r.stdout.splitlines()
        assert lines[:2] == ["fds: 0 1 2 3", "/workspace/sub/deeper"], r.output
        if lines[2].strip().isdigit():
            assert lines[2].strip() == lines[3].strip(), lines
        assert [line.split()[1:] for line in lines if line.startswith("Uid")] == [["1000"] * 4], lines
        assert all(int(line.split()[1], 16) & STANDARD_SIGNALS == 0 for line in lines if line.startswith("SigIgn")), lines
        r = sb.exec(["/bin/bash", "-c", "yes | head -c 3 >/dev/null; echo ${PIPESTATUS[0]}"], cwd="/workspace/sub")
        assert r.stdout.strip() == "141", r.output
        r = sb.pxd.exec(["cat"], stdin="fed", cwd="/workspace/sub")
        assert r.stdout == "fed"
        assert sb.exec("echo alive").stdout == "alive\n"


@pytest.mark.parametrize("runtime", runtime_params())
def test_a_signal_the_host_ignores_is_at_its_default_in_the_sandbox(repo, store, cache, runtime):
    """A sandbox started by a process that ignores SIGHUP (a trainer under ``nohup``): its commands
    still die of SIGHUP, as any command started afresh would; an ignored signal survives exec, so
    without pxd's reset the sandbox's behaviour would depend on how the host process was started."""
    import signal

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
            r = sb.exec(["/bin/sh", "-c", "kill -HUP $$; echo survived"])
    finally:
        signal.signal(signal.SIGHUP, before)
    assert r.exit_code == 128 + signal.SIGHUP and "survived" not in r.stdout, r.output
