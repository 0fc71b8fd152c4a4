"""Fused kernels for the torch/peft trainer step on a GPU: a hand-written decoder layer for
``recompute="attention_output"`` and token log-probabilities under a frozen LM head.

Profiled on one H100 (docs/benchmarks.md, "The torch/peft trainer step, fused"), the step of
:class:`training.backends.torch_peft.TorchPeftBackend` spent about 30% of its GPU time at 8K tokens
outside matrix products and attention: residual and gradient adds that autograd makes one pass
each, the RoPE of Hugging Face (``cat``, ``neg``, three products and a sum, in forward, again in the
replay and backward), SiLU and the product apart, layout copies, each LoRA adapter's input read
three times, and the LM head's float32 logits made twice with seven passes over them. This module
does the same arithmetic with fewer passes:

- :class:`FusedKeepAttentionOutput` is the scheme of :class:`training.recompute.KeepAttentionOutput`
  (keep the layer input, the attention output and the log-sum-exp; rebuild the rest in backward; skip
  the frozen down product there) written out by hand for a Qwen3 layer with a peft LoRA on its seven
  projections: the residual adds ride in the frozen GEMMs' epilogue (``addmm`` with the residual as
  ``C``), every input gradient of a layer half is one chain of in-place ``addmm_`` (the frozen
  products and the LoRA ``A`` products summed in the GEMM epilogue, no separate add), the ``A``
  matrices of the projections that share an input (q/k/v, gate/up) run as one product, their rank-r
  outputs (tokens x 224 for the Qwen3-8B shape, 0.5 GiB over 36 layers at 32K) are kept from forward
  so backward never re-reads a layer input for them, and per-head RMSNorm + RoPE, SwiGLU and the
  RMSNorm backward (with the residual gradient added) are one kernel each (:class:`StepKernels`).
- :func:`frozen_head_token_logprobs` makes each chunk's logits once: in forward it computes
  ``log p(target)`` and also ``d log p(target) / d hidden = W[target] - softmax(logits) @ W`` (a
  hidden-sized float32 row per token), so backward is one product by the incoming gradient; the
  logits' log-sum-exp and softmax come from one kernel reading the bf16 logits.

The elementwise kernels are ``torch.compile``d (Triton, part of torch's CUDA wheel) on CUDA, and each
is checked once per process, device type and dtype against its eager form in float64 on random inputs
(:func:`chosen_step_kernels`, as :func:`training.attention.chosen_attention_kernels` checks the
attention kernels): one that raises or disagrees is replaced by the eager form, the reason kept. On
the CPU the eager forms run; the tests compare every path here with the unfused one in float64.

:func:`use_fp8_base_weights` opts a model's fused layers into FP8 products for their frozen weights
(``training.fp8``; the adapter and its gradients stay in the model's dtype), off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from training.fp8 import FP8_ATTRIBUTE, MULTIPLE, Fp8LayerWeights, chosen_quantize, fp8_supported

# -- the elementwise kernels, eager forms (the compiled ones are these, traced) -----------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    """The adjoint of :func:`_rotate_half` (``[-x2, x1]``): ``[z2, -z1]``."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` (tokens, heads, head_dim) by ``weight`` (head_dim), then rotary
    embedding with ``cos``/``sin`` (tokens, head_dim), as Qwen3's ``q_norm``/``k_norm`` and
    ``apply_rotary_pos_emb`` do; computed in float32 and rounded once."""
    acc = _acc(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
    return (normed * c + _rotate_half(normed) * s).to(x.dtype)


def qk_norm_rope_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The gradient of :func:`qk_norm_rope` with respect to ``x`` (``weight`` is frozen)."""
    acc = _acc(x.dtype)
    xf, g = x.to(acc), grad.to(acc)
    c, s = cos.to(acc)[:, None, :], sin.to(acc)[:, None, :]
    d_normed = g * c + _rotate_half_transposed(g * s)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    gw = d_normed * weight.to(acc)
    return (rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).to(x.dtype)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual_grad: torch.Tensor) -> torch.Tensor:
    """``residual_grad`` plus the gradient of ``rms_norm(x) * weight`` with respect to ``x`` (rows of
    the last dimension; ``weight`` frozen): the gradient of a pre-norm residual block's input."""
    acc = _acc(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    gw = grad.to(acc) * weight.to(acc)
    return (residual_grad.to(acc) + rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in float32, rounded once."""
    acc = _acc(gate.dtype)
    g = gate.to(acc)
    return (g * torch.sigmoid(g) * up.to(acc)).to(gate.dtype)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(silu(gate) * up, d gate, d up)`` for the incoming ``grad``: the product is made again here
    (backward needs it for the down projection's LoRA gradient) in the same pass."""
    acc = _acc(gate.dtype)
    g, u, d = gate.to(acc), up.to(acc), grad.to(acc)
    sig = torch.sigmoid(g)
    silu = g * sig
    return ((silu * u).to(gate.dtype), (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * silu).to(gate.dtype))


def logsumexp_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(logits) in float32, softmax(logits) in the logits' dtype)`` over the last dimension."""
    lf = logits.to(_acc(logits.dtype))
    lse = torch.logsumexp(lf, dim=-1)
    return lse, torch.exp(lf - lse[..., None]).to(logits.dtype)


class StepKernels(NamedTuple):
    """The elementwise kernels of a fused step; ``name`` says whether they are compiled."""

    name: str
    qk_norm_rope: Callable
    qk_norm_rope_backward: Callable
    rms_norm_backward: Callable
    swiglu: Callable
    swiglu_backward: Callable
    logsumexp_softmax: Callable


EAGER_KERNELS = StepKernels("eager", qk_norm_rope, qk_norm_rope_backward, rms_norm_backward, swiglu,
                            swiglu_backward, logsumexp_softmax)


def _compiled_kernels() -> StepKernels:
    # dynamic=True: one kernel for every token count (the RL loop's micro-batches vary in length)
    def comp(fn):
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return StepKernels("torch.compile", *(comp(f) for f in EAGER_KERNELS[1:]))


def _check_inputs(device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, tuple]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    tokens, heads, head_dim, hidden = 77, 3, 128, 320
    angle = torch.rand(tokens, head_dim // 2, generator=gen) * 6.3
    cos = torch.cat([angle.cos()] * 2, -1).to(device=device, dtype=dtype)
    sin = torch.cat([angle.sin()] * 2, -1).to(device=device, dtype=dtype)
    return {
        "qk_norm_rope": (rand(tokens, heads, head_dim), rand(head_dim), cos, sin, 1e-6),
        "qk_norm_rope_backward": (rand(tokens, heads, head_dim), rand(tokens, heads, head_dim), rand(head_dim), cos, sin, 1e-6),
        "rms_norm_backward": (rand(tokens, hidden), rand(tokens, hidden), rand(hidden), 1e-6, rand(tokens, hidden)),
        "swiglu": (rand(tokens, hidden, scale=3.0), rand(tokens, hidden)),
        "swiglu_backward": (rand(tokens, hidden, scale=3.0), rand(tokens, hidden), rand(tokens, hidden)),
        "logsumexp_softmax": (rand(tokens, 5000, scale=4.0),),
    }


def check_step_kernels(kernels: StepKernels, device: torch.device | str, dtype: torch.dtype) -> dict[str, float]:
    """The largest relative error (norm of the difference over the norm of the reference) of each of
    ``kernels``' outputs against the eager forms in float64 on the same random inputs. Raises what
    the kernels raise."""
    device = torch.device(device)
    errors = {}
    for name, args in _check_inputs(device, dtype).items():
        got = getattr(kernels, name)(*args)
        ref = getattr(EAGER_KERNELS, name)(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
        got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
        errors[name] = max(float((g.double() - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref))
    return errors


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, 1e-5)


@dataclass(frozen=True)
class StepKernelChoice:
    kernels: StepKernels
    errors: dict[str, float]
    rejected: dict[str, str]


_CHOSEN: dict[tuple[str, torch.dtype], StepKernelChoice] = {}


def chosen_step_kernels(device: torch.device | str, dtype: torch.dtype) -> StepKernelChoice:
    """The elementwise kernels for fused steps on ``device`` in ``dtype``, chosen once per process.

    On CUDA the compiled kernels, if each matches its eager form in float64 within the dtype's
    tolerance (1e-2 relative for bf16) on random inputs; otherwise, or on another device, the eager
    forms (checked the same way), with the compiled kernels' reason kept in ``rejected``.
    """
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _CHOSEN:
        rejected: dict[str, str] = {}
        candidates = [_compiled_kernels(), EAGER_KERNELS] if device.type == "cuda" else [EAGER_KERNELS]
        for kernels in candidates:
            try:
                errors = check_step_kernels(kernels, device, dtype)
            except Exception as e:  # noqa: BLE001  (a compiler failure is any exception; the reason is kept)
                rejected[kernels.name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                continue
            if all(e < _tolerance(dtype) for e in errors.values()):
                _CHOSEN[key] = StepKernelChoice(kernels, errors, rejected)
                break
            rejected[kernels.name] = "disagrees with the float64 reference: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
        else:
            raise RuntimeError(f"no step kernels on {device} in {dtype} match the float64 reference: {rejected}")
    return _CHOSEN[key]


# -- token log-probabilities under a frozen LM head --------------------------------------------


class _FrozenHeadTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] per row, and its gradient with respect to the row,
    both made in forward chunk by chunk; backward scales the kept gradient rows."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                kernels: StepKernels):
        acc = _acc(hidden.dtype)
        rows = hidden.shape[0]
        out = torch.empty(rows, dtype=acc, device=hidden.device)
        want = ctx.needs_input_grad[0]
        jac = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if want else None
        for start in range(0, rows, chunk_tokens):
            end = min(start + chunk_tokens, rows)
            t = targets[start:end]
            logits = F.linear(hidden[start:end], weight)
            lse, probs = kernels.logsumexp_softmax(logits)
            out[start:end] = logits.gather(-1, t[:, None]).squeeze(-1).to(acc) - lse
            del logits
            if want:
                # d/d hidden of logits[target] - logsumexp(logits) = W[target] - softmax(logits) @ W
                expected = probs @ weight
                torch.sub(weight[t].to(acc), expected.to(acc), out=jac[start:end])
                del expected
            del probs
        ctx.save_for_backward(jac if want else None)
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (jac,) = ctx.saved_tensors
        grad_hidden = None
        if jac is not None:
            grad_hidden = (jac * grad.to(jac.dtype)[:, None]).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None


def frozen_head_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               chunk_tokens: int, kernels: StepKernels = EAGER_KERNELS) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T)`` at ``targets`` (float32; float64 for float64 inputs), shaped
    like ``targets``, for an LM head ``weight`` (vocab, hidden_size) that is not trained: the same
    values as :func:`training.logprobs.token_logprobs` and the same gradient for ``hidden``, with one
    product of each chunk's logits instead of two. Keeps a float32 (tokens, hidden_size) gradient
    row per token from forward to backward (0.5 GiB at 32K tokens of a 4096-wide model) instead of
    the hidden states; at most ``chunk_tokens`` rows of logits exist at a time."""
    if weight.requires_grad:
        raise ValueError("frozen_head_token_logprobs: the LM head weight requires a gradient "
                         "(use training.logprobs.token_logprobs for a trained head)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: expected hidden = targets + (hidden_size,)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)}: expected (vocab, {hidden.shape[-1]})")
    flat = _FrozenHeadTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                          chunk_tokens, kernels)
    return flat.view(targets.shape)


# -- the decoder layer ---------------------------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class _Projection:
    weight: torch.Tensor  # frozen (out, in)
    a: nn.Parameter  # (r, in)
    b: nn.Parameter  # (out, r)
    scaling: float


class FusedLayerParts:
    """What :class:`FusedKeepAttentionOutput` reads of a Hugging Face Qwen3 decoder layer with a peft
    LoRA adapter on its seven projections: frozen weights, the adapter's factors (in
    :data:`PROJECTIONS` order, A then B), the norms' weights and epsilons, the head layout. Built by
    :func:`fused_layer_parts`, which says why a layer does not qualify."""

    def __init__(self, layer: nn.Module, projections: dict[str, _Projection]):
        attn, mlp = layer.self_attn, layer.mlp
        self.p = projections
        self.norm_in = (layer.input_layernorm.weight, _eps(layer.input_layernorm))
        self.norm_post = (layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm))
        self.q_norm = (attn.q_norm.weight, _eps(attn.q_norm))
        self.k_norm = (attn.k_norm.weight, _eps(attn.k_norm))
        self.head_dim = attn.head_dim
        self.heads = projections["q_proj"].weight.shape[0] // self.head_dim
        self.kv_heads = projections["k_proj"].weight.shape[0] // self.head_dim
        self.softmax_scale = attn.scaling
        self.kernels = None  # attention kernels (training.attention), set at the first call
        self.step_kernels: StepKernels | None = None
        self.layer = layer
        self.fp8: Fp8LayerWeights | None = None  # made at the first call in FP8 mode (training.fp8)
        self.quantize: Callable | None = None
        self.fp8_calls = 0  # layer calls whose frozen products ran in FP8
        self.fp8_skipped = ""  # why the last call in FP8 mode ran bf16 products instead

    def trainable(self) -> list[nn.Parameter]:
        return [t for name in PROJECTIONS for t in (self.p[name].a, self.p[name].b)]

    def fp8_weights(self, x2: torch.Tensor) -> Fp8LayerWeights | None:
        """The layer's frozen weights in FP8 when the layer is in FP8 mode
        (:func:`use_fp8_base_weights`) and this call can use them (a device with FP8 products, a
        token count that is a multiple of 16), made at the first such call; else None."""
        if not getattr(self.layer, FP8_ATTRIBUTE, False):
            return None
        if x2.shape[0] % MULTIPLE:
            self.fp8_skipped = f"{x2.shape[0]} tokens, not a multiple of {MULTIPLE}"
            return None
        if self.fp8 is None:
            ok, why = fp8_supported(x2.device)
            dims = [d for name in PROJECTIONS for d in self.p[name].weight.shape]
            if ok and any(d % MULTIPLE for d in dims):
                ok, why = False, f"a projection dimension is not a multiple of {MULTIPLE}"
            if not ok:
                self.fp8_skipped = why
                return None
            self.quantize = chosen_quantize(x2.device, x2.dtype).quantize_rows
            self.fp8 = Fp8LayerWeights.of({name: self.p[name].weight for name in PROJECTIONS})
        self.fp8_calls += 1
        return self.fp8


def plain_lora(module: nn.Module) -> tuple[torch.Tensor, list[tuple[nn.Module, nn.Module, float]]] | None:
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


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def fused_layer_parts(layer: nn.Module) -> tuple[FusedLayerParts | None, str]:
    """``(parts, "")`` for a layer :class:`FusedKeepAttentionOutput` can run, else ``(None, why not)``:
    a Qwen3 layer (per-head q/k RMSNorm, SiLU MLP, no biases) whose seven projections each carry one
    active, plain LoRA adapter (no dropout, not merged, no DoRA) and whose only trainable parameters
    are those adapters' factors."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not hasattr(attn, "q_norm") or not hasattr(attn, "k_norm"):
        return None, "not a Qwen3 layer (no self_attn.q_norm/k_norm)"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm):
        if not type(norm).__name__.endswith("RMSNorm") or getattr(norm, "bias", None) is not None:
            return None, f"{type(norm).__name__} is not a plain RMSNorm"
    act = getattr(getattr(attn, "config", None), "hidden_act", None)
    if act not in ("silu", "swish"):
        return None, f"hidden_act {act!r} (the fused MLP is SwiGLU)"
    projections = {}
    for name in PROJECTIONS:
        module = getattr(attn, name, None) or getattr(mlp, name, None)
        parts = plain_lora(module) if module is not None else None
        if parts is None or len(parts[1]) != 1:
            return None, f"{name} is not a frozen linear with exactly one plain LoRA adapter"
        weight, ((a, b, scaling),) = parts
        if a.bias is not None or b.bias is not None or not (a.weight.requires_grad and b.weight.requires_grad):
            return None, f"{name}: the adapter has a bias or a frozen factor"
        if a.weight.dtype != weight.dtype or b.weight.dtype != weight.dtype:
            return None, f"{name}: adapter dtype {a.weight.dtype} differs from the base weight's {weight.dtype}"
        projections[name] = _Projection(weight, a.weight, b.weight, float(scaling))
    parts = FusedLayerParts(layer, projections)
    if {id(p) for p in layer.parameters() if p.requires_grad} != {id(p) for p in parts.trainable()}:
        return None, "the layer trains parameters other than its LoRA factors"
    return parts, ""


