"""FP8 products for the frozen base weights (``training.fp8``, the opt-in mode of the fused step).

On the CPU: the row quantization and the emulated product (the same values ``torch._scaled_mm``
gives on the CPU); the fused layer in FP8 mode through ``TorchPeftBackend.train_step`` on a real
tiny Qwen3 with a peft LoRA, first with a lossless stand-in for FP8 (float64), where it must equal
the bf16-path layer to float64 rounding (this checks the stacking, slicing, transposed weights and
scales), then with real e4m3 values, where it must stay within FP8's rounding of it. The CUDA
product (``torch._scaled_mm`` with row-wise scales) and the compiled quantization run on a GPU only;
their device run is in docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training import fp8, fused_step
from training.backends.torch_peft import TorchPeftBackend
from training.grpo import LossConfig

from .test_fused_step import _backend, _batch, _rel
from .test_recompute_backend import _save_tiny_qwen3


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return _save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-fp8"))


def test_quantize_rows_scales_each_row_to_the_fp8_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen) * torch.logspace(-3, 3, 8)[:, None]
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8, 1) and scale.dtype == torch.float32
    assert torch.allclose(q.float().abs().amax(-1), torch.full((8,), 448.0))
    back = fp8.dequantize_rows(q, scale)
    rel = (back - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(rel.max()) < 0.05  # 3 mantissa bits: about 2-3% per row, whatever the row's magnitude
    assert fp8.check_quantize(fp8.quantize_rows, torch.device("cpu"), torch.bfloat16) < 0.05


def test_the_emulated_product_is_torch_scaled_mm_on_the_cpu():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    weight = fp8.Fp8Weight.of(w)
    xq, xs = fp8.quantize_rows(x)
    got = weight.forward(xq, xs, torch.float32)
    assert _rel(got, x @ w.t()) < 0.06
    g = torch.randn(32, 48, generator=gen)
    gq, gs = fp8.quantize_rows(g)
    assert _rel(weight.backward(gq, gs, torch.float32), g @ w) < 0.06
    try:
        real = torch._scaled_mm(xq, weight.w.t(), scale_a=xs, scale_b=weight.w_scale, out_dtype=torch.float32)
    except RuntimeError as exc:  # torch 2.11's CPU kernel (the GPU machines' build) takes one scale per tensor
        if "per-tensor scaling" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales "
                    "(test_cuda_quantization_is_compiled_and_scaled_mm_gives_the_emulated_product compares on CUDA)")
    assert torch.equal(got, real)


def test_use_fp8_refuses_a_model_without_fused_layers(tiny_model_dir):
    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4, recompute="attention_output", fused_kernels=True)
    with pytest.raises(ValueError, match="no layer of .* can run the fused layer: .*Qwen3"):
        fused_step.use_fp8_base_weights(backend.model)


def _layers(backend) -> list:
    return [m for m in backend.model.modules() if hasattr(m, fp8.FP8_ATTRIBUTE)]


def _fp8_counts(backend, monkeypatch) -> list[int]:
    """Wraps FusedLayerParts.fp8_weights to record, per call, whether FP8 products ran."""
    ran = []
    original = fused_step.FusedLayerParts.fp8_weights

    def recorded(self, x2):
        weights = original(self, x2)
        ran.append(weights is not None)
        return weights

    monkeypatch.setattr(fused_step.FusedLayerParts, "fp8_weights", recorded)
    return ran


def _steps(backend):
    first = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
    grads = [p.grad.clone() for p in backend.masters]
    second = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
    return first, second, grads, backend.adapter_state_dict()


def _pad_to_16(monkeypatch):
    # the test batch's micro-batches are 7-9 tokens; FP8 products need multiples of 16
    monkeypatch.setattr(fp8, "MULTIPLE", 1)
    monkeypatch.setattr(fused_step, "MULTIPLE", 1)


def test_fp8_plumbing_with_a_lossless_stand_in_matches_the_bf16_path(qwen3_dir, monkeypatch):
    """With float64 standing in for FP8 (quantization loses nothing) the FP8-mode layer (stacked
    q/k/v and gate/up weights, transposed copies for the input gradients, row scales) must give the
    bf16-path layer's loss, gradients and adapter to float64 rounding."""
    _pad_to_16(monkeypatch)
    ref = _steps(_backend(qwen3_dir, "attention_output", True))
    monkeypatch.setattr(fp8, "FP8", torch.float64)
    backend = _backend(qwen3_dir, "attention_output", True)
    assert fused_step.use_fp8_base_weights(backend.model) == 2
    ran = _fp8_counts(backend, monkeypatch)
    got = _steps(backend)
    assert ran and all(ran)  # every fused-layer call with gradients took the FP8 products
    for g, r in ((got[0], ref[0]), (got[1], ref[1])):
        assert g.loss == pytest.approx(r.loss, rel=1e-10)
        assert g.grad_norm == pytest.approx(r.grad_norm, rel=1e-10)
    for g, r in zip(got[2], ref[2]):
        assert _rel(g, r) < 1e-10
    for name, w in got[3].items():
        assert _rel(w, ref[3][name]) < 1e-12, name


