"""Trainer backend on Megatron-core: tensor-parallel Qwen2/Qwen3 with LoRA on its parallel linears,
data parallel over groups of tensor-parallel ranks.

Run one process per GPU (``torchrun --nproc-per-node N``); every rank builds the backend with the
same arguments and feeds it the same :class:`~training.grpo.TrainBatch` (the whole step's). The
N ranks form ``N / tensor_parallel_size`` data-parallel replicas (Megatron's ``parallel_state``:
tensor-parallel ranks adjacent, data-parallel groups across them; ``tensor_parallel_size`` defaults
to N, one replica). Each replica trains on its shard of the batch
(``training.backends.parallel.shard_rows``) and the LoRA gradients are summed over
``parallel_state.get_data_parallel_group()`` in one float32 all-reduce before the gradient norm and the
optimizer step, as in the torch/peft backend (``training.backends.parallel``). Megatron-core is a GPU
extra that the CPU machines here do not install: the data-parallel path is tested through the shared
step and the torch/peft backend under gloo; this backend's own checks are ``bench/megatron_tp.py``
(``tests/training/test_megatron_backend.py`` where megatron-core is installed). The base model is a
Hugging Face Qwen2 or Qwen3 folder (``config.json`` + safetensors); each rank reads only its shard
of every weight (:mod:`training.backends.megatron_weights`). The step is
:func:`training.backends.step.grpo_train_step`, the one the torch/peft backend takes, on token
log-probabilities computed from vocabulary-parallel logits.

LoRA sits on Megatron's fused linears as one adapter per Hugging Face projection, so that the
adapter this backend saves is a plain peft folder with the names the torch/peft backend and the
inference engines use (``...self_attn.q_proj.lora_A.weight``), and a peft adapter trained elsewhere
loads here exactly:

- ``linear_qkv`` (column-parallel, fused q/k/v interleaved by query group): q, k and v each have an
  A (rank × hidden, replicated on every rank) and a B sharded like the heads;
- ``linear_fc1`` (column-parallel, ``[gate; up]`` per rank): gate and up likewise;
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) (row-parallel): A sharded like the input,
  B replicated; the rank-r product is all-reduced before B, so the extra communication per layer is
  a few rank-sized vectors per token.

Replicated factors get identical gradients on every rank (the column case all-reduces the rank-r
gradient; the row case sees the already-reduced output gradient), so plain per-rank AdamW keeps
them identical. Attention runs through the kernels :mod:`training.attention` checks and picks (cuDNN on Hopper).

Checkpoints: ``save_state`` writes ``adapter/`` (the peft folder, as the torch backend does) and one
``optimizer-tp{rank}.pt`` per tensor-parallel rank, from data-parallel replica 0 (the replicas are
identical); ``load_state`` takes that layout at any data-parallel size with the same tensor-parallel
size. An adapter-only folder from
the torch/peft backend can be loaded with :meth:`MegatronBackend.load_adapter` (its optimizer state
does not carry over: the parameter shapes differ).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from training.attention import FlashAttention, attention_kernels
from training.backends import (DEFAULT_MAX_GRAD_NORM, DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_WEIGHT_DECAY,
                               LORA_TARGET_MODULES, StepResult)
from training.backends.megatron_weights import QwenConfig, load_base_weights
from training.backends.parallel import DataParallel, broadcast_from_first
from training.backends.step import grpo_train_step
from training.checkpoint import adapter_dir
from training.config import TrainConfig
from training.grpo import LossConfig, TrainBatch
from training.recompute import RECOMPUTE_MODES


def _megatron():
    # imported on first use: megatron-core is a GPU extra, and this module is read without it
    try:
        # optional: Megatron-core is a GPU library, loaded only when this backend is built
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the megatron trainer backend needs megatron-core (pip install 'posttrain[gpu]')"
        ) from e
    return parallel_state, tensor_parallel, GPTModel, get_gpt_layer_local_spec, TransformerConfig


# ---------------------------------------------------------------------------------------------
# LoRA on Megatron's parallel linears.


class _ColumnLoRA(nn.Module):
    """LoRA pairs on a column-parallel linear whose local output is made of several projections.

    ``segments`` gives, per Hugging Face projection, its local output size; ``combine`` places the
    per-projection updates into the fused local output layout.
    """

    def __init__(self, base: nn.Module, names: Sequence[str], local_sizes: Sequence[int],
                 combine: Callable[[list[torch.Tensor]], torch.Tensor], rank: int, alpha: float, tp_group):
        super().__init__()
        self.base, self.names, self.combine, self.tp_group = base, tuple(names), combine, tp_group
        weight = base.weight
        fan_in = weight.shape[1]
        self.lora_a = nn.ParameterList(
            nn.Parameter(torch.empty(rank, fan_in, dtype=weight.dtype, device=weight.device)) for _ in names
        )
        self.lora_b = nn.ParameterList(
            nn.Parameter(torch.zeros(n, rank, dtype=weight.dtype, device=weight.device)) for n in local_sizes
        )
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        _, tensor_parallel, *_ = _megatron()
        deltas = []
        for a, b in zip(self.lora_a, self.lora_b):
            h = tensor_parallel.copy_to_tensor_model_parallel_region(F.linear(x, a), group=self.tp_group)
            deltas.append(F.linear(h, b))
        return out + self.combine(deltas) * self.scale, bias


class _RowLoRA(nn.Module):
    """One LoRA pair on a row-parallel linear: A sharded like the input, B replicated."""

    def __init__(self, base: nn.Module, name: str, rank: int, alpha: float, tp_group):
        super().__init__()
        self.base, self.names, self.tp_group = base, (name,), tp_group
        weight = base.weight
        self.lora_a = nn.ParameterList([nn.Parameter(torch.empty(rank, weight.shape[1], dtype=weight.dtype, device=weight.device))])
        self.lora_b = nn.ParameterList([nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype, device=weight.device))])
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        _, tensor_parallel, *_ = _megatron()
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_a[0]), group=self.tp_group)
        return out + F.linear(h, self.lora_b[0]) * self.scale, bias


def _interleave_qkv(groups: int, q_per_group: int, head_dim: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Megatron's fused q/k/v layout: per local query group, its q heads, then its k, then its v."""

    def combine(deltas: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = deltas
        lead = q.shape[:-1]
        parts = (q.view(*lead, groups, q_per_group * head_dim), k.view(*lead, groups, head_dim), v.view(*lead, groups, head_dim))
        return torch.cat(parts, dim=-1).view(*lead, groups * (q_per_group + 2) * head_dim)

    return combine


def _concat(deltas: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(deltas, dim=-1)


class _FlashCoreAttention(nn.Module):
    """Megatron core attention through the flash kernels of :mod:`training.attention` (causal, GQA)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        self.kernels = None  # chosen and checked on the first call, for its device and dtype
        self.softmax_scale = softmax_scale or config.kv_channels**-0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("flash core attention: packed sequences and attention bias are not supported")
        # [s, b, heads, d] -> [b, heads, s, d] (views)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.is_cuda and q.dtype == torch.float32:
            # CUDA flash kernels take 16-bit inputs only; float32 (checks) goes through SDPA.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
        else:
            if self.kernels is None:
                self.kernels = attention_kernels(q.device, dtype=q.dtype)
            out = FlashAttention.apply(q, k, v, self.kernels, self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


# ---------------------------------------------------------------------------------------------
# The backend.


def _keep_rope_on_cpu(model: nn.Module) -> None:
    """Megatron's rotary embedding moves its frequencies to CUDA on first use; on the CPU (tests,
    with gloo) keep them where they are. The rest of the table is computed as Megatron does."""
    rope = model.rotary_pos_emb

    def get_emb(self, max_seq_len: int, offset: int = 0):
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    rope.get_emb = types.MethodType(get_emb, rope)


def _ensure_distributed(tensor_parallel_size: int | None, device: str) -> tuple[int, int]:
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    tp = tensor_parallel_size or world
    if world % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the world size {world}")
    return world, tp


class MegatronBackend:
    """GRPO steps on a tensor-parallel Megatron-core model with LoRA (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        tensor_parallel_size: int | None = None,
        lora_rank: int = TrainConfig.lora_rank,
        lora_alpha: int = TrainConfig.lora_alpha,
        target_modules: Sequence[str] = LORA_TARGET_MODULES,
        learning_rate: float = TrainConfig.learning_rate,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        max_grad_norm: float = DEFAULT_MAX_GRAD_NORM,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        seed: int = TrainConfig.seed,
        device: str = "cuda",
        dtype: str = "bfloat16",
        recompute: str = TrainConfig.recompute,
    ) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        if recompute != "none":
            raise NotImplementedError(
                f"recompute={recompute!r}: the megatron backend keeps every activation (use recompute='none'). "
                "'attention_output' needs each layer split at attention with its tensor-parallel all-reduces "
                "replayed in backward, and Megatron's own full recomputation is unchecked with LoRA on frozen "
                "tensor-parallel weights here; both recompute modes run in the torch_peft backend"
            )
        if tuple(sorted(target_modules)) != tuple(sorted(LORA_TARGET_MODULES)):
            raise ValueError(f"target_modules: the megatron backend puts LoRA on all of {LORA_TARGET_MODULES}")
        parallel_state, tensor_parallel, GPTModel, get_spec, TransformerConfig = _megatron()
        self.model_path = Path(model_path)
        self.config = cfg = QwenConfig.from_folder(self.model_path)
        world, tp = _ensure_distributed(tensor_parallel_size, device)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank, self.tp = parallel_state.get_tensor_model_parallel_rank(), tp
        self.data_parallel = DataParallel(parallel_state.get_data_parallel_rank(),
                                          parallel_state.get_data_parallel_world_size(),
                                          parallel_state.get_data_parallel_group())
        if cfg.num_kv_heads % tp or cfg.vocab_size % tp or cfg.intermediate_size % tp:
            raise ValueError(
                f"{self.model_path}: tensor_parallel_size {tp} must divide num_key_value_heads "
                f"({cfg.num_kv_heads}), vocab_size ({cfg.vocab_size}) and intermediate_size ({cfg.intermediate_size})"
            )
        self.device = device
        self.dtype = getattr(torch, dtype)
        torch.manual_seed(seed)
        if device == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(seed)

        config = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
            num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=cfg.rms_eps, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_norm,
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
            params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
            use_cpu_initialization=device != "cuda", perform_initialization=False,
        )
        spec = get_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = _FlashCoreAttention
        self.model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size, max_sequence_length=1 << 20,
            parallel_output=True, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
        )
        if device == "cuda":
            self.model.cuda()
        else:
            _keep_rope_on_cpu(self.model)
        load_base_weights(self.model, self.model_path, cfg, tp, self.tp_rank)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.lora_modules = self._add_lora(lora_rank, lora_alpha)
        broadcast_from_first(self.lora_parameters(), self.data_parallel)
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.max_grad_norm, self.micro_batch_tokens = max_grad_norm, micro_batch_tokens
        self.optimizer = torch.optim.AdamW(self.lora_parameters(), lr=learning_rate, weight_decay=weight_decay)

    # -- building ------------------------------------------------------------------------------

    def _add_lora(self, rank: int, alpha: float) -> list[tuple[str, nn.Module]]:
        cfg, tp = self.config, self.tp
        d, groups = cfg.head_dim, cfg.num_kv_heads // tp
        q_per_group = cfg.num_heads // cfg.num_kv_heads
        modules = []
        for i, layer in enumerate(self.model.decoder.layers):
            attn, mlp = layer.self_attention, layer.mlp
            attn.linear_qkv = _ColumnLoRA(
                attn.linear_qkv, ("q_proj", "k_proj", "v_proj"),
                (groups * q_per_group * d, groups * d, groups * d), _interleave_qkv(groups, q_per_group, d),
                rank, alpha, self.tp_group,
            )
            attn.linear_proj = _RowLoRA(attn.linear_proj, "o_proj", rank, alpha, self.tp_group)
            ffn = cfg.intermediate_size // tp
            mlp.linear_fc1 = _ColumnLoRA(mlp.linear_fc1, ("gate_proj", "up_proj"), (ffn, ffn), _concat, rank, alpha, self.tp_group)
            mlp.linear_fc2 = _RowLoRA(mlp.linear_fc2, "down_proj", rank, alpha, self.tp_group)
            for part, module in (("self_attn", attn.linear_qkv), ("self_attn", attn.linear_proj),
                                 ("mlp", mlp.linear_fc1), ("mlp", mlp.linear_fc2)):
                modules.append((f"model.layers.{i}.{part}", module))
        # A factors are drawn from one generator seeded alike on every rank, then sliced: the
        # replicated ones agree across ranks and the sharded ones are slices of one full matrix.
        gen = torch.Generator().manual_seed(1234)
        for _, module in modules:
            for a in module.lora_a:
                full_in = a.shape[1] * (tp if isinstance(module, _RowLoRA) else 1)
                full = torch.empty(a.shape[0], full_in).uniform_(-1, 1, generator=gen) * full_in**-0.5
                if isinstance(module, _RowLoRA):
                    full = full[:, self.tp_rank * a.shape[1] : (self.tp_rank + 1) * a.shape[1]]
                with torch.no_grad():
                    a.copy_(full)
        return modules

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for _, m in self.lora_modules for p in (*m.lora_a, *m.lora_b)]

    def _sharded(self) -> list[tuple[nn.Parameter, bool]]:
        """Each LoRA factor with whether it is sharded over tensor-parallel ranks."""
        out = []
        for _, m in self.lora_modules:
            row = isinstance(m, _RowLoRA)
            out += [(a, row) for a in m.lora_a] + [(b, not row) for b in m.lora_b]
        return out

    # -- the step -----------------------------------------------------------------------------

    def token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log π(token_t | tokens_<t) for t >= 1, aligned so column t is token t (column 0 is 0)."""
        _, tensor_parallel, *_ = _megatron()
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        logits = self.model(input_ids, position_ids, None)  # [b, s, vocab / tp]
        lp = -tensor_parallel.vocab_parallel_cross_entropy(
            logits[:, :-1].float().transpose(0, 1).contiguous(), input_ids[:, 1:].transpose(0, 1).contiguous(),
            tp_group=self.tp_group,
        ).transpose(0, 1)
        return F.pad(lp, (1, 0))

    def _set_lora(self, enabled: bool) -> None:
        for _, m in self.lora_modules:
            m.enabled = enabled

    def _grad_norm(self) -> torch.Tensor:
        dev = self.lora_parameters()[0].device
        sharded = torch.zeros((), dtype=torch.float32, device=dev)
        replicated = torch.zeros((), dtype=torch.float32, device=dev)
        for p, is_sharded in self._sharded():
            if p.grad is not None:
                sq = p.grad.float().pow(2).sum()
                if is_sharded:
                    sharded += sq
                else:
                    replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return (sharded + replicated).sqrt()

    def train_step(self, batch: TrainBatch, loss: LossConfig) -> StepResult:
        """One GRPO step: the same (whole) batch on every rank, each replica on its shard; the same
        loss and statistics on every rank."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        return grpo_train_step(
            batch, loss, micro_batch_tokens=self.micro_batch_tokens, device=self.device,
            policy_logprobs=lambda ids, _attention_mask: self.token_logprobs(ids),
            reference_logprobs=self._reference_logprobs,
            optimizer_step=self._optimizer_step, data_parallel=self.data_parallel, trained=self.lora_parameters(),
        )

    def _reference_logprobs(self, input_ids: torch.Tensor, _attention_mask: torch.Tensor) -> torch.Tensor:
        """Token log-probabilities with every LoRA branch off (the base model), for the KL term."""
        self._set_lora(False)
        try:
            with torch.no_grad():
                return self.token_logprobs(input_ids)
        finally:
            self._set_lora(True)

    def _optimizer_step(self) -> torch.Tensor:
        grad_norm = self._grad_norm()
        if self.max_grad_norm:
            factor = (self.max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
            for p in self.lora_parameters():
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.dtype))
        self.optimizer.step()
        return grad_norm

    # -- adapter and state --------------------------------------------------------------------

    def _gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The full LoRA weights under peft's names (every rank takes part; every rank gets them)."""
        out: dict[str, torch.Tensor] = {}
        for prefix, m in self.lora_modules:
            row = isinstance(m, _RowLoRA)
            for name, a, b in zip(m.names, m.lora_a, m.lora_b):
                a_full = self._gather(a.detach(), 1) if row else a.detach()
                b_full = b.detach() if row else self._gather(b.detach(), 0)
                key = f"base_model.model.{prefix}.{name}"
                out[f"{key}.lora_A.weight"] = a_full.to("cpu").contiguous()
                out[f"{key}.lora_B.weight"] = b_full.to("cpu").contiguous()
        return out

    def load_adapter(self, directory: Path) -> None:
        """Load a peft LoRA folder (from this backend or the torch/peft one) into the local shards."""
        directory = Path(directory)
        weights, config = directory / "adapter_model.safetensors", directory / "adapter_config.json"
        if not weights.is_file() or not config.is_file():
            raise FileNotFoundError(f"adapter {directory}: expected adapter_config.json and adapter_model.safetensors")
        c = json.loads(config.read_text())
        if c.get("r") != self.lora_rank or float(c.get("lora_alpha")) != float(self.lora_alpha):
            raise ValueError(
                f"adapter {directory}: r={c.get('r')}, lora_alpha={c.get('lora_alpha')}; this backend has "
                f"r={self.lora_rank}, lora_alpha={self.lora_alpha}"
            )
        state = load_file(str(weights))
        r = self.tp_rank
        with torch.no_grad():
            for prefix, m in self.lora_modules:
                row = isinstance(m, _RowLoRA)
                for name, a, b in zip(m.names, m.lora_a, m.lora_b):
                    key = f"base_model.model.{prefix}.{name}"
                    if f"{key}.lora_A.weight" not in state:
                        raise KeyError(f"adapter {directory}: {key}.lora_A.weight is missing")
                    a_full, b_full = state[f"{key}.lora_A.weight"], state[f"{key}.lora_B.weight"]
                    if row:
                        n = a.shape[1]
                        a.copy_(a_full[:, r * n : (r + 1) * n])
                        b.copy_(b_full)
                    else:
                        n = b.shape[0]
                        a.copy_(a_full)
                        b.copy_(b_full[r * n : (r + 1) * n])

    def save_adapter(self, directory: Path) -> None:
        """Write the peft folder (rank 0 writes; every rank must call, for the gather)."""
        state = self.adapter_state_dict()
        if dist.get_rank() != 0:
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.lora_rank, "lora_alpha": self.lora_alpha,
            "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(LORA_TARGET_MODULES),
            "base_model_name_or_path": str(self.model_path), "fan_in_fan_out": False, "inference_mode": True,
        }
        tmp = directory / "adapter_model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / "adapter_model.safetensors")
        tmp = directory / "adapter_config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, directory / "adapter_config.json")

    def save_state(self, directory: Path) -> None:
        directory = Path(directory)
        self.save_adapter(adapter_dir(directory))
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"optimizer-tp{self.tp_rank}.pt.tmp"
        if self.data_parallel.rank == 0:  # one copy per tensor-parallel rank
            torch.save(self.optimizer.state_dict(), tmp)
            os.replace(tmp, directory / f"optimizer-tp{self.tp_rank}.pt")
        dist.barrier()

    def load_state(self, directory: Path) -> None:
        directory = Path(directory)
        self.load_adapter(adapter_dir(directory))
        opt = directory / f"optimizer-tp{self.tp_rank}.pt"
        if not opt.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: {opt.name} is missing (saved with another tensor-parallel size?)")
        self.optimizer.load_state_dict(torch.load(opt, map_location=self.lora_parameters()[0].device, weights_only=True))