def _lora_out(x: torch.Tensor, proj: _Projection, xa: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + x @ W.T + scaling * xa @ B.T``. Without a residual, the rank-r product is made
    first (one write of the output) and the frozen product adds itself to it in its epilogue, where
    reading ``C`` hides under the arithmetic; a rank-r ``addmm_`` after it would read and write the
    whole output once more. With one, the frozen product takes the residual as ``C`` and the rank-r
    product is added in place after (either order makes one extra pass there)."""
    if residual is None:
        return torch.mm(xa * proj.scaling, proj.b.t()).addmm_(x, proj.weight.t())
    return torch.addmm(residual, x, proj.weight.t()).addmm_(xa, proj.b.t(), alpha=proj.scaling)


def _lora_grads(grad_out: torch.Tensor, xa: torch.Tensor, proj: _Projection) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d xa, d B)`` of ``scaling * xa @ B.T`` for the output gradient ``grad_out``."""
    return torch.mm(grad_out, proj.b).mul_(proj.scaling), torch.mm(grad_out.t(), xa).mul_(proj.scaling)


def _split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes, dim=0))


class FusedKeepAttentionOutput(torch.autograd.Function):
    """A Qwen3 decoder layer with LoRA that keeps its input, attention output, log-sum-exp and the
    adapters' rank-r activations for backward, with forward and backward written out (see the module
    docstring). Same arguments as :class:`training.recompute.KeepAttentionOutput` with
    :class:`FusedLayerParts` as the layer and the 14 LoRA factors (``parts.trainable()``) as
    ``trainable``. Rows are causal and unmasked (right-padded rows, as the backend builds). In FP8
    mode (``training.fp8``) the frozen products, forward, replayed and input gradients, run in FP8
    against the stacked q/k/v and gate/up weights; the adapter's products stay in the model's dtype."""

    @staticmethod
    def forward(ctx, parts: FusedLayerParts, x, cos, sin, *trainable):
        p, sk = parts.p, parts.step_kernels
        b, s, hidden = x.shape
        tokens = b * s
        x2 = x.reshape(tokens, hidden)
        cos2, sin2 = (t.expand(b, s, t.shape[-1]).reshape(tokens, t.shape[-1]) for t in (cos, sin))
        f8 = parts.fp8_weights(x2)
        with torch.no_grad():
            q, k, v, q_raw, k_raw, xa_qkv = _attention_inputs(parts, x2, cos2, sin2, None, f8)
            del q_raw, k_raw
            q4, k4, v4 = (t.view(b, s, -1, parts.head_dim).transpose(1, 2) for t in (q, k, v))
            attn, lse, state = parts.kernels.forward(q4, k4, v4, parts.softmax_scale)
            del q, k, v, q4, k4, v4
            attn2 = attn.transpose(1, 2).reshape(tokens, -1)
            xa_o = torch.mm(attn2, p["o_proj"].a.t())
            y = _residual_out(parts, "o_proj", attn2, xa_o, x2, f8)
            h2 = F.rms_norm(y, (hidden,), *parts.norm_post)
            a_gu = torch.cat((p["gate_proj"].a, p["up_proj"].a))
            xa_gu = torch.mm(h2, a_gu.t())
            gate, up = _gate_up(parts, h2, xa_gu, f8)
            del h2
            act = sk.swiglu(gate, up)
            del gate, up
            xa_d = torch.mm(act, p["down_proj"].a.t())
            out = _residual_out(parts, "down_proj", act, xa_d, y, f8)
            del act, y
        ctx.save_for_backward(x, cos, sin, attn, lse, xa_qkv, xa_o, xa_gu, xa_d)
        ctx.parts, ctx.state, ctx.f8 = parts, state, f8
        return out.view(b, s, hidden)

    @staticmethod
    def backward(ctx, grad_out):
        x, cos, sin, attn, lse, xa_qkv, xa_o, xa_gu, xa_d = ctx.saved_tensors
        parts, f8 = ctx.parts, ctx.f8
        p, sk = parts.p, parts.step_kernels
        want_x = ctx.needs_input_grad[1]
        b, s, hidden = x.shape
        tokens = b * s
        x2 = x.reshape(tokens, hidden)
        cos2, sin2 = (t.expand(b, s, t.shape[-1]).reshape(tokens, t.shape[-1]) for t in (cos, sin))
        dout = grad_out.reshape(tokens, hidden).to(x.dtype)
        if not dout.is_contiguous():
            dout = dout.contiguous()
        grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        # the post-attention half, rebuilt up to the down projection's input
        attn2 = attn.transpose(1, 2).reshape(tokens, -1)
        y = _residual_out(parts, "o_proj", attn2, xa_o, x2, f8)
        w_post, eps_post = parts.norm_post
        h2 = F.rms_norm(y, (hidden,), w_post, eps_post)
        r_g = p["gate_proj"].a.shape[0]
        gate, up = _gate_up(parts, h2, xa_gu, f8)

        # down projection: its frozen product is not rebuilt, only its input gradient is made
        dxa_d, grad_b_d = _lora_grads(dout, xa_d, p["down_proj"])
        d_act = _input_grad(parts, [dout], ["down_proj"], dxa_d, p["down_proj"].a, f8 and f8.down)
        act, d_gate, d_up = sk.swiglu_backward(gate, up, d_act)
        del gate, up, d_act
        grads["down_proj"] = (torch.mm(dxa_d.t(), act), grad_b_d)
        del act

        # gate/up projections and the post-attention norm
        dxa_g, grad_b_g = _lora_grads(d_gate, xa_gu[:, :r_g], p["gate_proj"])
        dxa_u, grad_b_u = _lora_grads(d_up, xa_gu[:, r_g:], p["up_proj"])
        dxa_gu = torch.cat((dxa_g, dxa_u), dim=1)
        a_gu = torch.cat((p["gate_proj"].a, p["up_proj"].a))
        d_h2 = _input_grad(parts, [d_gate, d_up], ["gate_proj", "up_proj"], dxa_gu, a_gu, f8 and f8.gate_up)
        del d_gate, d_up
        grad_a_g, grad_a_u = _split_rows(torch.mm(dxa_gu.t(), h2), [r_g, a_gu.shape[0] - r_g])
        grads["gate_proj"], grads["up_proj"] = (grad_a_g, grad_b_g), (grad_a_u, grad_b_u)
        del h2
        dy = sk.rms_norm_backward(d_h2, y, w_post, eps_post, dout)
        del d_h2, y, dout

        # output projection
        dxa_o, grad_b_o = _lora_grads(dy, xa_o, p["o_proj"])
        d_attn = _input_grad(parts, [dy], ["o_proj"], dxa_o, p["o_proj"].a, f8 and f8.o)
        grads["o_proj"] = (torch.mm(dxa_o.t(), attn2), grad_b_o)

        # the pre-attention half, rebuilt; attention backward on the kept output and log-sum-exp
        q, k, v, q_raw, k_raw, _ = _attention_inputs(parts, x2, cos2, sin2, xa_qkv, f8)
        q4, k4, v4 = (t.view(b, s, -1, parts.head_dim).transpose(1, 2) for t in (q, k, v))
        d_attn4 = d_attn.view(b, s, -1, parts.head_dim).transpose(1, 2)
        dq4, dk4, dv4 = parts.kernels.backward(d_attn4, q4, k4, v4, attn, lse, ctx.state, parts.softmax_scale)
        del d_attn, d_attn4, q, k, q4, k4, v4, v
        dq, dk, dv = (t.transpose(1, 2).reshape(tokens, -1) for t in (dq4, dk4, dv4))
        del dq4, dk4, dv4
        w_qn, eps_qn = parts.q_norm
        w_kn, eps_kn = parts.k_norm
        d_q = sk.qk_norm_rope_backward(dq.view(tokens, -1, parts.head_dim), q_raw, w_qn, cos2, sin2, eps_qn).view(tokens, -1)
        d_k = sk.qk_norm_rope_backward(dk.view(tokens, -1, parts.head_dim), k_raw, w_kn, cos2, sin2, eps_kn).view(tokens, -1)
        del dq, dk, q_raw, k_raw
        ranks = [p[n].a.shape[0] for n in ("q_proj", "k_proj", "v_proj")]
        xa_q, xa_k, xa_v = torch.split(xa_qkv, ranks, dim=1)
        dxa_q, grad_b_q = _lora_grads(d_q, xa_q, p["q_proj"])
        dxa_k, grad_b_k = _lora_grads(d_k, xa_k, p["k_proj"])
        dxa_v, grad_b_v = _lora_grads(dv, xa_v, p["v_proj"])
        dxa_qkv = torch.cat((dxa_q, dxa_k, dxa_v), dim=1)
        w_in, eps_in = parts.norm_in
        h1 = F.rms_norm(x2, (hidden,), w_in, eps_in)
        grad_a_q, grad_a_k, grad_a_v = _split_rows(torch.mm(dxa_qkv.t(), h1), ranks)
        del h1
        grads["q_proj"], grads["k_proj"], grads["v_proj"] = (grad_a_q, grad_b_q), (grad_a_k, grad_b_k), (grad_a_v, grad_b_v)
        grad_x = None
        if want_x:
            a_qkv = torch.cat([p[n].a for n in ("q_proj", "k_proj", "v_proj")])
            d_h1 = _input_grad(parts, [d_q, d_k, dv], ["q_proj", "k_proj", "v_proj"], dxa_qkv, a_qkv, f8 and f8.qkv)
            del d_q, d_k, dv
            grad_x = sk.rms_norm_backward(d_h1, x2, w_in, eps_in, dy).view(b, s, hidden)
        return (None, grad_x, None, None, *(g for name in PROJECTIONS for g in grads[name]))


