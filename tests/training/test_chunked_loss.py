"""Chunked token log-probabilities and the bf16 adapter give the loss and gradients of the direct,
full-vocabulary float32 computation.

``training.logprobs.token_logprobs`` never holds more than one chunk of logits; these tests pin its
values and gradients (to the hidden states and to the LM head) against ``log_softmax`` over every
logit at once, in float64 where the match must be exact to rounding and in bfloat16 against a
float32 reference. The torch/peft backend is checked end to end on a real tiny Qwen3 on the CPU:
the chunked step against the unchunked one, and a bfloat16 backend (adapter in bf16, float32 master
weights in AdamW) against the float32 backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.backends.torch_peft import TorchPeftBackend
from training.grpo import LossConfig, TrainBatch, grpo_loss
from training.logprobs import full_vocabulary_token_logprobs, token_logprobs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(dtype, batch=2, seq=23, hidden=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    t = torch.randint(0, vocab, (batch, seq), generator=gen)
    return h, w, t


def _grpo_loss_and_grads(fn, h, w, t, chunk=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp = fn(h, w, t) if chunk is None else fn(h, w, t, chunk)
    gen = torch.Generator().manual_seed(1)
    serving = lp.detach().float() + torch.randn(lp.shape, generator=gen) * 0.3
    mask = (torch.rand(lp.shape, generator=gen) > 0.3).float()
    adv = torch.tensor([0.7, -0.4])
    loss, _ = grpo_loss(lp.to(torch.float64) if lp.dtype == torch.float64 else lp, serving.to(lp.dtype), mask.to(lp.dtype),
                        adv.to(lp.dtype), LossConfig(tis_cap=2.0))
    loss.backward()
    return lp.detach(), loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 23, 1000])
def test_chunked_logprobs_and_grpo_gradients_match_the_full_vocabulary_computation(chunk):
    """float64: values, GRPO loss and both gradients agree to rounding, whatever the chunk size
    (one row, a size that does not divide the rows, exactly the rows, more than all of them)."""
    h, w, t = _inputs(torch.float64)
    ref = _grpo_loss_and_grads(full_vocabulary_token_logprobs, h, w, t)
    got = _grpo_loss_and_grads(token_logprobs, h, w, t, chunk)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float64 and a.shape == b.shape
        assert _rel(a, b) < 1e-12
    assert ref[2].norm() > 0 and ref[3].norm() > 0


def test_bf16_chunked_logprobs_match_a_float32_reference():
    """bf16 hidden states and head (the trainer's dtypes): float32 values like the direct way on the
    same bf16 inputs, gradients within bf16 rounding of the float32 computation."""
    h16, w16, t = _inputs(torch.bfloat16, seq=40, hidden=32, vocab=300)
    lp, loss, gh, gw = _grpo_loss_and_grads(token_logprobs, h16, w16, t, 16)
    ref_lp, ref_loss, ref_gh, ref_gw = _grpo_loss_and_grads(full_vocabulary_token_logprobs, h16.float(), w16.float(), t)
    assert lp.dtype == torch.float32
    assert _rel(lp, ref_lp) < 1e-2
    assert abs(float(loss - ref_loss)) < 1e-2 * abs(float(ref_loss)) + 1e-3
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert _rel(gh, ref_gh) < 2e-2 and _rel(gw, ref_gw) < 2e-2


def test_no_full_vocabulary_logits_are_kept_for_backward():
    """What backward keeps: the hidden states, the head and the targets, never a (tokens, vocab)
    tensor. The direct computation keeps the whole float32 logits (what the backend did before)."""
    h, w, t = _inputs(torch.float32, seq=64, hidden=8, vocab=500)
    h.requires_grad_()

    def kept_shapes(fn, *args):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append(tuple(x.shape)) or x, lambda x: x):
            fn(h, w, t, *args)
        return kept

    assert any(s[-1] == 500 and s[:-1] == (2, 64) for s in kept_shapes(full_vocabulary_token_logprobs))
    shapes = kept_shapes(token_logprobs, 16)
    assert sorted(shapes) == sorted([(128, 8), (500, 8), (128,)])


def test_chunked_backward_makes_at_most_one_chunk_of_logits_at_a_time(monkeypatch):
    """Every logits product, forward and backward, covers at most ``chunk_tokens`` rows."""
    h, w, t = _inputs(torch.float32, seq=50, hidden=8, vocab=64)
    h.requires_grad_()
    rows = []
    linear = torch.nn.functional.linear

    def counting(x, weight, *a):
        if weight is w:
            rows.append(x.shape[0])
        return linear(x, weight, *a)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    token_logprobs(h, w, t, 12).sum().backward()
    assert max(rows) == 12 and sum(rows) == 2 * 2 * 50  # every row twice: forward, then backward


def test_bad_arguments_are_named():
    h, w, t = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        token_logprobs(h, w, t, 0)
    with pytest.raises(ValueError, match="expected hidden = targets"):
        token_logprobs(h, w, t[:, :-1])
    with pytest.raises(ValueError, match=r"expected \(vocab, 16\)"):
        token_logprobs(h, w[:, :-1], t)


# -- the backend ---------------------------------------------------------------------------------


def _save_tiny_qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return _save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-untied"))


def _batch() -> TrainBatch:
    return TrainBatch(
        input_ids=[[1, 5, 7, 9, 11, 3, 8, 40, 41, 42], [1, 5, 8, 90], [2, 3, 4, 6, 10, 12, 13, 20, 21, 60, 61, 62, 63]],
        loss_mask=[[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]],
        serving_logprobs=[[0, 0] + [-4.5] * 8, [0, 0, -4.4, -4.6], [0, 0, 0, -4.3, 0] + [-4.5] * 8],
        advantages=[0.5, -0.5, 0.75],
    )


LOSS = LossConfig(kl_coef=0.1)


def _backend(model_dir: Path, **kwargs) -> TorchPeftBackend:
    # alpha = 2 · rank (scaling 2), as in practice: a larger scaling magnifies bf16 rounding in the adapter
    backend = TorchPeftBackend(model_dir, lora_rank=4, lora_alpha=8, seed=3, micro_batch_tokens=26, max_grad_norm=1e9,
                               learning_rate=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:  # a fresh adapter's B is zero, which would hide A's gradient
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    backend.refresh_masters()
    return backend


def _step(backend: TorchPeftBackend):
    result = backend.train_step(_batch(), LOSS)
    names = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    grads = {n: m.grad.float().clone() for n, m in zip(names, backend.masters)}  # float32 for a bf16 adapter
    return result, grads, {k: v.float() for k, v in backend.adapter_state_dict().items()}


def test_backend_token_logprobs_match_the_model_logits(qwen3_dir):
    """The backend's chunked path gives what ``log_softmax`` over the model's own logits gives."""
    backend = _backend(qwen3_dir, logits_chunk_tokens=3)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 8], [2, 3, 4, 0, 0, 0, 0]])
    attn = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    with torch.no_grad():
        got = backend.token_logprobs(ids, attn)
        logits = backend.model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got[:, 0].abs().max() == 0
    assert _rel(got[0, 1:], ref[0]) < 1e-6 and _rel(got[1, 1:3], ref[1, :2]) < 1e-6


def test_chunked_backend_step_matches_the_unchunked_step(qwen3_dir):
    """float32: a chunk of 2 rows against one chunk larger than any micro-batch (the unchunked step)."""
    ref, ref_grads, ref_adapter = _step(_backend(qwen3_dir, logits_chunk_tokens=1 << 20))
    result, grads, adapter = _step(_backend(qwen3_dir, logits_chunk_tokens=2))
    assert result.loss == pytest.approx(ref.loss, rel=1e-5)
    assert result.kl == pytest.approx(ref.kl, rel=1e-4)
    assert result.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    for name, g in grads.items():
        assert ref_grads[name].norm() > 0, name
        assert _rel(g, ref_grads[name]) < 1e-5, name
    # AdamW's first step divides each gradient by its own magnitude: an element whose gradient is
    # near eps moves by a rounding-sized difference in full, so the weights are held to the
    # gradients' tolerance (CI measured 4e-6 on a lora_B, where 1e-6 was asked)
    for name, w in adapter.items():
        assert _rel(w, ref_adapter[name]) < 1e-5, name


def test_bf16_backend_keeps_the_adapter_in_bf16_and_matches_the_float32_step(qwen3_dir):
    """dtype="bfloat16": LoRA factors in bf16 (no activation cast for them), AdamW on float32
    masters; loss and gradients within bf16 rounding of the float32 backend's."""
    ref, ref_grads, ref_adapter = _step(_backend(qwen3_dir))
    backend = _backend(qwen3_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in backend.params) and len(backend.params) == 2 * 7 * 2
    assert all(m.dtype == torch.float32 and m is not p for p, m in zip(backend.params, backend.masters))
    assert [p for g in backend.optimizer.param_groups for p in g["params"]] == backend.masters
    result, grads, adapter = _step(backend)
    assert result.loss == pytest.approx(ref.loss, rel=1e-3)
    assert result.grad_norm == pytest.approx(ref.grad_norm, rel=3e-2)
    flat = torch.cat([g.flatten() for g in grads.values()])
    assert _rel(flat, torch.cat([ref_grads[n].flatten() for n in grads])) < 4e-2
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < 8e-2, (name, _rel(g, ref_grads[name]))
    # the step was taken on the float32 masters and copied down: the bf16 adapter is their rounding
    for p, master in zip(backend.params, backend.masters):
        assert torch.equal(p, master.to(torch.bfloat16))
    for name, w in adapter.items():
        assert _rel(w, ref_adapter[name]) < 5e-2, name


def test_bf16_backend_resumes_from_float32_masters(qwen3_dir, tmp_path):
    """A checkpoint of a bf16 backend restores the float32 masters, not their bf16 rounding."""
    backend = _backend(qwen3_dir, dtype="bfloat16")
    backend.train_step(_batch(), LOSS)
    backend.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "master_weights.pt").is_file()
    masters = [m.clone() for m in backend.masters]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    resumed = TorchPeftBackend(qwen3_dir, lora_rank=4, lora_alpha=8, seed=99, dtype="bfloat16")
    resumed.load_state(tmp_path / "ckpt")
    for a, b in zip(resumed.masters, masters):
        assert torch.equal(a, b)
    for p, m in zip(resumed.params, resumed.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_fused_lora_and_rms_norm_give_pefts_own_forward(qwen3_dir):
    """The epilogue-fused LoRA projections and fused RMSNorm give the logits of peft's and Hugging
    Face's own modules (the same folder and adapter, forwards restored)."""
    backend = _backend(qwen3_dir)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 8]])
    with torch.no_grad():
        fused = backend.model(input_ids=ids, use_cache=False).logits
        restored = [m for m in backend.model.modules() if m.__dict__.pop("forward", None) is not None]
        plain = backend.model(input_ids=ids, use_cache=False).logits
    norms = 2 * (2 + 2) + 1  # per layer: input, post-attention, q and k norms; and the final norm
    assert len(restored) == 2 * 7 + norms
    assert _rel(fused, plain) < 1e-6


def test_bad_backend_options_are_named(qwen3_dir):
    with pytest.raises(ValueError, match="logits_chunk_tokens must be at least 1"):
        TorchPeftBackend(qwen3_dir, logits_chunk_tokens=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        TorchPeftBackend(qwen3_dir, dtype="int8")
