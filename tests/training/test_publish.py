"""Weight publication over real HTTP on loopback: sharded streams, hashes, volume copy."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import requests

from training.backends.torch_peft import TorchPeftBackend
from training.publish import AdapterPublisher, AdapterReceiver, newest_version


def test_publish_reaches_every_receiver_and_the_volume(tmp_path: Path, tiny_model_dir: Path):
    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4)
    backend.save_adapter(tmp_path / "out")
    receivers = [AdapterReceiver(tmp_path / f"replica{i}") for i in range(2)]
    try:
        publisher = AdapterPublisher(tmp_path / "volume", [r.url for r in receivers], streams=3)
        result = publisher.publish(7, tmp_path / "out")
        assert result.version == "step_000007" and result.replicas == 2
        want = hashlib.sha256((tmp_path / "out" / "adapter_model.safetensors").read_bytes()).hexdigest()
        for i, r in enumerate(receivers):
            got = (tmp_path / f"replica{i}" / "step_000007" / "adapter_model.safetensors").read_bytes()
            assert hashlib.sha256(got).hexdigest() == want
            assert r.loaded == ["step_000007"]
        assert newest_version(tmp_path / "volume")[0] == "step_000007"
        # a corrupted shard is refused, and the receiver names the shard
        resp = requests.put(f"{receivers[0].url}/adapters/step_000008/shards/0", data=b"xx", headers={"X-Sha256": "0"})
        assert resp.status_code == 400 and "shard 0" in resp.text
        with pytest.raises(ValueError, match="do not match"):
            receivers[0].commit("step_000009", {"size": 3, "sha256": "x", "adapter_config": {}})
    finally:
        for r in receivers:
            r.close()