def _residual_out(parts: FusedLayerParts, name: str, x: torch.Tensor, xa: torch.Tensor, residual: torch.Tensor,
                  f8: Fp8LayerWeights | None) -> torch.Tensor:
    """``residual + x @ W.T + scaling * xa @ B.T`` of the o or down projection; in FP8 mode the frozen
    product in FP8 (``x`` quantized per row here), the residual and the rank-r product added after it."""
    proj = parts.p[name]
    if f8 is None:
        return _lora_out(x, proj, xa, residual=residual)
    weight = f8.o if name == "o_proj" else f8.down
    return weight.forward(*parts.quantize(x), x.dtype).add_(residual).addmm_(xa, proj.b.t(), alpha=proj.scaling)


def _gate_up(parts: FusedLayerParts, h2: torch.Tensor, xa_gu: torch.Tensor, f8: Fp8LayerWeights | None):
    """``(gate, up)`` projections of the normed ``h2`` with their LoRA (``xa_gu``: gate's rank-r
    activations, then up's); in FP8 mode one product against the stacked weights, gate and up being
    column slices of it."""
    p = parts.p
    r_g = p["gate_proj"].a.shape[0]
    if f8 is None:
        return _lora_out(h2, p["gate_proj"], xa_gu[:, :r_g]), _lora_out(h2, p["up_proj"], xa_gu[:, r_g:])
    gu = f8.gate_up.forward(*parts.quantize(h2), h2.dtype)
    inter = p["gate_proj"].weight.shape[0]
    gate, up = gu[:, :inter], gu[:, inter:]
    gate.addmm_(xa_gu[:, :r_g], p["gate_proj"].b.t(), alpha=p["gate_proj"].scaling)
    up.addmm_(xa_gu[:, r_g:], p["up_proj"].b.t(), alpha=p["up_proj"].scaling)
    return gate, up


