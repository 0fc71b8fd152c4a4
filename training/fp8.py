"""FP8 matrix products for the frozen base weights of the fused trainer step, an opt-in mode.

With a LoRA adapter, every large product of a step runs against a frozen base weight: the
projections forward, again in the replay of ``recompute="attention_output"``, and the input
gradients in backward. On Hopper an FP8 product (``torch._scaled_mm``) runs at up to about twice
the bf16 rate; this module lets :class:`training.fused_step.FusedKeepAttentionOutput` run those
products in FP8 while the adapter, its products and its gradients stay in the model's dtype:

- each frozen weight is quantized once (``float8_e4m3fn``, one scale per output row) for the
  forward products, and once transposed (one scale per input column) for the input-gradient
  products, because FP8 tensor-core products take their second operand column-major only; the
  q/k/v and gate/up weights are stacked, so those projections are one product each
  (:class:`Fp8LayerWeights`). That is two bytes a frozen parameter kept beside the bf16 weights
  (which stay: generation and scoring without gradients use them);
- each activation and output gradient that meets a frozen weight is quantized per row (token) just
  before its product (:func:`quantize_rows`, a compiled kernel on CUDA, checked once per process
  like the step kernels), and the product comes back in the model's dtype;
- the LM head stays in the model's dtype (its log-probabilities are what the loss reads).

Turn it on with :func:`training.fused_step.use_fp8_base_weights` on the model after the backend wrapped it (a
``TorchPeftBackend`` with ``recompute="attention_output"`` and the fused kernels); layers that do not
run the fused layer, micro-batches whose token count is not a multiple of 16 (the FP8 kernels' shape
rule) and devices without FP8 tensor cores run the bf16 products. On the CPU the products are
emulated in float32 from the same FP8 values (what the tests check); on CUDA they are
``torch._scaled_mm`` with row-wise scales. What it does to the loss is measured in
docs/benchmarks.md ("FP8 for the frozen weights").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_ATTRIBUTE = "_posttrain_fp8_base_weights"  # set on a decoder layer by use_fp8_base_weights
MULTIPLE = 16  # FP8 tensor-core products need every dimension a multiple of 16


def quantize_rows(x: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q`` in ``float8_e4m3fn`` and ``x ≈ q * scale``: one float32 scale per row
    (the last dimension's amax over 448), so each token's or each weight row's range fills FP8's.
    With ``more`` tensors of the same rows, of ``torch.cat((x, *more), -1)`` (compiled, the
    concatenation is read in the same pass, never written in bf16)."""
    if more:
        x = torch.cat((x, *more), dim=-1)
    xf = x.double() if x.dtype == torch.float64 else x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(acc) * scale.to(acc)).to(dtype)


