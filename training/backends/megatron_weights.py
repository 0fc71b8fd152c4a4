"""Hugging Face Qwen2/Qwen3 weights for the Megatron-core backend: the config, and each rank's shards.

:class:`QwenConfig` reads a model folder's ``config.json``; :class:`SafetensorsFolder` reads single
tensors, or row/column slices of them, from its (possibly sharded) safetensors files, so each rank
reads only its shard; :func:`load_base_weights` maps Hugging Face names and layouts onto Megatron's
fused, tensor-parallel parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


@dataclass(frozen=True)
class QwenConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_folder(cls, model_path: Path) -> "QwenConfig":
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"base model {model_path}: no config.json (expected a Hugging Face model folder)")
        c = json.loads(path.read_text())
        if c.get("model_type") not in ("qwen2", "qwen3"):
            raise ValueError(f"{path}: model_type {c.get('model_type')!r}; the megatron backend takes qwen2 or qwen3")
        heads = c["num_attention_heads"]
        return cls(
            model_type=c["model_type"], vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(c.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


class SafetensorsFolder:
    """Reads single tensors or row/column slices of them from a (possibly sharded) safetensors folder."""

    def __init__(self, model_path: Path):
        model_path = Path(model_path)
        index = model_path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"base model {model_path}: no *.safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self._where = weight_map
        self._handles = {name: safe_open(str(model_path / name), framework="pt") for name in set(weight_map.values())}
        self.model_path = model_path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"base model {self.model_path}: weight {name} is missing")
        sl = self._handles[self._where[name]].get_slice(name)
        if rows is None and cols is None:
            return sl[:]
        if cols is None:
            return sl[rows]
        return sl[rows if rows is not None else slice(None), cols]


def load_base_weights(model: nn.Module, model_path: Path, cfg: QwenConfig, tp: int, tp_rank: int) -> None:
    """Copy rank ``tp_rank``'s shard of every base weight of the Hugging Face folder ``model_path``
    into the Megatron ``model`` (tensor-parallel size ``tp``), checking that every parameter has a
    source and every shard its expected shape.

    q/k/v become Megatron's fused ``linear_qkv`` (per local query group: its q heads, then its k,
    then its v), gate and up its ``linear_fc1``; column-parallel weights are split by rows,
    row-parallel ones (o_proj, down_proj) by columns, the embedding and LM head by vocabulary rows.
    """
    r = tp_rank
    src = SafetensorsFolder(model_path)
    d = cfg.head_dim
    groups = cfg.num_kv_heads // tp
    q_per_group = cfg.num_heads // cfg.num_kv_heads

    def chunk(n: int) -> slice:
        return slice(r * n // tp, (r + 1) * n // tp)

    def qkv(prefix: str, suffix: str) -> torch.Tensor:
        q = src.get(f"{prefix}.q_proj.{suffix}", rows=chunk(cfg.num_heads * d))
        k = src.get(f"{prefix}.k_proj.{suffix}", rows=chunk(cfg.num_kv_heads * d))
        v = src.get(f"{prefix}.v_proj.{suffix}", rows=chunk(cfg.num_kv_heads * d))
        rest = q.shape[1:]
        parts = (q.reshape(groups, q_per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    want: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": src.get("model.embed_tokens.weight", rows=chunk(cfg.vocab_size)),
        "decoder.final_layernorm.weight": src.get("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        want["output_layer.weight"] = src.get("lm_head.weight", rows=chunk(cfg.vocab_size))
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{i}"
        want[f"{mg}.input_layernorm.weight"] = src.get(f"{hf}.input_layernorm.weight")
        want[f"{mg}.pre_mlp_layernorm.weight"] = src.get(f"{hf}.post_attention_layernorm.weight")
        want[f"{mg}.self_attention.linear_qkv.weight"] = qkv(f"{hf}.self_attn", "weight")
        if cfg.qkv_bias:
            want[f"{mg}.self_attention.linear_qkv.bias"] = qkv(f"{hf}.self_attn", "bias")
        if cfg.qk_norm:
            want[f"{mg}.self_attention.q_layernorm.weight"] = src.get(f"{hf}.self_attn.q_norm.weight")
            want[f"{mg}.self_attention.k_layernorm.weight"] = src.get(f"{hf}.self_attn.k_norm.weight")
        want[f"{mg}.self_attention.linear_proj.weight"] = src.get(f"{hf}.self_attn.o_proj.weight", cols=chunk(cfg.num_heads * d))
        want[f"{mg}.mlp.linear_fc1.weight"] = torch.cat([
            src.get(f"{hf}.mlp.gate_proj.weight", rows=chunk(cfg.intermediate_size)),
            src.get(f"{hf}.mlp.up_proj.weight", rows=chunk(cfg.intermediate_size)),
        ])
        want[f"{mg}.mlp.linear_fc2.weight"] = src.get(f"{hf}.mlp.down_proj.weight", cols=chunk(cfg.intermediate_size))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(want))
    if missing:
        raise RuntimeError(f"megatron parameters with no Hugging Face source: {missing[:5]}")
    with torch.no_grad():
        for name, value in want.items():
            if name not in params:
                raise RuntimeError(f"megatron model has no parameter {name}")
            if params[name].shape != value.shape:
                raise RuntimeError(f"{name}: megatron shard {tuple(params[name].shape)}, source {tuple(value.shape)}")
            params[name].copy_(value)
