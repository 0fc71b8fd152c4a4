"""Attention-output recomputation gives the gradients of the model that keeps every activation.

Runs on the CPU with PyTorch's CPU flash-attention kernels (which return the log-sum-exp, like the
CUDA ones) on a tiny Qwen3-shaped decoder in float64 and float32. The kernel selection is checked
here too: candidates that raise (CUDA-only kernels on the CPU) or disagree with the float32 reference
are passed over, with the reason kept.
"""

from __future__ import annotations

import math

import pytest
import torch

from training.attention import (
    CUDA_KERNEL_NAMES,
    AttentionKernels,
    attention_kernels,
    check_attention_kernels,
    chosen_attention_kernels,
    select_attention_kernels,
)
from training.reference_decoder import DecoderShape, Qwen3Decoder, layer_forward

TINY = DecoderShape(
    hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=97, lora_rank=4, lora_alpha=8.0,
)


def _model(dtype: torch.dtype, seed: int = 0) -> Qwen3Decoder:
    torch.manual_seed(seed)
    model = Qwen3Decoder(TINY, dtype=dtype, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.2)  # a fresh adapter's B is zero, which would hide A's gradient
            elif name.endswith("norm"):
                p.uniform_(0.5, 1.5)
    return model


def _loss_and_grads(model: Qwen3Decoder, ids: torch.Tensor, recompute: str):
    model.zero_grad(set_to_none=True)
    hidden = model(ids[:, :-1], recompute=recompute)
    loss = -model.token_logprobs(hidden, ids[:, 1:], chunk_tokens=7).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("recompute", ["attention_output", "full"])
def test_gradients_match_no_recomputation(dtype, tol, recompute):
    model = _model(dtype)
    ids = torch.randint(0, TINY.vocab_size, (2, 20))
    ref_loss, ref_grads = _loss_and_grads(model, ids, "none")
    loss, grads = _loss_and_grads(model, ids, recompute)
    assert _rel(loss, ref_loss) < tol
    assert ref_grads.keys() == grads.keys() and len(grads) == 7 * 2 * TINY.num_layers
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert ref_grads[name].norm() > 0, name
        assert _rel(g, ref_grads[name]) < tol, (name, _rel(g, ref_grads[name]))


