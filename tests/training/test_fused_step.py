"""The fused trainer-step kernels (``training.fused_step``) compute what the unfused step computes.

On the CPU in float64, where the two differ only by rounding: the hand-written decoder layer of
``recompute="attention_output"`` and the frozen-head log-probabilities, through
``TorchPeftBackend.train_step`` (``fused_kernels=True`` against ``False``) on a real tiny Qwen3 with
a peft LoRA, uneven right-padded rows in several micro-batches and the KL term on; each elementwise
kernel's backward against autograd of its forward; the head against ``log_softmax`` over all
logits. The compiled (Triton) forms run on CUDA only and are checked there at first use against
these eager forms (``chosen_step_kernels``); the device run is in docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training import fused_step
from training.backends.torch_peft import TorchPeftBackend
from training.grpo import LossConfig, TrainBatch
from training.logprobs import full_vocabulary_token_logprobs

from .test_recompute_backend import _save_tiny_qwen3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return _save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-fused"))


def _batch() -> TrainBatch:
    return TrainBatch(
        input_ids=[[1, 5, 7, 9, 11, 3, 8], [1, 5, 8], [2, 3, 4, 6, 10, 12, 13, 20, 21], [2, 3, 4, 14]],
        loss_mask=[[0, 0, 1, 1, 1, 1, 1], [0, 0, 1], [0, 0, 0, 1, 0, 1, 1, 1, 1], [0, 0, 0, 1]],
        serving_logprobs=[[0, 0, -4.0, -4.1, -4.2, -4.0, -3.9], [0, 0, -4.0], [0, 0, 0, -4.3, 0, -4.0, -4.1, -4.2, -4.0],
                          [0, 0, 0, -4.2]],
        advantages=[0.5, -0.5, 0.75, -0.75],
    )


def _backend(model_dir: Path, recompute: str, fused: bool) -> TorchPeftBackend:
    backend = TorchPeftBackend(model_dir, lora_rank=4, seed=3, micro_batch_tokens=16, max_grad_norm=1e9,
                               learning_rate=1e-2, recompute=recompute, dtype="float64", fused_kernels=fused)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:  # a fresh adapter's B is zero, which would hide A's gradient
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    backend.refresh_masters()
    return backend


@pytest.mark.parametrize("recompute", ["attention_output", "none"])
def test_fused_step_matches_the_unfused_step(qwen3_dir, recompute, monkeypatch):
    """Loss, KL, gradient norm, every LoRA gradient and the adapter after two steps agree to float64
    rounding; the fused layer runs once per layer and micro-batch with gradients, the fused head once
    per such micro-batch (``none`` keeps Hugging Face's layers and fuses only the head)."""
    calls = {"layer": 0, "head": 0}
    layer_apply = fused_step.FusedKeepAttentionOutput.apply
    head_apply = fused_step._FrozenHeadTokenLogprobs.apply
    monkeypatch.setattr(fused_step.FusedKeepAttentionOutput, "apply",
                        lambda *a: calls.__setitem__("layer", calls["layer"] + 1) or layer_apply(*a))
    monkeypatch.setattr(fused_step._FrozenHeadTokenLogprobs, "apply",
                        lambda *a: calls.__setitem__("head", calls["head"] + 1) or head_apply(*a))

    def steps(fused):
        backend = _backend(qwen3_dir, recompute, fused)
        first = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
        grads = {n: p.grad.clone() for n, p in zip(range(len(backend.masters)), backend.masters)}
        second = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
        return first, second, grads, backend.adapter_state_dict()

    ref_first, ref_second, ref_grads, ref_adapter = steps(False)
    assert calls == {"layer": 0, "head": 0}
    first, second, grads, adapter = steps(True)
    # 2 steps x 3 micro-batches with gradients (the KL reference pass is no_grad: 3 more head calls)
    assert calls == {"layer": 2 * 3 * 2 if recompute == "attention_output" else 0, "head": 2 * 3 * 2}

    for got, ref in ((first, ref_first), (second, ref_second)):
        assert got.tokens == ref.tokens == 12
        assert got.loss == pytest.approx(ref.loss, rel=1e-10, abs=1e-12)
        assert got.kl == pytest.approx(ref.kl, rel=1e-8, abs=1e-12)
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-10)
    assert len(grads) == 2 * 7 * 2
    for i, g in grads.items():
        assert ref_grads[i].norm() > 0, i
        assert _rel(g, ref_grads[i]) < 1e-10, (i, _rel(g, ref_grads[i]))
    assert adapter.keys() == ref_adapter.keys()
    for name, w in adapter.items():
        assert _rel(w, ref_adapter[name]) < 1e-12, name


