"""Security promises that are not the escape suite itself: the engine, the router, the simulated
fleet and the capture sidecar listen on loopback unless told otherwise and pxd only on a pipe or a
unix socket; no secret from the environment reaches a log, a run file, or a sandbox; the escape suite
(tests/sandboxes/test_security.py) is collected for both real runtimes and CI installs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes.runtimes import compiled_pxd
from tests.reliability.conftest import REPO

SECRET = "s3cr3t-6f1d0c2a9b-do-not-log"
SECRET_ENV = {"HF_TOKEN": SECRET, "WANDB_API_KEY": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET, "OPENAI_API_KEY": SECRET}


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # LISTEN
                addr, port = local.split(":")
                if width == 8:
                    address = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                else:
                    address = "::1" if addr == "0" * 24 + "01000000" else ("::" if set(addr) == {"0"} else addr)
                found.append((address, int(port, 16)))
    return found


def _start(cmd: list[str], ready: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"{cmd} exited: {''.join(lines)}"
        lines.append(line)
        if ready in line:
            return proc, "".join(lines)


@pytest.fixture(scope="module")
def tiny_engine_model(tmp_path_factory):
    from serving.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGKILL)
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    return out


@pytest.mark.parametrize("name", ["engine", "router", "sim"])
def test_servers_listen_on_loopback_by_default(name, tiny_engine_model):
    """Started with their documented commands and no --host: every listening socket is 127.0.0.1."""
    cmd = {
        "engine": [sys.executable, "-m", "serving.local_engine", "--model", str(tiny_engine_model), "--port", "0"],
        "router": [sys.executable, "-m", "serving.router", "--port", "0"],
        "sim": [sys.executable, "-m", "serving.sim", "--replicas", "2x1"],
    }[name]
    proc, _ = _start(cmd, ready={"engine": " on http", "router": " on http", "sim": "ready"}[name])
    try:
        sockets = _listening(proc.pid)
        assert sockets, f"{name} listens on nothing"
        assert all(addr == "127.0.0.1" for addr, _ in sockets), sockets
    finally:
        _stop(proc)


def test_in_process_servers_default_to_loopback():
    import inspect

    from serving.fleet import LocalFleet
    from serving.capture import serve_sidecar
    from serving.http import JsonServer, serve
    from serving.router.server import serve_router

    for fn in (serve, serve_router, serve_sidecar, JsonServer.__init__, LocalFleet.__init__):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn


def test_pxd_offers_no_tcp_listener():
    """pxd takes exactly one of --stdio or --socket (a unix socket path); it has no TCP option."""
    source = (REPO / "sandboxes" / "pxd.py").read_text()
    assert "AF_INET" not in source and ".bind((" not in source
    done = subprocess.run([sys.executable, str(compiled_pxd(sys.executable)), "--workspace", "/tmp", "--port", "8080"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "(--stdio | --socket PATH)" in done.stderr


def _files_containing(root: Path, needle: str) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and needle.encode() in path.read_bytes():
            hits.append(str(path))
    return hits


def test_no_secret_from_the_environment_reaches_trainer_output_or_run_files(tmp_path, tiny_model_dir):
    """A trainer run (its engine replica included) with tokens in its environment: neither its output
    nor any file of the run (logs, metrics, checkpoints, plan, config) contains them."""
    cfg = {"run_name": "secrets", "base_model": str(tiny_model_dir), "steps": 2, "groups_per_step": 1, "group_size": 2,
           "producer_workers": 0, "checkpoint_every": 1, "lora_rank": 4, "max_new_tokens": 4, "seed": 1,
           "environment": "tests.reliability.faulty_env:make"}
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    env = {**os.environ, **SECRET_ENV, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    done = subprocess.run([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert _files_containing(run, SECRET) == []


def test_no_secret_reaches_engine_or_router_output_even_on_errors(tiny_engine_model):
    """Engine and router processes with tokens in their environment, fed bad requests and a crash of
    a replica: nothing they print contains the tokens."""
    from serving.capture_store import trainer_headers
    from serving.client import HttpPool

    engine, _ = _start([sys.executable, "-m", "serving.local_engine", "--model", str(tiny_engine_model), "--port", "0"],
                       " on http", SECRET_ENV)
    outputs = []
    try:
        url = next(f"http://127.0.0.1:{port}" for _, port in _listening(engine.pid))
        router, _ = _start([sys.executable, "-m", "serving.router", "--port", "0", "--worker", url], " on http", SECRET_ENV)
        try:
            rurl = next(f"http://127.0.0.1:{port}" for _, port in _listening(router.pid))
            pool = HttpPool(timeout_s=60)
            for target in (url, rurl):
                pool.request("POST", f"{target}/generate", b"{not json")
                pool.request("POST", f"{target}/generate", json.dumps({"input_ids": [1], "lora_path": SECRET[:5]}).encode())
                pool.request("POST", f"{target}/load_lora_adapter", json.dumps({"lora_name": "x", "lora_path": "/nope"}).encode())
            pool.json("POST", f"{rurl}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "rid": "a"},
                      trainer_headers())  # the processes inherit this one's credential
            outputs.append(_stop(engine))  # the replica dies under the router
            pool.request("POST", f"{rurl}/generate", json.dumps({"input_ids": [1, 2], "rid": "a"}).encode())
        finally:
            outputs.append(_stop(router))
    finally:
        if engine.poll() is None:
            outputs.append(_stop(engine))
    assert SECRET not in "".join(outputs)


@pytest.mark.parametrize("runtime", [
    pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")),
    pytest.param("gvisor", marks=pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc not installed")),
])
def test_host_secrets_do_not_enter_a_sandbox(tmp_path, monkeypatch, runtime):
    """The agent's commands (whose output becomes observations, stored in rollouts and eval rows) see
    none of the host's environment tokens: not in their environment, nor in any process's
    ``/proc/PID/environ`` (bwrap stays in the sandbox as its pid 1)."""
    import sandboxes
    from tests.sandboxes.conftest import make_repo

    for key, value in SECRET_ENV.items():
        monkeypatch.setenv(key, value)
    repo = make_repo(tmp_path / "repo")
    store, cache = sandboxes.ImageStore(tmp_path / "images"), sandboxes.LayerCache(tmp_path / "cache")
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
        out = sb.exec("env; for f in /proc/[0-9]*/environ; do echo $f; cat $f 2>&1 | tr '\\0' '\\n'; done").output
    assert "/proc/1/environ" in out
    assert SECRET not in out and "HF_TOKEN" not in out


def test_escape_suite_is_collected_for_both_real_runtimes_and_ci_installs_them():
    """tests/sandboxes/test_security.py (network, host files, fork and memory bombs, output flood,
    endless command, disk limit, pxd path traversal) runs per runtime; CI (.ci/run -> scripts/test.sh
    -> scripts/setup.sh) installs bubblewrap and runsc, so neither is skipped there."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/sandboxes/test_security.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    for attack in ("network", "host_files", "fork_bomb", "memory_bomb", "path_traversal", "output_flood", "disk_limit"):
        for runtime in ("bwrap", "gvisor"):
            assert any(attack in i and f"[{runtime}]" in i for i in ids), (attack, runtime, ids)
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(r"apt_packages=\(.*bubblewrap.*runsc", setup)
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert "pytest" in test_sh and "tests/" not in test_sh.split("pytest", 1)[1].split("\n")[0].replace('"$@"', "")
