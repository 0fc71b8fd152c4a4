"""Weight publication over real HTTP on loopback: every live replica (the local engine behind the
serving HTTP layer) loads the new version from parallel shards, and the volume gets a copy."""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors.torch import load_file

from serving.adapters import newest_adapter
from training.backends.torch_peft import TorchPeftBackend
from training.publish import AdapterPublisher


def test_publish_reaches_every_replica_and_the_volume(tmp_path: Path, tiny_model_dir: Path):
    from serving.client import EngineClient
    from serving.local_engine import LocalEngine
    from serving.http import serve

    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4)
    servers = [serve(LocalEngine(tiny_model_dir, torch_threads=1)) for _ in range(2)]
    try:
        publisher = AdapterPublisher(tmp_path / "volume", [s.url for s in servers], streams=3, keep_versions=2)
        for step in (1, 2, 3):
            backend.save_adapter(tmp_path / f"out{step}")
            result = publisher.publish(step, tmp_path / f"out{step}")
            assert result.version == f"step_{step:06d}" and result.replicas == 2
        for s in servers:
            assert sorted(EngineClient(s.url).server_info()["loaded_adapters"]) == ["step_000002", "step_000003"]
        version, path = newest_adapter(tmp_path / "volume")
        assert version == "step_000003"
        sent = load_file(str(tmp_path / "out3" / "adapter_model.safetensors"))
        stored = load_file(str(Path(path) / "adapter_model.safetensors"))
        assert sent.keys() == stored.keys() and all((sent[k] == stored[k]).all() for k in sent)
        out = EngineClient(servers[0].url).generate([1, 2, 3], {"max_new_tokens": 3}, return_logprob=True,
                                                    lora_path="step_000003")
        assert len(out["output_ids"]) == 3
    finally:
        for s in servers:
            s.shutdown()


def test_a_version_in_use_stays_loaded_until_a_publication_after_its_groups_end(tmp_path: Path, tiny_model_dir: Path):
    """``in_use`` (the trainer's groups in flight) keeps a version loaded past ``keep_versions``;
    the first publication after it is free unloads it."""
    from serving.client import EngineClient
    from serving.local_engine import LocalEngine
    from serving.http import serve

    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4)
    server = serve(LocalEngine(tiny_model_dir, torch_threads=1))
    busy = {"step_000001"}
    try:
        publisher = AdapterPublisher(None, [server.url], streams=2, keep_versions=1, in_use=lambda: set(busy))
        backend.save_adapter(tmp_path / "out")
        for step in (1, 2, 3):
            publisher.publish(step, tmp_path / "out")
        assert sorted(EngineClient(server.url).server_info()["loaded_adapters"]) == ["step_000001", "step_000003"]
        out = EngineClient(server.url).generate([1, 2, 3], {"max_new_tokens": 2}, lora_path="step_000001")
        assert len(out["output_ids"]) == 2  # the group's next turn is still served on its version
        busy.clear()
        publisher.publish(4, tmp_path / "out")
        assert EngineClient(server.url).server_info()["loaded_adapters"] == ["step_000004"]
    finally:
        server.shutdown()
