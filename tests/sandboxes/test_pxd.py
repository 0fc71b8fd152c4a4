"""pxd, the in-sandbox daemon, run as a plain process on a scratch repository, and its client."""

from __future__ import annotations

import os

import pytest

from sandboxes import PxdError
from sandboxes.runtimes import compiled_pxd


def test_exec_argv_and_shell(pxd_proc):
    client, _ = pxd_proc
    r = client.exec(["python3", "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (r.exit_code, r.stdout, r.stderr, r.truncated, r.timed_out) == (3, "out\n", "err\n", False, False)
    assert r.duration_s > 0
    client.write_file("sub/keep.txt", "x")
    r = client.exec(shell="echo $GREETING from $(basename $PWD)", env={"GREETING": "hi"}, cwd="sub")
    assert r.stdout == "hi from sub\n"
    r = client.exec(shell="cat", stdin="fed through stdin")
    assert r.stdout == "fed through stdin"
    r = client.exec(shell="echo a; echo b >&2", merge_stderr=True)
    assert r.stdout == "a\nb\n" and r.stderr == ""


def test_exec_caps_keep_head_and_tail(pxd_proc):
    client, _ = pxd_proc
    r = client.exec(shell="seq 1 100000", head_bytes=6, tail_bytes=7)
    assert r.truncated and r.stdout_bytes == len("".join(f"{i}\n" for i in range(1, 100001)))
    assert r.stdout.startswith("1\n2\n3\n") and r.stdout.endswith("100000\n")
    assert f"[... {r.stdout_bytes - 13} bytes omitted ...]" in r.stdout


def test_exec_timeout_kills_the_whole_group(pxd_proc):
    client, ws = pxd_proc
    r = client.exec(shell="(sleep 30; touch late) & sleep 30", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 137
    r = client.exec(shell="sleep 1; ls late", timeout_s=10)
    assert r.exit_code != 0 and not (ws / "late").exists()


def test_background_process_does_not_hold_the_answer(pxd_proc):
    client, _ = pxd_proc
    r = client.exec(shell="sleep 30 & echo started", timeout_s=20)
    assert r.exit_code == 0 and r.stdout == "started\n" and not r.timed_out
    assert r.duration_s < 20


def test_session_keeps_cwd_and_env(pxd_proc):
    client, _ = pxd_proc
    client.write_file("pkg/mod.py", "X = 1\n")
    with client.open_session() as sh:
        assert sh.run("cd pkg && export LEVEL=deep").exit_code == 0
        r = sh.run("echo $LEVEL; basename $(pwd); printf no-newline")
        assert r.stdout == "deep\npkg\nno-newline"
        assert sh.run("exit_status() { return 7; }; exit_status").exit_code == 7
        assert sh.run("cat").stdout == ""  # reads /dev/null, never the daemon's own script
        r = sh.run("sleep 30", timeout_s=0.3)
        assert r.timed_out
        with pytest.raises(PxdError, match="no session"):
            sh.run("true")


def test_files_round_trip_and_limits(pxd_proc):
    client, ws = pxd_proc
    assert client.write_file("a/b/c.txt", "hello\n", mode=0o600) == 6
    assert (ws / "a/b/c.txt").read_text() == "hello\n" and (ws / "a/b/c.txt").stat().st_mode & 0o777 == 0o600
    assert client.read_file("a/b/c.txt") == b"hello\n"
    assert client.read_file(str(ws / "a/b/c.txt")) == b"hello\n"  # absolute, inside the workspace
    client.write_file("bin.dat", bytes(range(256)))
    assert client.read_file("bin.dat") == bytes(range(256))
    info = client.read_file_info("bin.dat", max_bytes=10)
    assert info["truncated"] and info["size"] == 256
    with pytest.raises(PxdError, match="does not exist"):
        client.read_file("missing.txt")
    with pytest.raises(PxdError, match="not a regular file"):
        client.read_file("a")


@pytest.mark.parametrize("path", ["../outside.txt", "a/../../outside.txt", "/etc/passwd", "/tmp/x"])
def test_paths_outside_the_workspace_are_refused(pxd_proc, path):
    client, ws = pxd_proc
    with pytest.raises(PxdError) as err:
        client.write_file(path, "escaped")
    assert err.value.status == 400 and ("'..'" in err.value.message or "outside the workspace" in err.value.message)
    with pytest.raises(PxdError):
        client.read_file(path)
    assert not (ws.parent / "outside.txt").exists()


def test_symlinks_out_of_the_workspace_are_not_followed(pxd_proc, tmp_path):
    client, ws = pxd_proc
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.symlink(secret, ws / "link.txt")
    os.symlink(tmp_path, ws / "linkdir")
    for path in ("link.txt", "linkdir/secret.txt"):
        with pytest.raises(PxdError, match="symlink"):
            client.read_file(path)
    with pytest.raises(PxdError, match="symlink"):
        client.write_file("link.txt", "overwritten")
    with pytest.raises(PxdError, match="symlink"):
        client.write_file("linkdir/new.txt", "planted")
    with pytest.raises(PxdError, match="symlink"):
        client.exec(["true"], cwd="linkdir")
    assert secret.read_text() == "host secret" and not (tmp_path / "new.txt").exists()


def test_git_status_diff_commit(pxd_proc):
    client, ws = pxd_proc
    assert client.git_status().clean
    client.write_file("calc.py", "def add(a, b):\n    return b + a\n")
    client.write_file("notes.md", "new\n")
    status = client.git_status()
    assert {(f.path, f.index, f.worktree) for f in status.files} == {("calc.py", " ", "M"), ("notes.md", "?", "?")}
    assert "+    return b + a" in client.git_diff()
    c = client.git_commit("swap the operands")
    assert c.committed and len(c.commit) == 40
    assert client.git_status().clean
    assert client.exec(["git", "log", "-1", "--format=%s"]).stdout == "swap the operands\n"
    again = client.git_commit("nothing")
    assert not again.committed and again.commit == c.commit
    assert "swap" not in client.git_diff(base="HEAD")


@pytest.mark.parametrize("route,body,message", [
    ("/exec", {}, "exactly one of 'argv'"),
    ("/exec", {"argv": ["true"], "shell": "true"}, "exactly one of 'argv'"),
    ("/exec", {"argv": "true"}, "field 'argv' must be list"),
    ("/exec", {"argv": ["true"], "timeout_s": -1}, "field 'timeout_s' must be between"),
    ("/exec", {"argv": ["no-such-command-xyz"]}, "command not found"),
    ("/exec", {"argv": ["true"], "env": {"A": 1}}, "env entry 'A'"),
    ("/file/write", {"path": "x", "content": "!!", "encoding": "base64"}, "not valid base64"),
    ("/file/write", {"path": "x"}, "field 'content' is required"),
    ("/git/commit", {"message": "  "}, "must not be empty"),
    ("/nope", {}, "no route '/nope'"),
])
def test_bad_requests_get_clear_errors(pxd_proc, route, body, message):
    client, _ = pxd_proc
    with pytest.raises(PxdError) as err:
        client.request("POST", route, body)
    assert message in err.value.message
    assert client.health()["ok"]  # the daemon carries on


def test_unix_socket_serves_clients_at_once(tmp_path):
    """The socket mode (several harness connections to one daemon); stdin stays its lifeline."""
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import sandboxes

    from .conftest import make_repo

    ws = make_repo(tmp_path / "ws")
    sock = tmp_path / "pxd.sock"
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_pxd(sys.executable)),
                             "--workspace", str(ws), "--socket", str(sock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"PXD-READY")
        slow, fast = sandboxes.PxdClient.over_unix_socket(str(sock)), sandboxes.PxdClient.over_unix_socket(str(sock))
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("slow", slow.exec(shell="sleep 1; echo slow")))
        t.start()
        results["fast"] = fast.exec(["echo", "fast"])  # answered while the slow one still runs
        assert "slow" not in results
        t.join(30)
        assert results["fast"].stdout == "fast\n" and results["slow"].stdout == "slow\n"
        slow.close()
        fast.close()
    finally:
        proc.stdin.close()
        assert proc.wait(10) == 0
        proc.stdout.close()


@pytest.mark.parametrize("other_makes", ["folder", "symlink"])
def test_a_folder_made_by_a_concurrent_request_is_opened_not_an_error(tmp_path, monkeypatch, other_makes):
    """Two writes into the same new folder: the one whose mkdir finds it already made opens it like
    any folder (found by the pxd load test as an HTTP 500), and still refuses it if it is a symlink."""
    from sandboxes import pxd

    real_mkdir = os.mkdir

    def made_first_by_another(name, mode, *, dir_fd):
        if other_makes == "folder":
            real_mkdir(name, mode, dir_fd=dir_fd)
        else:
            os.symlink(str(tmp_path), name, dir_fd=dir_fd)
        raise FileExistsError(name)

    monkeypatch.setattr(pxd.os, "mkdir", made_first_by_another)
    daemon = pxd.Daemon.__new__(pxd.Daemon)  # only its path handling, on a scratch workspace
    daemon.workspace = str(tmp_path)
    if other_makes == "folder":
        os.close(daemon._open_dir(["load"], "path", create=True))
        assert (tmp_path / "load").is_dir()
    else:
        with pytest.raises(pxd.RequestError, match="is a symlink"):
            daemon._open_dir(["load"], "path", create=True)


@pytest.mark.parametrize("key_len", [0, 1, 32, 63, 64, 65, 200])
def test_pxd_hmac_equals_the_standard_librarys(key_len):
    """pxd signs with the interpreter's built-in SHA-256, the client checks with ``hmac``: they agree
    for keys shorter than, equal to and longer than the block, on empty and long messages."""
    import hashlib
    import hmac

    from sandboxes import pxd

    key = os.urandom(key_len)
    for message in (b"", b"0\nHTTP/1.1 200 OK\n{}", os.urandom(70_000)):
        assert pxd.hmac_sha256(key, message) == hmac.new(key, message, hashlib.sha256).hexdigest()
