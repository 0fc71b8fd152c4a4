"""Activation recomputation for long-context LoRA training that never recomputes attention.

Full activation recomputation (``torch.utils.checkpoint`` around each decoder layer) keeps only the
layer input and repeats the whole layer forward in backward, attention included; at 32K tokens and
beyond the attention forward is the most expensive part of that repeat. This module keeps, per
layer, the layer input, the attention output and the attention's log-sum-exp. Backward recomputes
the cheap parts (RMSNorms, q/k/v projections with q/k norm and RoPE, the output projection, the
SwiGLU MLP, all with their LoRA adapters) and feeds the attention backward kernel directly with the
saved output and log-sum-exp, the two things a flash-attention backward needs besides q, k and v.
It also leaves out the one product of the layer whose result backward never reads: the frozen down
projection's (its input gradient is ``grad @ W``; only its LoRA branch is rebuilt). A full
recomputation cannot skip it, since it replays the layer's forward as written.

The decoder is Qwen3-shaped (RMSNorm, q/k/v/o projections with per-head q/k RMSNorm, grouped-query
attention, rotary embeddings, SwiGLU MLP) with frozen base weights and LoRA on the seven
projections. Three recomputation modes share every kernel, so a benchmark compares only what is
kept::

    model = Qwen3Decoder(DecoderShape.qwen3("4b"), dtype=torch.bfloat16, device="cuda")
    hidden = model(input_ids, recompute="attention_output")   # or "none", "full"
    logprobs = model.token_logprobs(hidden, target_ids)

The same recomputation runs on Hugging Face Qwen2/Qwen3 decoder layers with peft LoRA adapters
(:func:`keep_attention_output_in_hf_layers`, what the torch/peft trainer backend's
``recompute="attention_output"`` installs).

Attention kernels, chosen by :func:`chosen_attention_kernels` once per process and device type:
the first of flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward`` (where installed),
cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its backward: what stock
SDPA runs on Hopper, and the fastest there), PyTorch's flash kernels and its memory-efficient ones
whose forward and q/k/v gradients match a float32 reference on small random inputs
(:func:`check_attention_kernels`); a candidate that raises or disagrees is passed over with its
reason kept, and one without grouped-query support is retried with k/v expanded. On the CPU it is
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward. All are causal and return
the log-sum-exp. There is no dropout, so no RNG state needs keeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

RecomputeMode = Literal["none", "full", "attention_output"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "full", "attention_output")


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Qwen3-style decoder and of its LoRA adapters."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    lora_rank: int = 32
    lora_alpha: float = 64.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def qwen3(cls, size: str, **overrides) -> "DecoderShape":
        """The published Qwen3 dense shapes ("0.6b", "1.7b", "4b", "8b", "14b")."""
        shapes = {
            "0.6b": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072),
            "1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=6144),
            "4b": dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728),
            "8b": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288),
            "14b": dict(hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8, intermediate_size=17408),
        }
        if size not in shapes:
            raise ValueError(f"unknown Qwen3 size {size!r}; expected one of {sorted(shapes)}")
        return cls(**{**shapes[size], "head_dim": 128, "vocab_size": 151_936, **overrides})

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def base_params_per_layer(self) -> int:
        """Weights of the projections of one layer (norm weights are negligible and left out)."""
        h = self.hidden_size
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * self.intermediate_size

    def lora_params_per_layer(self) -> int:
        h, r, i = self.hidden_size, self.lora_rank, self.intermediate_size
        pairs = [(h, self.q_size), (h, self.kv_size), (h, self.kv_size), (self.q_size, h), (h, i), (h, i), (i, h)]
        return sum(r * (fan_in + fan_out) for fan_in, fan_out in pairs)

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one LoRA training step per token of a causal sequence of ``seq_len``.

        Counted as the work the model needs, not what a recomputation scheme repeats: the frozen
        projections cost a forward (2 FLOPs per weight) and an input-gradient backward (2 more; they
        have no weight gradient), the LoRA factors 6 per weight, the LM head 4 per weight, and
        causal attention 2·S·heads·head_dim per token forward (half of the S×S scores) and twice
        that backward.
        """
        per_layer_linear = 4 * self.base_params_per_layer() + 6 * self.lora_params_per_layer()
        per_layer_attention = 3 * 2 * seq_len * self.q_size
        lm_head = 4 * self.hidden_size * self.vocab_size
        return self.num_layers * (per_layer_linear + per_layer_attention) + lm_head


