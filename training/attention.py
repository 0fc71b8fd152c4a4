"""Causal attention kernels that return the log-sum-exp, chosen at run time against a float32 reference.

Every kernel here is a pair ``forward(q, k, v, scale) -> (out, lse, state)`` and
``backward(grad_out, q, k, v, out, lse, state, scale) -> (dq, dk, dv)`` (:class:`AttentionKernels`):
q is (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim), out like q, lse
(batch, heads, seq) float32 (float64 for float64 inputs on the CPU). A backward that takes the saved
output and log-sum-exp is what lets :mod:`training.recompute` skip the attention forward in backward.

:func:`chosen_attention_kernels` picks, once per process, device type and dtype, the first of
flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward`` (where installed), cuDNN's fused
attention (``aten._scaled_dot_product_cudnn_attention`` and its backward: what stock SDPA runs on
Hopper, and the fastest there), PyTorch's flash kernels and its memory-efficient ones whose forward
and q/k/v gradients match a float32 reference on small random inputs (:func:`check_attention_kernels`);
a candidate that raises or disagrees is passed over with its reason kept, and one without
grouped-query support is retried with k/v expanded. On the CPU it is
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. All are causal; there is no
dropout, so no RNG state needs keeping. :class:`FlashAttention` is the autograd function that runs
attention through chosen kernels and saves q, k, v, out and lse, as SDPA does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

class AttentionKernels(NamedTuple):
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _torch_cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _torch_cpu_backward(grad_out, q, k, v, out, lse, state, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, True, scale=scale
    )


def _torch_cuda_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _torch_cuda_backward(grad_out, q, k, v, out, lse, state, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


def _expanding_kv(kernels: AttentionKernels) -> AttentionKernels:
    """The same kernels fed k/v repeated to every query head, for builds without grouped-query support."""

    def expand(t, heads):
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    def forward(q, k, v, scale):
        return kernels.forward(q, expand(k, q.shape[1]), expand(v, q.shape[1]), scale)

    def backward(grad_out, q, k, v, out, lse, state, scale):
        h, hk = q.shape[1], k.shape[1]
        dq, dk, dv = kernels.backward(grad_out, q, expand(k, h), expand(v, h), out, lse, state, scale)
        b, _, s, d = dk.shape
        return dq, dk.view(b, hk, h // hk, s, d).sum(2), dv.view(b, hk, h // hk, s, d).sum(2)

    return AttentionKernels(kernels.name + "+expanded-kv", forward, backward)


def _cudnn_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(grad_out, q, k, v, out, lse, state, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    if grad_out.stride() != out.stride():
        # cuDNN reads dO in the layout of O; match it here once instead of inside the op
        grad_out = torch.empty_like(out).copy_(grad_out)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
    )


def _efficient_forward(q, k, v, scale):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale
    )
    return out, lse, (seed, offset)


def _efficient_backward(grad_out, q, k, v, out, lse, state, scale):
    seed, offset = state
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale
    )
    return dq, dk, dv


def _flash_attn_kernels() -> AttentionKernels | None:
    """flash-attn 2.x's private entry points, which take and return the log-sum-exp.

    flash-attn works in (batch, seq, heads, head_dim); the transposes below are views. None where
    flash-attn is not installed (the device machines of docs/benchmarks.md have none).
    """
    try:
        # optional: flash-attn is a GPU library, absent on CPU machines (ImportError: no kernels)
        import flash_attn
        from flash_attn import flash_attn_interface as fa
    except ImportError:
        return None
    try:
        major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (2, 6):  # the keyword signatures below are those of 2.6 to 2.8
        return None

    def forward(q, k, v, scale):
        out, lse, _, _ = fa._flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=0.0, softmax_scale=scale, causal=True,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        )
        return out.transpose(1, 2), lse, ()

    def backward(grad_out, q, k, v, out, lse, state, scale):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        fa._flash_attn_backward(
            grad_out.transpose(1, 2).contiguous(), qt, kt, vt, out.transpose(1, 2), lse, dq, dk, dv,
            dropout_p=0.0, softmax_scale=scale, causal=True,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    return AttentionKernels("flash-attn", forward, backward)


# The CUDA kernels in order of preference: flash-attn (where installed), cuDNN's fused attention
# (Hopper's fastest in PyTorch, what stock SDPA picks there), PyTorch's flash, the memory-efficient one.
CUDA_KERNEL_NAMES = ("flash-attn", "cudnn", "torch-flash-cuda", "torch-efficient-cuda")


def _cuda_kernels(name: str) -> AttentionKernels | None:
    if name == "flash-attn":
        return _flash_attn_kernels()
    if name == "cudnn":
        return AttentionKernels("cudnn", _cudnn_forward, _cudnn_backward)
    if name == "torch-flash-cuda":
        return AttentionKernels("torch-flash-cuda", _torch_cuda_forward, _torch_cuda_backward)
    if name == "torch-efficient-cuda":
        return AttentionKernels("torch-efficient-cuda", _efficient_forward, _efficient_backward)
    raise ValueError(f"unknown attention kernels {name!r}; expected one of {', '.join(CUDA_KERNEL_NAMES)}")


@torch.enable_grad()  # the reference's gradients, also when the kernels are first chosen under no_grad
def check_attention_kernels(
    kernels: AttentionKernels, device: torch.device | str, dtype: torch.dtype, *, seq_len: int = 300,
    batch: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 128, seed: int = 1,
) -> dict[str, float]:
    """Relative errors of ``kernels`` (causal, grouped-query k/v) against a float32 reference on
    random inputs: the output, the log-sum-exp and the three input gradients. Raises what the
    kernels raise (a build or device that lacks them)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rand(batch, heads, seq_len, head_dim), rand(batch, kv_heads, seq_len, head_dim), rand(batch, kv_heads, seq_len, head_dim)
    grad = rand(batch, heads, seq_len, head_dim)
    scale = head_dim**-0.5
    out, lse, state = kernels.forward(q, k, v, scale)
    dq, dk, dv = kernels.backward(grad, q, k, v, out, lse, state, scale)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    rep = heads // kv_heads
    scores = (qf @ kf.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    ref = torch.softmax(scores, -1) @ vf.repeat_interleave(rep, 1)
    ref_lse = torch.logsumexp(scores, -1)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    lse = lse.reshape(batch, heads, -1)[..., :seq_len] if lse.numel() != ref_lse.numel() else lse.reshape(ref_lse.shape)

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    return {"out": rel(out, ref), "lse": rel(lse, ref_lse), "dq": rel(dq, rq), "dk": rel(dk, rk), "dv": rel(dv, rv)}


@dataclass(frozen=True)
class KernelChoice:
    """The kernels :func:`select_attention_kernels` chose, and why each earlier candidate was not."""

    kernels: AttentionKernels
    errors: dict[str, float]
    rejected: dict[str, str]


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 3e-2, torch.float16: 1e-2}.get(dtype, 1e-4)