def test_layer_input_gradient_matches():
    """A layer whose input needs a gradient (every layer but the first) gets the same one."""
    model = _model(torch.float64, seed=1)
    layer = model.layers[0]
    cos, sin = model._rope_tables(9, model.embed)
    x = torch.randn(3, 9, TINY.hidden_size, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(3, 9, TINY.hidden_size, dtype=torch.float64)
    grads = {}
    for mode in ("none", "attention_output"):
        layer.zero_grad(set_to_none=True)
        y = layer_forward(layer, x, cos, sin, mode)
        (gx,) = torch.autograd.grad(y, [x], grad_y, retain_graph=True)
        y.backward(grad_y)
        grads[mode] = (y.detach(), gx, layer.q_proj.lora_a.grad.clone(), layer.down_proj.lora_b.grad.clone())
    for a, b in zip(grads["attention_output"], grads["none"]):
        assert _rel(a, b) < 1e-10


class _CountingKernels:
    def __init__(self, kernels):
        self.inner, self.forwards, self.backwards = kernels, 0, 0
        self.name = kernels.name

    def forward(self, *args):
        self.forwards += 1
        return self.inner.forward(*args)

    def backward(self, *args):
        self.backwards += 1
        return self.inner.backward(*args)


@pytest.mark.parametrize("recompute, forwards", [("none", 2), ("full", 4), ("attention_output", 2)])
def test_attention_forward_is_never_recomputed(recompute, forwards):
    model = _model(torch.float32)
    counter = _CountingKernels(attention_kernels("cpu"))
    for layer in model.layers:
        layer.kernels = counter
    ids = torch.randint(0, TINY.vocab_size, (1, 12))
    _loss_and_grads(model, ids, recompute)
    assert (counter.forwards, counter.backwards) == (forwards, TINY.num_layers)


@pytest.mark.parametrize("recompute, products", [("none", 2), ("full", 4), ("attention_output", 2)])
def test_frozen_down_product_is_not_recomputed(recompute, products, monkeypatch):
    """Backward reads only the down projection's input gradient, so ours skips its frozen product
    (counted at ``F.linear``: a full recomputation stops before the module returns)."""
    model = _model(torch.float32)
    down_weights = {id(layer.down_proj.weight) for layer in model.layers}
    calls = []
    linear = torch.nn.functional.linear

    def counting_linear(x, weight, *args):
        if id(weight) in down_weights:
            calls.append(1)
        return linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    _loss_and_grads(model, torch.randint(0, TINY.vocab_size, (1, 12)), recompute)
    assert len(calls) == products


def test_attention_keeps_only_input_output_and_lse():
    """What one layer keeps for backward: its input, the attention output and the log-sum-exp."""
    model = _model(torch.float32)
    layer = model.layers[1]
    b, s = 2, 11
    cos, sin = model._rope_tables(s, model.embed)
    x = torch.randn(b, s, TINY.hidden_size, requires_grad=True)
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer_forward(layer, x, cos, sin, "attention_output")
    shapes = sorted(tuple(t.shape) for t in kept)
    expected = sorted([
        (b, s, TINY.hidden_size),  # layer input
        (s, TINY.head_dim), (s, TINY.head_dim),  # shared rope tables, not per-layer memory
        (b, TINY.num_heads, s, TINY.head_dim),  # attention output
        (b, TINY.num_heads, s),  # log-sum-exp
    ])
    assert shapes == expected


def test_model_flops_count():
    shape = DecoderShape.qwen3("8b")
    # Qwen3-8B: 36 layers of 4096-wide projections, about 6.95e9 projection weights.
    assert math.isclose(shape.num_layers * shape.base_params_per_layer(), 6.946e9, rel_tol=1e-3)
    per_token = shape.train_flops_per_token(32768)
    attention = shape.num_layers * 6 * 32768 * 4096
    assert per_token > attention and math.isclose(per_token - attention, 4 * 6.946e9 + 4 * 4096 * 151936
                                                  + 6 * 36 * shape.lora_params_per_layer(), rel_tol=1e-3)


def test_unknown_mode_and_shape_are_named():
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer_forward(_model(torch.float32).layers[0], torch.zeros(1, 2, 48), None, None, "some")
    with pytest.raises(ValueError, match="unknown Qwen3 size"):
        DecoderShape.qwen3("3b")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DecoderShape(hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4,
                     intermediate_size=8, vocab_size=8)


def test_expanded_kv_kernels_agree_with_grouped_query_kernels():
    torch.manual_seed(3)
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 10, 8, dtype=torch.float64), torch.randn(2, 2, 10, 8, dtype=torch.float64)
    grad = torch.randn_like(q)
    results = []
    for expand in (False, True):
        kernels = attention_kernels("cpu", expand_kv=expand)
        out, lse, state = kernels.forward(q, k, v, 0.3)
        results.append((out, lse, *kernels.backward(grad, q, k, v, out, lse, state, 0.3)))
    for a, b in zip(*results):
        assert a.shape == b.shape and _rel(a, b) < 1e-12


# -- kernel selection ---------------------------------------------------------------------------


def _cpu_kernels():
    return attention_kernels("cpu")


def _raising(name: str, message: str) -> AttentionKernels:
    def forward(*args):
        raise RuntimeError(message)

    return AttentionKernels(name, forward, forward)


def _wrong_gradients(name: str) -> AttentionKernels:
    """Right forward, a backward whose dq is off by 10%: what a broken kernel build can return."""
    inner = _cpu_kernels()

    def backward(*args):
        dq, dk, dv = inner.backward(*args)
        return dq * 1.1, dk, dv

    return AttentionKernels(name, inner.forward, backward)


