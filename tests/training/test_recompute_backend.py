"""The torch/peft trainer backend's ``recompute`` option gives the step of the backend without it.

Real tiny Hugging Face Qwen2 and Qwen3 folders with peft LoRA on the CPU (PyTorch's CPU flash kernels
return the log-sum-exp like the CUDA ones): one GRPO step on a batch of uneven, right-padded rows
split into several micro-batches, with the KL term on (its reference pass runs under ``no_grad``
through the layers' own forward), compared with ``recompute="none"``: loss, gradient norm, every
LoRA gradient and the adapter after the step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from training import recompute as recompute_module
from training.backends.torch_peft import TorchPeftBackend
from training.grpo import LossConfig, TrainBatch


def _save_tiny_qwen3(path: Path, vocab_size: int = 64, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # ones would hide a q/k norm left out
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> Path:
    if request.param == "qwen2":
        return tiny_model_dir
    return _save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def _batch() -> TrainBatch:
    return TrainBatch(
        input_ids=[[1, 5, 7, 9, 11, 3, 8], [1, 5, 8], [2, 3, 4, 6, 10, 12, 13, 20, 21], [2, 3, 4, 14]],
        loss_mask=[[0, 0, 1, 1, 1, 1, 1], [0, 0, 1], [0, 0, 0, 1, 0, 1, 1, 1, 1], [0, 0, 0, 1]],
        serving_logprobs=[[0, 0, -4.0, -4.1, -4.2, -4.0, -3.9], [0, 0, -4.0], [0, 0, 0, -4.3, 0, -4.0, -4.1, -4.2, -4.0],
                          [0, 0, 0, -4.2]],
        advantages=[0.5, -0.5, 0.75, -0.75],
    )


def _backend(model_dir: Path, recompute: str) -> TorchPeftBackend:
    backend = TorchPeftBackend(model_dir, lora_rank=4, seed=3, micro_batch_tokens=16,
                               max_grad_norm=1e9, learning_rate=1e-2, recompute=recompute)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:  # a fresh adapter's B is zero, which would hide A's gradient
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return backend


def _step(backend: TorchPeftBackend):
    result = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    return result, grads, backend.adapter_state_dict()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("recompute", ["attention_output", "full"])
def test_backend_step_matches_no_recomputation(model_dir, recompute, monkeypatch):
    calls = []
    apply = recompute_module.KeepAttentionOutput.apply
    monkeypatch.setattr(recompute_module.KeepAttentionOutput, "apply", lambda *a: calls.append(1) or apply(*a))

    ref, ref_grads, ref_adapter = _step(_backend(model_dir, "none"))
    assert not calls
    result, grads, adapter = _step(_backend(model_dir, recompute))
    if recompute == "attention_output":
        assert len(calls) == 2 * 3  # two layers, three micro-batches with gradients (not the KL reference)
    else:
        assert not calls

    assert result.tokens == ref.tokens == 12
    assert result.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-6)
    assert result.kl == pytest.approx(ref.kl, rel=1e-4, abs=1e-7)
    assert result.grad_norm == pytest.approx(ref.grad_norm, rel=1e-4)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * 2
    for name, g in grads.items():
        assert ref_grads[name].norm() > 0, name
        assert _rel(g, ref_grads[name]) < 1e-4, (name, _rel(g, ref_grads[name]))
    assert adapter.keys() == ref_adapter.keys()
    for name, w in adapter.items():
        assert _rel(w, ref_adapter[name]) < 1e-5, name


def test_attention_output_recomputation_never_reruns_attention_or_the_down_product(tiny_model_dir, monkeypatch):
    """Per layer and micro-batch: one attention forward, one backward, one frozen down product."""
    backend = _backend(tiny_model_dir, "attention_output")
    counts = {"attention forward": 0, "attention backward": 0, "down product": 0}
    kernels = recompute_module.attention_kernels("cpu")

    def forward(*a):
        counts["attention forward"] += 1
        return kernels.forward(*a)

    def backward(*a):
        counts["attention backward"] += 1
        return kernels.backward(*a)

    counting = recompute_module.AttentionKernels("counting", forward, backward)
    monkeypatch.setattr(recompute_module, "attention_kernels", lambda device, *a, **k: counting)
    down_weights = {id(layer.mlp.down_proj.base_layer.weight) for layer in backend.model.base_model.model.model.layers}

    class CountDownProducts(TorchFunctionMode):
        """Counts forward products ``x @ W_down.T`` (``F.linear`` with a frozen down weight)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear and len(args) > 1 and id(args[1]) in down_weights:
                counts["down product"] += 1
            return func(*args, **(kwargs or {}))

    batch = TrainBatch(input_ids=[[1, 5, 7, 9, 11]], loss_mask=[[0, 0, 1, 1, 1]],
                       serving_logprobs=[[0, 0, -4.0, -4.0, -4.0]], advantages=[1.0])
    with CountDownProducts():
        backend.train_step(batch, LossConfig(kl_coef=0.0))
    assert counts == {"attention forward": 2, "attention backward": 2, "down product": 2}


def test_attention_output_recomputation_refuses_left_padding(tiny_model_dir):
    backend = _backend(tiny_model_dir, "attention_output")
    ids = torch.tensor([[0, 1, 5, 7], [1, 5, 7, 9]])
    with pytest.raises(ValueError, match="right-padded"):
        backend.token_logprobs(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))


def test_unknown_recompute_mode_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="recompute must be one of none, full, attention_output"):
        TorchPeftBackend(tiny_model_dir, recompute="selective")


@pytest.mark.parametrize("recompute", ["full", "attention_output"])
def test_megatron_backend_says_why_it_does_not_recompute(tiny_model_dir, recompute):
    """The option is the same as the torch/peft backend's; the refusal comes before Megatron is
    imported or a process group is made, and names the reason and where recomputation runs."""
    from training.backends.megatron import MegatronBackend

    with pytest.raises(NotImplementedError, match=r"keeps every activation .* all-reduces .* torch_peft backend"):
        MegatronBackend(tiny_model_dir, recompute=recompute, device="cpu")
    with pytest.raises(ValueError, match="recompute must be one of none, full, attention_output"):
        MegatronBackend(tiny_model_dir, recompute="selective", device="cpu")
