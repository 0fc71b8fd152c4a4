"""The trainer's view of a cluster's fleet: a router it is given (``POSTTRAIN_ROUTER_URL``), with
the replicas behind it. Real parts on loopback: two engine servers (the project's engine on the tiny
model, behind the serving HTTP layer), the router as its own process started with the command its
Deployment runs, and the trainer side (:class:`training.remote_fleet.RemoteFleet`, the
publisher, the fleet environment's group runner)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.replica import free_port
from training.config import TrainConfig
from training.curriculum import Curriculum
from training.episodes import fleet_environment
from training.loop import AdapterRef
from training.publish import AdapterPublisher
from training.remote_fleet import RemoteFleet, RouterUnreachable


@pytest.fixture
def cluster_like(tmp_path: Path, tiny_model_dir: Path):
    """Two engines and a router process in front of them, as the cluster's Deployment runs it."""
    from serving.local_engine import LocalEngine
    from serving.http import serve

    engines = [serve(LocalEngine(tiny_model_dir, torch_threads=1)) for _ in range(2)]
    volume = tmp_path / "run" / "adapters"
    volume.mkdir(parents=True)
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "serving.router", "--host", "127.0.0.1", "--port", str(port),
                               "--policy", "kv_headroom", *[a for e in engines for a in ("--worker", e.url)],
                               "--adapters-volume", str(volume)])
    try:
        yield f"http://127.0.0.1:{port}", [e.url for e in engines], volume
    finally:
        router.terminate()
        router.wait(timeout=30)
        for e in engines:
            e.shutdown()


def test_adapters_reach_every_replica_and_episodes_go_through_the_routers_sessions(cluster_like, tmp_path, tiny_model_dir):
    from tests.training.envs import EngineRunner
    from training.backends.torch_peft import TorchPeftBackend

    url, engine_urls, volume = cluster_like
    fleet = RemoteFleet(url, wait_s=120, log=lambda line: None)
    deadline = time.monotonic() + 60
    while sorted(fleet.receivers()) != sorted(engine_urls) and time.monotonic() < deadline:
        time.sleep(0.2)  # workers join once they answer
    assert sorted(fleet.receivers()) == sorted(engine_urls)

    # publication: HTTP shards to each replica the router lists, and the volume copy for late joiners
    TorchPeftBackend(tiny_model_dir, lora_rank=4).save_adapter(tmp_path / "out")
    published = AdapterPublisher(volume, fleet.receivers, streams=2).publish(1, tmp_path / "out")
    assert published.replicas == 2 and (volume / "step_000001").is_dir()

    cfg = TrainConfig(base_model=str(tiny_model_dir), max_new_tokens=4)
    env = fleet_environment(cfg, tmp_path / "run", lambda router_url: EngineRunner(router_url, cfg, vocab_size=64),
                            Curriculum.from_pass_rates({"count-a": 0.5}, seed=0), fleet=fleet)
    try:
        adapter = AdapterRef(1, "step_000001", volume / "step_000001")
        rollouts = list(env.runner.run_group("count-a", adapter, "g000001", 2, seed=3))
        assert [len(r.input_ids) for r in rollouts] == [4 + 4, 4 + 4]
        assert all(r.adapter_step == 1 for r in rollouts)
        assert sorted(env.receivers()) == sorted(engine_urls)
        workers = fleet._call("GET", "/workers")["workers"]
        assert all("step_000001" in w["adapters"] for w in workers)  # the router was told (announce)
        assert all(w["live_sessions"] == 0 for w in workers)  # the group's sessions were ended
    finally:
        env.close()


def test_a_router_that_does_not_answer_is_named():
    port = free_port()
    with pytest.raises(RouterUnreachable, match=rf"router http://127.0.0.1:{port} \(POSTTRAIN_ROUTER_URL\): GET /health"):
        RemoteFleet(f"http://127.0.0.1:{port}", wait_s=0.5, log=lambda line: None)
    with pytest.raises(ValueError, match="POSTTRAIN_ROUTER_URL: expected the router's http:// address"):
        RemoteFleet("router:30100")