def _grouped_query_unsupported(name: str) -> AttentionKernels:
    """Kernels that refuse k/v with fewer heads than q, as some builds do."""
    inner = _cpu_kernels()

    def forward(q, k, v, scale):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal the number of heads in query")
        return inner.forward(q, k, v, scale)

    return AttentionKernels(name, forward, inner.backward)


def test_kernel_selection_skips_unavailable_and_wrong_kernels():
    """On the CPU the CUDA-only candidates fail or disagree; the selection moves on to PyTorch's CPU
    flash kernels and says why it passed over each of the others."""
    candidates = [_raising("cudnn", "cuDNN attention needs a CUDA device"), _wrong_gradients("bad-build"), _cpu_kernels()]
    choice = select_attention_kernels(candidates, "cpu", torch.float32)
    assert choice.kernels.name == "torch-flash-cpu"
    assert set(choice.rejected) == {"cudnn", "cudnn+expanded-kv", "bad-build", "bad-build+expanded-kv"}
    assert "needs a CUDA device" in choice.rejected["cudnn"]
    assert "disagrees" in choice.rejected["bad-build"] and "dq 1.0e-01" in choice.rejected["bad-build"]
    assert all(e < 1e-4 for e in choice.errors.values()) and set(choice.errors) == {"out", "lse", "dq", "dk", "dv"}


def test_kernel_selection_expands_kv_before_giving_up_on_a_candidate():
    choice = select_attention_kernels([_grouped_query_unsupported("no-gqa"), _cpu_kernels()], "cpu", torch.float32)
    assert choice.kernels.name == "no-gqa+expanded-kv"
    assert "must equal the number of heads" in choice.rejected["no-gqa"]


def test_kernel_selection_names_every_failure_when_nothing_matches():
    with pytest.raises(RuntimeError, match="no attention kernels on cpu .* match the float32 reference: cudnn: RuntimeError"):
        select_attention_kernels([_raising("cudnn", "unavailable"), _wrong_gradients("bad-build")], "cpu", torch.float32)


def test_kernel_selection_under_no_grad_still_checks_the_gradients():
    """The first use of the kernels may be a scoring pass under ``torch.no_grad`` (the Megatron
    backend's core attention picks them on its first call): the float32 reference still gets its
    gradients, so the right kernels are chosen rather than every candidate rejected."""
    with torch.no_grad():
        choice = select_attention_kernels([_wrong_gradients("bad-build"), _cpu_kernels()], "cpu", torch.float32)
    assert choice.kernels.name == "torch-flash-cpu" and set(choice.rejected) == {"bad-build", "bad-build+expanded-kv"}
    assert all(e < 1e-4 for e in choice.errors.values())


def test_reference_check_measures_real_errors():
    errors = check_attention_kernels(_cpu_kernels(), "cpu", torch.float64, seq_len=33, head_dim=16)
    assert all(e < 1e-6 for e in errors.values())
    bf16 = check_attention_kernels(_cpu_kernels(), "cpu", torch.bfloat16, seq_len=33, head_dim=16)
    assert all(1e-6 < e < 3e-2 for e in bf16.values())  # bf16 inputs, float32 reference: small, not zero


def test_chosen_kernels_on_the_cpu_fall_back_cleanly():
    choice = chosen_attention_kernels("cpu", torch.float32)
    assert choice.kernels.name == "torch-flash-cpu"
    assert chosen_attention_kernels("cpu", torch.float32) is choice  # checked once per process
    assert attention_kernels("cpu", dtype=torch.float32) is choice.kernels
    for name in ("cudnn", "flash-attn", "torch-efficient-cuda"):
        with pytest.raises(RuntimeError, match="run on CUDA devices only"):
            chosen_attention_kernels("cpu", torch.float32, prefer=name)
    assert CUDA_KERNEL_NAMES[:2] == ("flash-attn", "cudnn")  # the fastest first
