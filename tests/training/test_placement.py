"""The trainer-config keys ``device`` and ``dtype``: validated with errors naming the key, and passed
to the backend only when set (each backend keeps its own default otherwise). The GPU path itself
runs only where a GPU is (bench/recompute.py on the device); here the CPU and dtype paths run."""

from __future__ import annotations

import pytest
import torch

from training.config import TrainConfig


@pytest.mark.parametrize("key,value", [("device", "gpu0"), ("device", "cuda:x"), ("dtype", "int8")])
def test_bad_placement_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"key '{key}'"):
        TrainConfig.from_mapping({"base_model": "m", key: value})


def test_only_the_keys_set_reach_the_backend(tiny_model_dir):
    from training.backends.torch_peft import TorchPeftBackend

    assert TrainConfig(base_model="m").backend_placement() == {}
    cfg = TrainConfig.from_mapping({"base_model": str(tiny_model_dir), "device": "cpu", "dtype": "bfloat16"})
    assert cfg.backend_placement() == {"device": "cpu", "dtype": "bfloat16"}
    backend = TorchPeftBackend(cfg.base_model, **cfg.backend_placement())
    # the frozen base weights take the dtype (peft keeps the trainable LoRA weights in float32)
    assert {p.dtype for p in backend.model.parameters() if not p.requires_grad} == {torch.bfloat16}