# ---------------------------------------------------------------------------------------------
# Attention kernels: forward returns (out, lse, state); backward takes them back.
# q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim); out like q;
# lse: (batch, heads, seq) float32 (float64 for float64 inputs on the CPU).


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


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Flash kernels need unit stride in head_dim only; ``.contiguous()`` on a (batch, heads, seq,
    head_dim) view of a (batch, seq, heads·head_dim) gradient would copy it for nothing."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _FlashAttention(torch.autograd.Function):
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
        dq, dk, dv = ctx.kernels.backward(_last_dim_contiguous(grad_out), q, k, v, out, lse, ctx.state, ctx.scale)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------
# The decoder.


class LoRALinear(nn.Module):
    """A frozen linear projection plus a trainable low-rank update ``scale * B(A(x))``."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, *, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        self.scale = alpha / rank
        nn.init.normal_(self.weight, std=in_features**-0.5)
        nn.init.normal_(self.lora_a, std=in_features**-0.5)

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's part of the output, ``scale * B(A(x))``."""
        return F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The rank-r product is added in the GEMM's epilogue (``addmm``'s alpha and beta): no
        # separate scaling and sum passes over the (tokens, out_features) output.
        base = F.linear(x, self.weight)
        xa = F.linear(x, self.lora_a)
        out = torch.addmm(base.reshape(-1, base.shape[-1]), xa.reshape(-1, xa.shape[-1]), self.lora_b.t(), alpha=self.scale)
        return out.view(base.shape)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def rope_tables(shape: DecoderShape, seq_len: int, *, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim) for rotate-half rotary embeddings."""
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


class Qwen3DecoderLayer(nn.Module):
    """One decoder layer, split at attention into the two halves that backward recomputes."""

    def __init__(self, shape: DecoderShape, kernels: AttentionKernels, *, dtype, device):
        super().__init__()
        self.shape, self.kernels = shape, kernels
        h, r, a = shape.hidden_size, shape.lora_rank, shape.lora_alpha

        def lin(i, o):
            return LoRALinear(i, o, r, a, dtype=dtype, device=device)

        def norm(n):
            return nn.Parameter(torch.ones(n, dtype=dtype, device=device), requires_grad=False)

        self.input_norm, self.post_attention_norm = norm(h), norm(h)
        self.q_norm, self.k_norm = norm(shape.head_dim), norm(shape.head_dim)
        self.q_proj, self.k_proj, self.v_proj = lin(h, shape.q_size), lin(h, shape.kv_size), lin(h, shape.kv_size)
        self.o_proj = lin(shape.q_size, h)
        self.gate_proj, self.up_proj = lin(h, shape.intermediate_size), lin(h, shape.intermediate_size)
        self.down_proj = lin(shape.intermediate_size, h)
        self.softmax_scale = shape.head_dim**-0.5

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.shape.rms_eps)

    def attention_inputs(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v in (batch, heads, seq, head_dim) from the layer input (batch, seq, hidden)."""
        b, s, _ = x.shape
        d = self.shape.head_dim
        h = self._rms(x, self.input_norm)
        q = self._rms(self.q_proj(h).view(b, s, -1, d), self.q_norm).transpose(1, 2)
        k = self._rms(self.k_proj(h).view(b, s, -1, d), self.k_norm).transpose(1, 2)
        v = self.v_proj(h).view(b, s, -1, d).transpose(1, 2)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v

    def attention_outputs(self, x, attn) -> torch.Tensor:
        """The layer output from its input and the attention output (batch, heads, seq, head_dim)."""
        y, act = self._mlp_input(x, attn)
        return y + self.down_proj(act)

    def mlp_input(self, x, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual after attention and the input of the down projection."""
        return self._mlp_input(x, attn)

    def _mlp_input(self, x, attn) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        y = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, self.shape.q_size))
        h = self._rms(y, self.post_attention_norm)
        return y, F.silu(self.gate_proj(h)) * self.up_proj(h)

    def down_parts(self, act) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The down projection's frozen weight and its LoRA part of the output on ``act``."""
        return self.down_proj.weight, self.down_proj.lora_delta(act)

    def forward(self, x, cos, sin) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, cos, sin)
        attn = _FlashAttention.apply(q, k, v, self.kernels, self.softmax_scale)
        return self.attention_outputs(x, attn)


