"""A replica process (``python -m serving.replica``): the engine server as its child, the capture
front on the replica's port, and nothing left running once the process that started it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dagster_project.processes import descendants
from serving.client import EngineClient
from serving.replica import replica_command

WAIT_S = 60.0  # the most a test waits for processes to go; processes that never go fail the test


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    return [pid, *sorted(descendants(pid))]


def test_a_vllm_replica_and_its_engine_exit_when_their_starter_is_sigkilled(tiny_model, tmp_path):
    """The trainer (here a script) starts a replica and is SIGKILLed: the replica, vLLM's API
    server and vLLM's engine processes all exit."""
    repo = Path(__file__).resolve().parents[2]
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from serving.fleet import start_engine
        proc, url = start_engine({str(tiny_model)!r}, Path({str(tmp_path / 'replica.log')!r}), engine="vllm")
        print(proc.pid, url, flush=True)
        time.sleep(600)
    """)
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=repo,
                               env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        pid, url = starter.stdout.readline().split()
        assert EngineClient(url).server_info()["engine"] == "vllm"
        tree = _tree(int(pid))
        assert len(tree) >= 3, tree  # the replica, vLLM's API server and its engine core at least
        workdir = Path(os.readlink(f"/proc/{tree[1]}/cwd"))  # the engine's own folder, its IPC sockets in it
        assert workdir.name.startswith("posttrain-vllm-") and any(p.is_socket() for p in workdir.iterdir())
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            time.sleep(0.2)
        left = [p for p in tree if _alive(p)]
        assert not left, f"processes {left} of the replica outlived its SIGKILLed starter"
        assert not workdir.exists(), f"the replica left {workdir} behind"
    finally:
        starter.kill()
        starter.wait()


def test_a_fleet_of_local_engine_replicas_serves_through_the_front(tiny_model, tmp_path):
    """``--engine local``: the project's engine behind the same front; the fleet reads the banner."""
    from serving.fleet import LocalFleet
    from serving.router.core import Router
    from serving.router.server import serve_router

    router = Router("kv_headroom", poll_interval_s=0.2)
    fleet = LocalFleet(tiny_model, router, mode="process", engine="local", engine_kwargs={"torch_threads": 1},
                       log_dir=tmp_path / "logs")
    server = serve_router(router, port=0)
    try:
        [url] = fleet.scale_up(1)
        assert EngineClient(url).server_info()["engine"] == "local"
        client = EngineClient(server.url)
        context = list(range(20, 60))
        for _ in range(2):
            out = client.generate(context, {"max_new_tokens": 4, "ignore_eos": True}, session_id="s/1")
            context += out["output_ids"] + [3]
        calls = client.session("s/1")
        assert [c["engine"] for c in calls] == ["local", "local"]
        assert calls[0]["request_id"] != calls[1]["request_id"]
        [proc] = fleet.members.values()
        tree = _tree(proc.pid)
        assert len(tree) == 2, tree  # the replica and its engine server
        workdir = Path(os.readlink(f"/proc/{tree[1]}/cwd"))
        assert workdir.name.startswith("posttrain-local-")
    finally:
        server.shutdown()
        fleet.shutdown()
        router.close()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.2)
    assert not any(_alive(p) for p in tree)
    assert not workdir.exists(), f"the replica left {workdir} behind"


def test_a_replica_whose_engine_cannot_start_says_so(tmp_path):
    from serving.fleet import start_engine

    with pytest.raises(RuntimeError, match="engine replica exited") as err:
        start_engine(str(tmp_path / "no-model"), tmp_path / "replica.log", engine="local")
    assert "replica.log" in str(err.value)
    assert "exited with" in (tmp_path / "replica.log").read_text()


def test_replica_command_names_a_setting_it_cannot_pass():
    cmd = replica_command("/m", engine="vllm", port=5, max_loras=3, kv_cache_gib=2)
    assert cmd[1:4] == ["-m", "serving.replica", "--engine"] and "--exit-with-parent" in cmd
    assert cmd[cmd.index("--max-loras") + 1] == "3" and cmd[cmd.index("--kv-cache-gib") + 1] == "2"
    with pytest.raises(ValueError, match="'gpu_memory'"):
        replica_command("/m", gpu_memory=3)
    with pytest.raises(ValueError, match="engine must be one of"):
        replica_command("/m", engine="tgi")


def test_sigterms_in_a_row_stop_a_replica_cleanly(tiny_model):
    """A replica asked to stop again while stopping (a fleet's shutdown terminates, then stops each
    replica) still stops its engine server, removes its folder and exits 0."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(replica_command(str(tiny_model), engine="local", torch_threads=1), cwd=repo,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert " on http" in proc.stdout.readline()
        [engine] = descendants(proc.pid)
        workdir = Path(os.readlink(f"/proc/{engine}/cwd"))
        while proc.poll() is None:  # SIGTERM every 10 ms until the replica has gone
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.01)
        assert proc.returncode == 0
        assert not workdir.exists(), f"the replica left {workdir} behind"
        assert not _alive(engine)
    finally:
        proc.kill()
        proc.wait()


def test_a_model_served_without_a_log_path_leaves_its_log_only_where_something_failed(tiny_model, tmp_path, monkeypatch):
    """evals.evaluate.served_model with no engine_log writes the replica's output in a temporary
    folder: removed after a block that ended cleanly, kept after one that raised."""
    import tempfile

    from evals.evaluate import served_model

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with served_model(tiny_model, engine="local") as (url, _tokenizer, _eos):
        [log] = tmp_path.glob("posttrain-eval-*/engine.log")
        assert EngineClient(url).health()
    assert not log.exists() and not list(tmp_path.glob("posttrain-eval-*"))
    with pytest.raises(RuntimeError, match="the block failed"):
        with served_model(tiny_model, engine="local"):
            raise RuntimeError("the block failed")
    [kept] = tmp_path.glob("posttrain-eval-*/engine.log")
    assert kept.stat().st_size > 0