def fp8_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq * x_scale) @ (wq * w_scale.T).T`` in ``out_dtype``: ``xq`` (m, k) and ``wq`` (n, k) FP8,
    row-major, ``x_scale`` (m, 1) and ``w_scale`` (1, n) float32. On CUDA one ``torch._scaled_mm``
    (row-wise scales, float32 accumulation); elsewhere the same values multiplied in float32
    (float64 for a float64 ``out_dtype``)."""
    if xq.is_cuda:
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    return (dequantize_rows(xq, x_scale, out_dtype) @ dequantize_rows(wq, w_scale.t(), out_dtype).t()).to(out_dtype)


@dataclass(frozen=True)
class Fp8Weight:
    """A frozen weight ``W`` (n, k) in FP8 twice: ``w`` (n, k) scaled per row, for ``x @ W.T``, and
    ``wt`` (k, n) = ``W.T`` scaled per row, for ``g @ W``."""

    w: torch.Tensor
    w_scale: torch.Tensor  # (1, n)
    wt: torch.Tensor
    wt_scale: torch.Tensor  # (1, k)

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Fp8Weight":
        with torch.no_grad():
            w, ws = quantize_rows(weight)
            wt, wts = quantize_rows(weight.t().contiguous())
        return cls(w, ws.view(1, -1), wt, wts.view(1, -1))

    def forward(self, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``x @ W.T`` for ``x`` given as its :func:`quantize_rows` pair."""
        return fp8_mm(xq, x_scale, self.w, self.w_scale, out_dtype)

    def backward(self, gq: torch.Tensor, g_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``g @ W`` for ``g`` given as its :func:`quantize_rows` pair."""
        return fp8_mm(gq, g_scale, self.wt, self.wt_scale, out_dtype)


@dataclass(frozen=True)
class Fp8LayerWeights:
    """A Qwen3 layer's frozen weights in FP8: q/k/v stacked (q, then k, then v rows), o, gate/up
    stacked (gate rows, then up), down."""

    qkv: Fp8Weight
    o: Fp8Weight
    gate_up: Fp8Weight
    down: Fp8Weight

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor]) -> "Fp8LayerWeights":
        with torch.no_grad():
            return cls(
                qkv=Fp8Weight.of(torch.cat([weights["q_proj"], weights["k_proj"], weights["v_proj"]])),
                o=Fp8Weight.of(weights["o_proj"]),
                gate_up=Fp8Weight.of(torch.cat([weights["gate_proj"], weights["up_proj"]])),
                down=Fp8Weight.of(weights["down_proj"]),
            )


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether FP8 products run on ``device``: CUDA of compute capability 8.9 or more (Ada, Hopper and
    later), or the CPU (emulated, for tests). ``(False, why)`` otherwise."""
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"no FP8 products on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (8.9 or more needed)"
    return True, ""


# -- the quantization kernel, compiled on CUDA and checked once per process ----------------------------


@dataclass(frozen=True)
class QuantizeChoice:
    name: str
    quantize_rows: Callable
    error: float  # relative error of the dequantized result against the input, on random rows
    rejected: dict[str, str]


_CHOSEN: dict[tuple[str, torch.dtype], QuantizeChoice] = {}


def check_quantize(fn: Callable, device: torch.device, dtype: torch.dtype) -> float:
    """The relative error of ``fn``'s dequantized rows against random rows in ``dtype`` with a wide
    spread of row magnitudes (e4m3 keeps 3 mantissa bits: about 2% is expected); raises if the
    values or scales differ from :func:`quantize_rows`' beyond one FP8 step."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(96, 1040, generator=gen) * torch.logspace(-4, 3, 96)[:, None]).to(device=device, dtype=dtype)
    q, s = fn(x)
    rq, rs = quantize_rows(x)
    if q.dtype != FP8 or q.shape != x.shape or s.shape != (x.shape[0], 1):
        raise ValueError(f"quantize_rows gave {q.dtype} {tuple(q.shape)} and scales {tuple(s.shape)}")
    if not torch.allclose(s, rs, rtol=1e-6, atol=0):
        raise ValueError("scales differ from the eager form's")
    # a different rounding of a value on a boundary moves it by one FP8 step (1/8 relative at most)
    step = (dequantize_rows(q, s) - dequantize_rows(rq, rs)).abs() / dequantize_rows(rq, rs).abs().clamp_min(1e-30)
    if float(step.max()) > 0.126:
        raise ValueError(f"values differ from the eager form's by {float(step.max()):.2f} relative")
    q2, s2 = fn(x[:, :512], x[:, 512:])  # two tensors side by side, as the input gradients are quantized
    if q2.shape != x.shape or not torch.allclose(s2, rs, rtol=1e-6, atol=0):
        raise ValueError("the side-by-side form differs from quantizing the whole rows")
    xf = x.float()
    return float((dequantize_rows(q, s) - xf).norm() / xf.norm())


def chosen_quantize(device: torch.device | str, dtype: torch.dtype) -> QuantizeChoice:
    """The row quantization for ``device`` and ``dtype``, chosen once per process: on CUDA the
    ``torch.compile``d :func:`quantize_rows` (one pass: row amax, scale, cast) if it agrees with the
    eager form, else the eager form, the reason kept; the eager form elsewhere."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _CHOSEN:
        rejected: dict[str, str] = {}
        candidates = []
        if device.type == "cuda":
            candidates.append(("torch.compile", torch.compile(quantize_rows, dynamic=True, fullgraph=True)))
        candidates.append(("eager", quantize_rows))
        for name, fn in candidates:
            try:
                error = check_quantize(fn, device, dtype)
            except Exception as e:  # noqa: BLE001  (a compiler failure is any exception; the reason is kept)
                rejected[name] = f"{type(e).__name__}: {str(e).strip()[:300]}"
                continue
            _CHOSEN[key] = QuantizeChoice(name, fn, error, rejected)
            break
        else:
            raise RuntimeError(f"no FP8 row quantization on {device} in {dtype}: {rejected}")
    return _CHOSEN[key]


__all__ = [
    "FP8",
    "FP8_ATTRIBUTE",
    "Fp8LayerWeights",
    "Fp8Weight",
    "QuantizeChoice",
    "check_quantize",
    "chosen_quantize",
    "dequantize_rows",
    "fp8_mm",
    "fp8_supported",
    "quantize_rows",
]