def select_attention_kernels(
    candidates: list[AttentionKernels], device: torch.device | str, dtype: torch.dtype, *, with_expanded_kv: bool = True
) -> KernelChoice:
    """The first of ``candidates`` whose forward and gradients match a float32 reference on ``device``
    in ``dtype`` (:func:`check_attention_kernels`); a candidate that raises or disagrees is skipped
    and the reason kept. With ``with_expanded_kv``, one whose grouped-query path fails is retried
    with k/v repeated to every query head before moving on."""
    rejected: dict[str, str] = {}
    tol = _tolerance(dtype)
    for base in candidates:
        for kernels in (base, _expanding_kv(base)) if with_expanded_kv else (base,):
            try:
                errors = check_attention_kernels(kernels, device, dtype)
            except (RuntimeError, TypeError, NotImplementedError) as e:
                rejected[kernels.name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
                continue
            if all(e < tol for e in errors.values()):
                return KernelChoice(kernels, errors, rejected)
            rejected[kernels.name] = "disagrees with the float32 reference: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
    raise RuntimeError(
        f"no attention kernels on {device} in {dtype} match the float32 reference: "
        + "; ".join(f"{k}: {v}" for k, v in rejected.items())
    )


_CHOSEN: dict[tuple[str, torch.dtype, str], KernelChoice] = {}


def chosen_attention_kernels(device: torch.device | str, dtype: torch.dtype, prefer: str = "auto") -> KernelChoice:
    """The fastest checked kernels for ``device`` and ``dtype``, chosen once per process.

    On CUDA, ``prefer="auto"`` tries :data:`CUDA_KERNEL_NAMES` in order; a name there tries only
    that one (and its expanded-k/v form). On the CPU it is PyTorch's CPU flash kernels.
    """
    device = torch.device(device)
    key = (device.type, dtype, prefer)
    if key not in _CHOSEN:
        if device.type == "cuda":
            names = CUDA_KERNEL_NAMES if prefer == "auto" else (prefer,)
            candidates = [k for k in (_cuda_kernels(n) for n in names) if k is not None]
            if not candidates:
                raise RuntimeError(f"attention kernels {prefer!r} are not available (flash-attn is not installed)")
        elif device.type == "cpu":
            if prefer not in ("auto", "torch-flash-cpu"):
                raise RuntimeError(f"attention kernels {prefer!r} run on CUDA devices only")
            candidates = [AttentionKernels("torch-flash-cpu", _torch_cpu_forward, _torch_cpu_backward)]
        else:
            raise RuntimeError(f"no attention kernels for device type {device.type!r}")
        _CHOSEN[key] = select_attention_kernels(candidates, device, dtype)
    return _CHOSEN[key]


def attention_kernels(
    device: torch.device | str, prefer: str = "auto", expand_kv: bool = False, dtype: torch.dtype | None = None
) -> AttentionKernels:
    """The attention kernels for ``device``.

    With ``dtype`` given (what the models here pass), the kernels are :func:`chosen_attention_kernels`:
    checked against a float32 reference once per process, fastest first (flash-attn, cuDNN, PyTorch
    flash, memory-efficient on CUDA). Without it, unchecked: flash-attn if installed, else PyTorch's
    flash kernels (CUDA or CPU). ``prefer`` is "auto", or one kernel name (:data:`CUDA_KERNEL_NAMES`;
    "torch" is PyTorch's flash). ``expand_kv`` repeats k/v to every query head (a fallback, and a
    cross-check).
    """
    if expand_kv:
        return _expanding_kv(attention_kernels(device, prefer, dtype=dtype))
    device = torch.device(device)
    if prefer == "torch":
        prefer = "torch-flash-cuda" if device.type == "cuda" else "torch-flash-cpu"
    if dtype is not None and not (device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16)):
        return chosen_attention_kernels(device, dtype, prefer).kernels
    if device.type == "cuda":
        if prefer in ("auto", "flash-attn"):
            kernels = _flash_attn_kernels()
            if kernels is not None:
                return kernels
            if prefer == "flash-attn":
                raise RuntimeError("flash-attn was asked for but is not installed (pip install 'posttrain[gpu]')")
            prefer = "torch-flash-cuda"
        return _cuda_kernels(prefer)
    if device.type == "cpu":
        if prefer not in ("auto", "torch-flash-cpu"):
            raise RuntimeError(f"attention kernels {prefer!r} run on CUDA devices only")
        return AttentionKernels("torch-flash-cpu", _torch_cpu_forward, _torch_cpu_backward)
    raise RuntimeError(f"no attention kernels for device type {device.type!r}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Flash kernels need unit stride in head_dim only; ``.contiguous()`` on a (batch, heads, seq,
    head_dim) view of a (batch, seq, heads·head_dim) gradient would copy it for nothing."""
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashAttention(torch.autograd.Function):
    """Causal attention through the chosen kernels, saving q, k, v, out and lse like SDPA does.

    Used by the "none" and "full" modes so that all three modes run the same attention kernels.
    """

    @staticmethod
    def forward(ctx, q, k, v, kernels: AttentionKernels, scale: float):
        out, lse, state = kernels.forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.state, ctx.scale = kernels, state, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernels.backward(last_dim_contiguous(grad_out), q, k, v, out, lse, ctx.state, ctx.scale)
        return dq, dk, dv, None, None

__all__ = [
    "CUDA_KERNEL_NAMES",
    "AttentionKernels",
    "FlashAttention",
    "KernelChoice",
    "attention_kernels",
    "check_attention_kernels",
    "chosen_attention_kernels",
    "last_dim_contiguous",
    "select_attention_kernels",
]