def test_fp8_mode_stays_within_fp8_rounding_of_the_bf16_path(qwen3_dir, monkeypatch):
    """Real e4m3 values (emulated products on the CPU): the loss within 2% and the LoRA gradients
    within 10% of the bf16-path layer's in float64, every layer call in FP8, and ``on=False`` back
    to the bf16 products exactly."""
    _pad_to_16(monkeypatch)
    ref = _steps(_backend(qwen3_dir, "attention_output", True))
    backend = _backend(qwen3_dir, "attention_output", True)
    fused_step.use_fp8_base_weights(backend.model)
    ran = _fp8_counts(backend, monkeypatch)
    first = backend.train_step(_batch(), LossConfig(kl_coef=0.1))
    grads = [p.grad.clone() for p in backend.masters]
    assert ran and all(ran)
    assert first.loss == pytest.approx(ref[0].loss, rel=2e-2)
    assert first.loss != ref[0].loss  # the FP8 products did round
    assert _rel(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref[2]])) < 0.1

    off = _backend(qwen3_dir, "attention_output", True)
    fused_step.use_fp8_base_weights(off.model)
    fused_step.use_fp8_base_weights(off.model, on=False)
    assert all(not getattr(m, fp8.FP8_ATTRIBUTE) for m in _layers(off))
    assert off.train_step(_batch(), LossConfig(kl_coef=0.1)).loss == ref[0].loss


def test_fp8_mode_runs_bf16_products_for_token_counts_off_the_multiple(qwen3_dir, monkeypatch):
    """Micro-batches of 7-9 tokens are not multiples of 16: the layer runs its bf16 products and
    says why, so the step equals the bf16 path's."""
    ref = _steps(_backend(qwen3_dir, "attention_output", True))
    backend = _backend(qwen3_dir, "attention_output", True)
    fused_step.use_fp8_base_weights(backend.model)
    ran = _fp8_counts(backend, monkeypatch)
    got = _steps(backend)
    assert ran and not any(ran)
    assert got[0].loss == ref[0].loss and got[1].loss == ref[1].loss
    parts = [p for p in _fp8_parts(backend)]
    assert parts and all("not a multiple of 16" in p.fp8_skipped for p in parts)


def _fp8_parts(backend):
    # the FusedLayerParts each layer's forward closure built at its first call
    for layer in _layers(backend):
        for cell in layer.forward.__closure__ or ():
            value = cell.cell_contents
            if isinstance(value, dict):
                yield from (v for v in value.values() if isinstance(v, fused_step.FusedLayerParts))


# -- the real path, on a GPU with FP8 tensor cores (skipped elsewhere; run on the device, docs/benchmarks.md)

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or more)")


@needs_fp8_gpu
def test_cuda_quantization_is_compiled_and_scaled_mm_gives_the_emulated_product():
    choice = fp8.chosen_quantize("cuda", torch.bfloat16)
    assert choice.name == "torch.compile", choice.rejected
    assert choice.error < 0.05
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 512, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(384, 512, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    weight = fp8.Fp8Weight.of(w)
    xq, xs = choice.quantize_rows(x)
    got = weight.forward(xq, xs, torch.bfloat16)
    emulated = fp8.fp8_mm(xq.cpu(), xs.cpu(), weight.w.cpu(), weight.w_scale.cpu(), torch.float32)
    assert got.dtype == torch.bfloat16 and _rel(got.float().cpu(), emulated) < 1e-2  # bf16 rounding of the output
    assert _rel(got.float(), x.float() @ w.float().t()) < 0.06
    g = torch.randn(256, 384, generator=gen).to("cuda", torch.bfloat16)
    gq, gs = choice.quantize_rows(g[:, :100], g[:, 100:])
    assert _rel(weight.backward(gq, gs, torch.bfloat16).float(), g.float() @ w.float()) < 0.06


@needs_fp8_gpu
def test_cuda_fp8_step_stays_near_the_bf16_step(tmp_path):
    """The fused bf16 step on CUDA against the same step in FP8 mode on a small Qwen3: every layer
    call in FP8, the loss within 3% and the LoRA gradients within 20% (cosine above 0.98)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (2, 64), generator=gen).tolist()
    from training.grpo import TrainBatch

    batch = TrainBatch(input_ids=ids, loss_mask=[[0] * 8 + [1] * 56] * 2,
                       serving_logprobs=[(-torch.rand(64, generator=gen) * 3).tolist() for _ in range(2)],
                       advantages=[0.5, -0.25])

    def step(fp8_on):
        backend = TorchPeftBackend(tmp_path, lora_rank=16, seed=3, micro_batch_tokens=128, max_grad_norm=1e9,
                                   recompute="attention_output", dtype="bfloat16", device="cuda")
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for name, p in backend.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        backend.refresh_masters()
        if fp8_on:
            fused_step.use_fp8_base_weights(backend.model)
        result = backend.train_step(batch, LossConfig())
        parts = list(_fp8_parts(backend))
        return result, torch.cat([m.grad.flatten().double() for m in backend.masters]), parts

    ref, ref_grad, _ = step(False)
    got, grad, parts = step(True)
    assert len(parts) == 2 and all(p.fp8_calls == 1 for p in parts), [p.fp8_skipped for p in parts]
    assert got.loss == pytest.approx(ref.loss, rel=3e-2)
    assert _rel(grad, ref_grad) < 0.2
    assert float(torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0)) > 0.98