class _KeepAttentionOutput(torch.autograd.Function):
    """A decoder layer that keeps only its input, the attention output and the log-sum-exp.

    ``layer`` is split at attention (:class:`Qwen3DecoderLayer`, or :class:`HFDecoderSplit` for a
    Hugging Face layer): ``attention_inputs(x, cos, sin) -> q, k, v``, ``attention_outputs(x, attn)
    -> layer output``, ``mlp_input(x, attn) -> (residual after attention, down projection input)``,
    ``down_parts(act) -> (frozen down weight, LoRA part of the output or None)``, and ``kernels``,
    ``softmax_scale``. ``mlp_input`` and ``down_parts`` may be None (then the whole post-attention
    half is replayed).

    Forward runs without building a graph. Backward rebuilds the post-attention half from the saved
    output up to the down projection's input ``act``; the frozen down product is not redone, since
    backward reads only its input gradient ``grad @ W_down``, which is fed to ``act`` directly. The
    graph gives the gradient of the attention output, the attention backward kernel turns it into
    q/k/v gradients with the saved output and log-sum-exp, and those flow back through the rebuilt
    pre-attention half. Attention itself runs once, in forward.
    """

    @staticmethod
    def forward(ctx, layer, x, cos, sin, *trainable):
        with torch.no_grad():
            q, k, v = layer.attention_inputs(x, cos, sin)
            attn, lse, state = layer.kernels.forward(q, k, v, layer.softmax_scale)
            del q, k, v
            y = layer.attention_outputs(x, attn)
        ctx.save_for_backward(x, cos, sin, attn, lse)
        ctx.layer, ctx.state, ctx.trainable = layer, state, trainable
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, cos, sin, attn, lse = ctx.saved_tensors
        layer = ctx.layer
        trainable = list(ctx.trainable)
        want_x = ctx.needs_input_grad[1]
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(want_x)
            attn_in = attn.detach().requires_grad_(True)
            outputs, grads_out = _post_attention_for_backward(layer, x_in, attn_in, grad_y)
            post_inputs = [attn_in] + ([x_in] if want_x else []) + trainable
            post_grads = torch.autograd.grad(outputs, post_inputs, grads_out, allow_unused=True)
            del outputs, grads_out
            grad_attn = post_grads[0]
            grad_x_post = post_grads[1] if want_x else None
            grad_params = list(post_grads[2 if want_x else 1 :])

            q, k, v = layer.attention_inputs(x_in, cos, sin)
            dq, dk, dv = layer.kernels.backward(
                _last_dim_contiguous(grad_attn), q.detach(), k.detach(), v.detach(), attn, lse, ctx.state, layer.softmax_scale
            )
            del grad_attn
            pre_inputs = ([x_in] if want_x else []) + trainable
            pre_grads = torch.autograd.grad((q, k, v), pre_inputs, (dq, dk, dv), allow_unused=True)

        if want_x:
            grad_x, pre_grads = grad_x_post + pre_grads[0], pre_grads[1:]
        else:
            grad_x = None
        for i, g in enumerate(pre_grads):
            if g is not None:
                grad_params[i] = g if grad_params[i] is None else grad_params[i] + g
        return (None, grad_x, None, None, *grad_params)


def _post_attention_for_backward(layer, x, attn, grad_y):
    """Outputs of the rebuilt post-attention half and the gradients to feed them.

    The layer output is ``y + act @ W_down.T + delta(act)`` (``delta``: the LoRA part). Its gradient
    reaches ``y`` as it is, ``delta`` as it is, and ``act`` through the frozen product as
    ``grad_y @ W_down``, so the rebuilt graph stops at ``act`` and the product is never recomputed.
    That gradient (tokens × intermediate size) is made before the graph is walked and held until
    the walk ends, so peak memory at long contexts is higher by about its size than when autograd
    makes and frees it (docs/benchmarks.md).
    """
    mlp_input = getattr(layer, "mlp_input", None)
    parts = mlp_input(x, attn) if mlp_input is not None else None
    if parts is None:
        return (layer.attention_outputs(x, attn),), (grad_y,)
    y, act = parts
    weight, delta = layer.down_parts(act)
    grad_act = torch.matmul(grad_y, weight.to(grad_y.dtype))
    outputs, grads = [y, act], [grad_y, grad_act]
    if delta is not None:
        outputs.append(delta)
        grads.append(grad_y)
    return tuple(outputs), tuple(grads)


def layer_forward(layer: Qwen3DecoderLayer, x, cos, sin, recompute: RecomputeMode) -> torch.Tensor:
    """Run one layer with the given recomputation mode."""
    if recompute == "none":
        return layer(x, cos, sin)
    if recompute == "full":
        return checkpoint(layer, x, cos, sin, use_reentrant=False)
    if recompute == "attention_output":
        trainable = [p for p in layer.parameters() if p.requires_grad]
        return _KeepAttentionOutput.apply(layer, x, cos, sin, *trainable)
    raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")


