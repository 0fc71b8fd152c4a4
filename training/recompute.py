"""Activation recomputation for long-context LoRA training that never recomputes attention.

Full activation recomputation (``torch.utils.checkpoint`` around each decoder layer) keeps only the
layer input and repeats the whole layer forward in backward, attention included; at 32K tokens and
beyond the attention forward is the most expensive part of that repeat. :class:`KeepAttentionOutput`
keeps, per layer, the layer input, the attention output and the attention's log-sum-exp. Backward
recomputes the cheap parts (RMSNorms, q/k/v projections with q/k norm and RoPE, the output
projection, the SwiGLU MLP, all with their LoRA adapters) and feeds the attention backward kernel
(:mod:`training.attention`) directly with the saved output and log-sum-exp, the two things a
flash-attention backward needs besides q, k and v. It also leaves out the one product of the layer
whose result backward never reads: the frozen down projection's (its input gradient is
``grad @ W``; only its LoRA branch is rebuilt). A full recomputation cannot skip it, since it
replays the layer's forward as written.

The torch/peft trainer backend's ``recompute="attention_output"`` installs it on Hugging Face
Qwen2/Qwen3 decoder layers with peft LoRA adapters (:func:`keep_attention_output_in_hf_layers`).
The benchmark decoder of :mod:`training.reference_decoder` runs the same scheme on its own layers,
so that the three modes (``none``, ``full``, ``attention_output``) can be compared kernel for kernel.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import nn

from training.fused_step import plain_lora  # shared with the fused layer, which imports nothing of this module

from training.attention import AttentionKernels, attention_kernels, last_dim_contiguous
import importlib
from training.fused_step import FusedKeepAttentionOutput
from training.fused_step import chosen_step_kernels, fused_layer_parts

RecomputeMode = Literal["none", "full", "attention_output"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "full", "attention_output")


class KeepAttentionOutput(torch.autograd.Function):
    """A decoder layer that keeps only its input, the attention output and the log-sum-exp.

    ``layer`` is split at attention (:class:`HFDecoderSplit` for a Hugging Face layer, or
    :class:`training.reference_decoder.Qwen3DecoderLayer`): ``attention_inputs(x, cos, sin) -> q, k, v``, ``attention_outputs(x, attn)
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
                last_dim_contiguous(grad_attn), q.detach(), k.detach(), v.detach(), attn, lse, ctx.state, layer.softmax_scale
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


# ---------------------------------------------------------------------------------------------
# Hugging Face Qwen2/Qwen3 decoder layers with peft LoRA adapters.

HF_LAYER_CLASSES = ("Qwen2DecoderLayer", "Qwen3DecoderLayer")


class HFDecoderSplit:
    """A Hugging Face Qwen2/Qwen3 decoder layer split at attention, for :class:`KeepAttentionOutput`.

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
        if plain_lora(self.mlp.down_proj) is None:
            return None  # a down projection this split does not take apart: replay the whole half
        b, s = x.shape[:2]
        y = x + self.attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.layer.post_attention_layernorm(y)
        return y, self.mlp.act_fn(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)

    def down_parts(self, act):
        weight, adapters = plain_lora(self.mlp.down_proj)
        delta = None
        for a, b, scaling in adapters:
            part = b(a(act.to(a.weight.dtype))) * scaling
            delta = part if delta is None else delta + part
        return weight, delta


def keep_attention_output_in_hf_layers(model: nn.Module, fused: bool | None = False) -> int:
    """Make every Qwen2/Qwen3 decoder layer of ``model`` keep only its input, attention output and
    log-sum-exp for backward (see :class:`KeepAttentionOutput`); returns how many layers.

    Replaces each layer's ``forward`` on the instance (module names, and so adapter names, stay).
    The kept path runs when gradients are being recorded and the layer has a trainable parameter
    or a gradient-needing input; otherwise (``no_grad`` scoring, generation with a KV cache) the
    layer's own forward runs. Pass ``use_cache=False`` to the model when training.

    ``fused`` runs the same scheme written out by hand (``training.fused_step.FusedKeepAttentionOutput``:
    fewer passes over memory, the same arithmetic) on every layer that qualifies (a Qwen3 layer with
    one plain LoRA adapter on each of its seven projections; ``fused_step.fused_layer_parts`` says
    why not): ``True`` on any device, ``None`` on CUDA in 16-bit dtypes only, ``False`` never. A
    layer that does not qualify runs :class:`KeepAttentionOutput`.
    """
    layers = [m for m in model.modules() if type(m).__name__ in HF_LAYER_CLASSES]
    if not layers:
        raise ValueError(f"recompute='attention_output': no {' or '.join(HF_LAYER_CLASSES)} in the model")
    for layer in layers:
        rotary = importlib.import_module(type(layer).__module__).apply_rotary_pos_emb
        split = HFDecoderSplit(layer, rotary)
        layer.forward = _kept_forward(split, layer.forward, fused)
    return len(layers)


def _use_fused(fused: bool | None, x: torch.Tensor) -> bool:
    if fused is None:
        return x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
    return fused


def _kept_forward(split: HFDecoderSplit, original: Callable, fused: bool | None = False) -> Callable:
    chosen: dict[str, object] = {}  # device type -> the layer's FusedLayerParts, or None: decided at the first call

    def forward(hidden_states, *args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache", kwargs.get("past_key_value")))
        trainable = split.trainable()
        if args or cache is not None or not torch.is_grad_enabled() or not (trainable or hidden_states.requires_grad):
            return original(hidden_states, *args, **kwargs)
        cos, sin = kwargs["position_embeddings"]
        split.select_kernels(hidden_states)
        device_type = hidden_states.device.type
        if device_type not in chosen:
            chosen[device_type] = None
            if _use_fused(fused, hidden_states):
                parts, _ = fused_layer_parts(split.layer)
                if parts is not None:
                    parts.kernels = split.kernels
                    parts.step_kernels = chosen_step_kernels(hidden_states.device, hidden_states.dtype).kernels
                chosen[device_type] = parts
        parts = chosen[device_type]
        if parts is not None:
            return FusedKeepAttentionOutput.apply(parts, hidden_states, cos, sin, *parts.trainable())
        return KeepAttentionOutput.apply(split, hidden_states, cos, sin, *trainable)

    return forward

__all__ = [
    "HF_LAYER_CLASSES",
    "HFDecoderSplit",
    "KeepAttentionOutput",
    "RECOMPUTE_MODES",
    "RecomputeMode",
    "keep_attention_output_in_hf_layers",
    "plain_lora",
]