def _input_grad(parts: FusedLayerParts, grads: list[torch.Tensor], names: list[str], dxa: torch.Tensor,
                a: torch.Tensor, f8_weight) -> torch.Tensor:
    """``sum(g @ W_name) + dxa @ a``: the gradient of the input shared by the projections ``names``
    for their output gradients ``grads``, ``a`` their stacked LoRA ``A`` matrices and ``dxa`` the
    rank-r gradients. bf16: the rank-r part first, each frozen product added in its epilogue; FP8
    (``f8_weight``, the stacked weights): the output gradients side by side, quantized per row in one
    pass, one product, the rank-r part added after it."""
    if f8_weight is None:
        out = torch.mm(dxa, a)
        for g, name in zip(grads, names):
            out.addmm_(g, parts.p[name].weight)
        return out
    return f8_weight.backward(*parts.quantize(*grads), grads[0].dtype).addmm_(dxa, a)


def _attention_inputs(parts: FusedLayerParts, x2, cos2, sin2, xa_qkv, f8: Fp8LayerWeights | None = None):
    """``(q, k, v, q before norm and RoPE, k likewise, xa_qkv)`` of a layer for the flattened input
    ``x2`` (tokens, hidden); q and k (tokens, heads·head_dim) after per-head norm and RoPE.
    ``xa_qkv`` (the q/k/v adapters' rank-r activations) is made here when None. In FP8 mode q, k and
    v come from one product against the stacked weights."""
    p, sk = parts.p, parts.step_kernels
    w_in, eps_in = parts.norm_in
    h1 = F.rms_norm(x2, (x2.shape[-1],), w_in, eps_in)
    ranks = [p[n].a.shape[0] for n in ("q_proj", "k_proj", "v_proj")]
    if xa_qkv is None:
        xa_qkv = torch.mm(h1, torch.cat([p[n].a for n in ("q_proj", "k_proj", "v_proj")]).t())
    xa_q, xa_k, xa_v = torch.split(xa_qkv, ranks, dim=1)
    tokens, d = x2.shape[0], parts.head_dim
    if f8 is None:
        q_raw = _lora_out(h1, p["q_proj"], xa_q).view(tokens, -1, d)
        k_raw = _lora_out(h1, p["k_proj"], xa_k).view(tokens, -1, d)
        v = _lora_out(h1, p["v_proj"], xa_v)
    else:
        qkv = f8.qkv.forward(*parts.quantize(h1), h1.dtype)
        outs = torch.split(qkv, [p[n].weight.shape[0] for n in ("q_proj", "k_proj", "v_proj")], dim=1)
        for out, xa, name in zip(outs, (xa_q, xa_k, xa_v), ("q_proj", "k_proj", "v_proj")):
            out.addmm_(xa, p[name].b.t(), alpha=p[name].scaling)
        q_raw, k_raw = outs[0].view(tokens, -1, d), outs[1].view(tokens, -1, d)
        v = outs[2].contiguous()
    del h1
    (w_qn, eps_qn), (w_kn, eps_kn) = parts.q_norm, parts.k_norm
    q = sk.qk_norm_rope(q_raw, w_qn, cos2, sin2, eps_qn).view(tokens, -1)
    k = sk.qk_norm_rope(k_raw, w_kn, cos2, sin2, eps_kn).view(tokens, -1)
    return q, k, v, q_raw, k_raw, xa_qkv


def use_fp8_base_weights(model: nn.Module, on: bool = True) -> int:
    """Opt the decoder layers of ``model`` that the fused layer can run (:func:`fused_layer_parts`)
    into FP8 products for their frozen weights (``training.fp8``; ``on=False`` turns it off again);
    returns how many. The layers take it up at their next call with gradients through
    :class:`FusedKeepAttentionOutput` (``recompute="attention_output"`` with the fused kernels).
    Raises ``ValueError`` with the reason when no layer qualifies."""
    count, why = 0, "no decoder layers (modules with self_attn and mlp)"
    for layer in (m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")):
        parts, reason = fused_layer_parts(layer)
        if parts is None:
            why = reason
            continue
        setattr(layer, FP8_ATTRIBUTE, bool(on))
        count += 1
    if count == 0:
        raise ValueError(f"use_fp8_base_weights: no layer of {type(model).__name__} can run the fused layer: {why}")
    return count


__all__ = [
    "EAGER_KERNELS",
    "FusedKeepAttentionOutput",
    "FusedLayerParts",
    "StepKernelChoice",
    "StepKernels",
    "check_step_kernels",
    "chosen_step_kernels",
    "frozen_head_token_logprobs",
    "fused_layer_parts",
    "use_fp8_base_weights",
]
