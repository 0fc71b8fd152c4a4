"""A Qwen3-shaped reference decoder for the recomputation benchmarks and their tests.

The decoder is Qwen3-shaped (RMSNorm, q/k/v/o projections with per-head q/k RMSNorm, grouped-query
attention, rotary embeddings, SwiGLU MLP) with frozen, random base weights and LoRA on the seven
projections. Its three recomputation modes share every kernel (:mod:`training.attention`), so a
benchmark compares only what is kept::

    model = Qwen3Decoder(DecoderShape.qwen3("4b"), dtype=torch.bfloat16, device="cuda")
    hidden = model(input_ids, recompute="attention_output")   # or "none", "full"
    logprobs = model.token_logprobs(hidden, target_ids)

``attention_output`` is :class:`training.recompute.KeepAttentionOutput`, the scheme the torch/peft
trainer backend applies to Hugging Face layers. ``bench/recompute.py`` and
``bench/trainer_throughput.py`` measure it; the trainer itself never builds this model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.attention import AttentionKernels, FlashAttention, attention_kernels
from training.recompute import RECOMPUTE_MODES, KeepAttentionOutput, RecomputeMode


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
        attn = FlashAttention.apply(q, k, v, self.kernels, self.softmax_scale)
        return self.attention_outputs(x, attn)


def layer_forward(layer: Qwen3DecoderLayer, x, cos, sin, recompute: RecomputeMode) -> torch.Tensor:
    """Run one layer with the given recomputation mode."""
    if recompute == "none":
        return layer(x, cos, sin)
    if recompute == "full":
        return checkpoint(layer, x, cos, sin, use_reentrant=False)
    if recompute == "attention_output":
        trainable = [p for p in layer.parameters() if p.requires_grad]
        return KeepAttentionOutput.apply(layer, x, cos, sin, *trainable)
    raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")


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
    "DecoderShape",
    "LoRALinear",
    "Qwen3Decoder",
    "Qwen3DecoderLayer",
    "chunked_token_logprobs",
    "layer_forward",
    "rope_tables",
]