# ---------------------------------------------------------------------------------------------
# Hugging Face Qwen2/Qwen3 decoder layers with peft LoRA adapters.

HF_LAYER_CLASSES = ("Qwen2DecoderLayer", "Qwen3DecoderLayer")


def _plain_lora(module: nn.Module) -> tuple[torch.Tensor, list[tuple[nn.Module, nn.Module, float]]] | None:
    """(frozen weight, active (A, B, scaling) adapters) of a frozen linear or a peft LoRA linear;
    None where the module does more than ``x @ W.T + sum(scaling * B(A(x)))`` (a bias, a merged or
    DoRA adapter, LoRA dropout, a quantized base)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        ok = type(module) is nn.Linear and module.bias is None and not module.weight.requires_grad
        return (module.weight, []) if ok else None
    if type(base) is not nn.Linear or base.bias is not None or base.weight.requires_grad:
        return None
    if getattr(module, "merged", False) or getattr(module, "lora_variant", None):
        return None
    if getattr(module, "disable_adapters", False):
        return base.weight, []
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        a, b = module.lora_A[name], module.lora_B[name]
        if not isinstance(module.lora_dropout[name], nn.Identity) or type(a) is not nn.Linear or type(b) is not nn.Linear:
            return None
        adapters.append((a, b, module.scaling[name]))
    return base.weight, adapters


class HFDecoderSplit:
    """A Hugging Face Qwen2/Qwen3 decoder layer split at attention, for :class:`_KeepAttentionOutput`.

    Reads the layer's own modules (norms, the peft-wrapped projections, the MLP), so the adapter
    the backend trains and saves is unchanged. Attention runs causal over the whole row, without
    the padding mask: right-padded rows (what the trainer backends build) give the same values at
    every real token, and the padded tail carries no loss.
    """

    def __init__(self, layer: nn.Module, rotary: Callable):
        attn = layer.self_attn
        config = attn.config
        if getattr(attn, "sliding_window", None) or getattr(config, "use_sliding_window", False):
            raise ValueError("recompute='attention_output': sliding-window attention is not supported")
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError("recompute='attention_output': attention dropout must be 0 (no RNG state is kept)")
        self.layer, self.attn, self.mlp = layer, attn, layer.mlp
        self.rotary = rotary
        self.head_dim = attn.head_dim
        self.softmax_scale = attn.scaling
        self.kernels: AttentionKernels | None = None
        self._kernels_device: str | None = None

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.layer.parameters() if p.requires_grad]

    def select_kernels(self, x: torch.Tensor) -> None:
        if self._kernels_device == x.device.type:
            return
        if x.device.type == "cuda" and x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                "recompute='attention_output' on CUDA needs bfloat16 or float16 weights "
                f"(the flash kernels take 16-bit inputs), got {x.dtype}"
            )
        self.kernels, self._kernels_device = attention_kernels(x.device, dtype=x.dtype), x.device.type

    def attention_inputs(self, x, cos, sin):
        attn = self.attn
        b, s, _ = x.shape
        h = self.layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, s, -1, self.head_dim)
        k = attn.k_proj(h).view(b, s, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = attn.v_proj(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def attention_outputs(self, x, attn):
        b, s = x.shape[:2]
        y = x + self.attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        return y + self.mlp(self.layer.post_attention_layernorm(y))

    def mlp_input(self, x, attn):
        if _plain_lora(self.mlp.down_proj) is None:
            return None  # a down projection this split does not take apart: replay the whole half
        b, s = x.shape[:2]
        y = x + self.attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.layer.post_attention_layernorm(y)
        return y, self.mlp.act_fn(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)

    def down_parts(self, act):
        weight, adapters = _plain_lora(self.mlp.down_proj)
        delta = None
        for a, b, scaling in adapters:
            part = b(a(act.to(a.weight.dtype))) * scaling
            delta = part if delta is None else delta + part
        return weight, delta


def keep_attention_output_in_hf_layers(model: nn.Module) -> int:
    """Make every Qwen2/Qwen3 decoder layer of ``model`` keep only its input, attention output and
    log-sum-exp for backward (see :class:`_KeepAttentionOutput`); returns how many layers.

    Replaces each layer's ``forward`` on the instance (module names, and so adapter names, stay).
    The kept path runs when gradients are being recorded and the layer has a trainable parameter
    or a gradient-needing input; otherwise (``no_grad`` scoring, generation with a KV cache) the
    layer's own forward runs. Pass ``use_cache=False`` to the model when training.
    """
    import importlib

    layers = [m for m in model.modules() if type(m).__name__ in HF_LAYER_CLASSES]
    if not layers:
        raise ValueError(f"recompute='attention_output': no {' or '.join(HF_LAYER_CLASSES)} in the model")
    for layer in layers:
        rotary = importlib.import_module(type(layer).__module__).apply_rotary_pos_emb
        split = HFDecoderSplit(layer, rotary)
        layer.forward = _kept_forward(split, layer.forward)
    return len(layers)


def _kept_forward(split: HFDecoderSplit, original: Callable) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache", kwargs.get("past_key_value")))
        trainable = split.trainable()
        if args or cache is not None or not torch.is_grad_enabled() or not (trainable or hidden_states.requires_grad):
            return original(hidden_states, *args, **kwargs)
        cos, sin = kwargs["position_embeddings"]
        split.select_kernels(hidden_states)
        return _KeepAttentionOutput.apply(split, hidden_states, cos, sin, *trainable)

    return forward


class Qwen3Decoder(nn.Module):
    """A Qwen3-style decoder with frozen, randomly initialised base weights and LoRA adapters.

    Weights are random (the benchmark measures speed and memory, not quality); load real ones with
    ``load_state_dict`` if needed: the parameter names follow the layer structure above.
    """

    def __init__(self, shape: DecoderShape, *, dtype=torch.float32, device="cpu", kernels: AttentionKernels | None = None):
        super().__init__()
        self.shape = shape
        self.kernels = kernels or attention_kernels(device)
        self.embed = nn.Parameter(torch.randn(shape.vocab_size, shape.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(shape, self.kernels, dtype=dtype, device=device) for _ in range(shape.num_layers)
        )
        self.final_norm = nn.Parameter(torch.ones(shape.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = nn.Parameter(
            torch.randn(shape.vocab_size, shape.hidden_size, dtype=dtype, device=device) * shape.hidden_size**-0.5,
            requires_grad=False,
        )
        self._rope: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def _rope_tables(self, seq_len: int, like: torch.Tensor):
        if self._rope is None or self._rope[0] < seq_len or self._rope[1].dtype != like.dtype:
            cos, sin = rope_tables(self.shape, seq_len, dtype=like.dtype, device=like.device)
            self._rope = (seq_len, cos, sin)
        return self._rope[1][:seq_len], self._rope[2][:seq_len]

    def forward(self, input_ids: torch.Tensor, recompute: RecomputeMode = "attention_output") -> torch.Tensor:
        """Final hidden states (batch, seq, hidden) of ``input_ids`` (batch, seq)."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self._rope_tables(input_ids.shape[1], x)
        for layer in self.layers:
            x = layer_forward(layer, x, cos, sin, recompute)
        return F.rms_norm(x, self.final_norm.shape, self.final_norm, self.shape.rms_eps)

    def token_logprobs(self, hidden: torch.Tensor, target_ids: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
        """Log-probabilities (batch, seq) of ``target_ids`` under the LM head, in float32.

        The logits of a long sequence (seq × 151,936 floats) would outweigh every kept activation,
        so they are made and dropped chunk by chunk, and made again in backward.
        """
        return chunked_token_logprobs(hidden, self.lm_head, target_ids, chunk_tokens)


def _chunk_logprobs(hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, lm_head).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(hidden, lm_head, target_ids, chunk_tokens: int = 4096) -> torch.Tensor:
    pieces = []
    for start in range(0, hidden.shape[1], chunk_tokens):
        h = hidden[:, start : start + chunk_tokens]
        t = target_ids[:, start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, h, lm_head, t, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, lm_head, t))
    return torch.cat(pieces, dim=1)


__all__ = [
    "CUDA_KERNEL_NAMES",
    "AttentionKernels",
    "KernelChoice",
    "check_attention_kernels",
    "chosen_attention_kernels",
    "select_attention_kernels",
    "DecoderShape",
    "HFDecoderSplit",
    "LoRALinear",
    "Qwen3Decoder",
    "Qwen3DecoderLayer",
    "RECOMPUTE_MODES",
    "RecomputeMode",
    "attention_kernels",
    "chunked_token_logprobs",
    "keep_attention_output_in_hf_layers",
    "layer_forward",
    "rope_tables",
]
