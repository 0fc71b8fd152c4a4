"""The trainer's local engine replicas: how many and with which settings (the trainer config, or the
resolved plan's ``inference`` table), and weight publication to a fleet whose members change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import TrainConfig
from training.episodes import engine_kwargs
from training.publish import AdapterPublisher


def _plan(tmp_path: Path, inference: dict, trainer: dict | None = None) -> Path:
    path = tmp_path / "resolved-plan.json"
    path.write_text(json.dumps({"trainer": {"base_model": "m", **(trainer or {})}, "inference": inference}))
    return path


def test_a_cpu_plans_engines_and_local_engine_args_reach_the_trainer(tmp_path: Path):
    args = ["--max-running-requests", "32", "--max-total-tokens", "131072"]
    cfg = TrainConfig.load(_plan(tmp_path, {"gpu": "cpu", "engines": 3, "local_engine_args": args}))
    assert (cfg.replicas, cfg.engine_max_running_requests, cfg.engine_max_total_tokens) == (3, 32, 131072)
    assert engine_kwargs(cfg) == {"torch_threads": 1, "max_lora_rank": 16, "max_total_tokens": 131072,
                                  "max_running_requests": 32}
    # The trainer table wins over the inference table.
    cfg = TrainConfig.load(_plan(tmp_path, {"gpu": "cpu", "engines": 3, "local_engine_args": args}, {"replicas": 1}))
    assert cfg.replicas == 1
    # A GPU plan's engines are SGLang pods, not the trainer's: nothing changes.
    cfg = TrainConfig.load(_plan(tmp_path, {"gpu": "h200", "engines": 4, "local_engine_args": None}))
    assert (cfg.replicas, cfg.engine_max_total_tokens, cfg.engine_max_running_requests) == (1, 0, 0)
    assert engine_kwargs(TrainConfig(base_model="m")) == {"torch_threads": 1, "max_lora_rank": 16}
    # vLLM serves adapters up to --max-lora-rank, which takes a few values: the trainer's rank rounds up.
    assert engine_kwargs(TrainConfig(base_model="m", lora_rank=24))["max_lora_rank"] == 32
    with pytest.raises(ValueError, match="'replicas' must be >= 1"):
        TrainConfig.from_mapping({"base_model": "m", "replicas": 0})


def test_publication_to_a_live_fleet_skips_a_replica_that_left_it(tmp_path: Path, tiny_model_dir: Path):
    """Receivers given as a function are read at each publication; a replica that fails its push and
    is no longer among them is skipped (its replacement loads the version from the volume); one that
    fails while still listed is an error, as with a fixed list."""
    from serving.client import EngineClient
    from serving.local_engine import LocalEngine
    from serving.http import serve
    from training.backends.torch_peft import TorchPeftBackend

    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4)
    backend.save_adapter(tmp_path / "out")
    servers = [serve(LocalEngine(tiny_model_dir, torch_threads=1)) for _ in range(2)]
    urls = [s.url for s in servers]
    views = [urls]  # what the fleet answers, read by read: the last one stays

    def live_urls() -> list[str]:
        return list(views.pop(0) if len(views) > 1 else views[0])

    try:
        publisher = AdapterPublisher(tmp_path / "volume", live_urls, streams=2, gone_wait_s=0.5)
        assert publisher.publish(1, tmp_path / "out").replicas == 2
        servers[1].shutdown()  # dies; the fleet notices only after the next publication has started
        views[:] = [urls, urls[:1]]
        result = publisher.publish(2, tmp_path / "out")
        assert result.replicas == 1 and (tmp_path / "volume" / "step_000002").is_dir()
        assert "step_000002" in EngineClient(urls[0]).server_info()["loaded_adapters"]
        views[:] = [urls]  # still listed: the failure is not the fleet's doing, and is an error
        with pytest.raises(OSError):
            publisher.publish(3, tmp_path / "out")
    finally:
        servers[0].shutdown()