def test_a_layer_that_does_not_qualify_runs_the_unfused_scheme(tiny_model_dir):
    """The tiny Qwen2 (biases on q/k/v, no q/k norm) keeps the autograd scheme, with the reason."""
    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4, recompute="attention_output", fused_kernels=True)
    layer = next(m for m in backend.model.modules() if type(m).__name__ == "Qwen2DecoderLayer")
    parts, why = fused_step.fused_layer_parts(layer)
    assert parts is None and "Qwen3" in why
    result = backend.train_step(_batch(), LossConfig())
    assert result.tokens == 12 and result.loss == result.loss


def _autograd_check(forward, backward, inputs, grad_index, grad_out):
    x = inputs[grad_index].clone().requires_grad_(True)
    args = list(inputs)
    args[grad_index] = x
    out = forward(*args)
    (expected,) = torch.autograd.grad(out, x, grad_out)
    return _rel(backward, expected)


def test_elementwise_backwards_match_autograd():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tokens, heads, d, hidden = 11, 3, 8, 24
    angle = rand(tokens, d // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    x, w, g = rand(tokens, heads, d), rand(d), rand(tokens, heads, d)
    got = fused_step.qk_norm_rope_backward(g, x, w, cos, sin, 1e-6)
    assert _autograd_check(fused_step.qk_norm_rope, got, (x, w, cos, sin, 1e-6), 0, g) < 1e-12

    x, w, g, res = rand(tokens, hidden), rand(hidden), rand(tokens, hidden), rand(tokens, hidden)
    got = fused_step.rms_norm_backward(g, x, w, 1e-6, res) - res
    assert _autograd_check(lambda x: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6), got, (x,), 0, g) < 1e-12

    gate, up, g = rand(tokens, hidden) * 3, rand(tokens, hidden), rand(tokens, hidden)
    act, d_gate, d_up = fused_step.swiglu_backward(gate, up, g)
    assert _rel(act, torch.nn.functional.silu(gate) * up) < 1e-14
    assert _autograd_check(lambda a, b: torch.nn.functional.silu(a) * b, d_gate, (gate, up), 0, g) < 1e-12
    assert _autograd_check(lambda a, b: torch.nn.functional.silu(a) * b, d_up, (gate, up), 1, g) < 1e-12


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_frozen_head_logprobs_match_log_softmax(chunk):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (2, 9), generator=gen)
    grad = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    got = fused_step.frozen_head_token_logprobs(hidden, weight, targets, chunk)
    (got_grad,) = torch.autograd.grad(got, hidden, grad)
    ref = full_vocabulary_token_logprobs(hidden, weight, targets)
    (ref_grad,) = torch.autograd.grad(ref, hidden, grad)
    assert got.dtype == torch.float64 and got.shape == targets.shape
    assert _rel(got, ref) < 1e-13 and _rel(got_grad, ref_grad) < 1e-12


def test_frozen_head_refuses_a_trained_head():
    weight = torch.zeros(5, 4, requires_grad=True)
    with pytest.raises(ValueError, match="requires a gradient"):
        fused_step.frozen_head_token_logprobs(torch.zeros(3, 4), weight, torch.zeros(3, dtype=torch.long), 2)


def test_step_kernels_are_checked_once_and_eager_on_the_cpu():
    choice = fused_step.chosen_step_kernels("cpu", torch.float32)
    assert choice.kernels is fused_step.EAGER_KERNELS and not choice.rejected
    assert set(choice.errors) == {"qk_norm_rope", "qk_norm_rope_backward", "rms_norm_backward", "swiglu",
                                  "swiglu_backward", "logsumexp_softmax"}
    assert all(e < 1e-5 for e in choice.errors.values())
    assert fused_step.chosen_step_kernels("cpu", torch.float32) is choice


def test_step_kernels_that_disagree_are_passed_over(monkeypatch):
    """A kernel set whose output is wrong is rejected with its errors named, as attention kernels are."""
    wrong = fused_step.EAGER_KERNELS._replace(name="wrong", swiglu=lambda g, u: fused_step.swiglu(g, u) * 1.1)
    errors = fused_step.check_step_kernels(wrong, "cpu", torch.float32)
    assert errors["swiglu"] > 0.05 and errors["rms_norm_backward"] < 1e-5
