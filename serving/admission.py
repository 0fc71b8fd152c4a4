"""What one engine's admission costs in memory: the serving geometry of a model.

One token of KV cache costs 2 (K and V) x full-attention layers x KV heads x head dim x dtype bytes;
one recurrent-state slot (linear-attention / Mamba layers) costs recurrent layers x heads x the
product of the state dims x dtype bytes. The geometry comes from a Hugging Face checkpoint's
``config.json`` and weight files (:func:`read_checkpoint_geometry`) or from whoever knows the numbers;
the run planner (``training.planner``) merges the two and sizes an engine's pools with them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3

GEOMETRY_KEYS = (
    "weights_gib",
    "full_attention_layers",
    "kv_heads",
    "head_dim",
    "kv_dtype_bytes",
    "recurrent_layers",
    "recurrent_heads",
    "recurrent_state_dims",
    "recurrent_state_dtype_bytes",
)

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "fp8": 1}
_FULL_LAYER_TYPES = {"full_attention", "attention"}
_RECURRENT_LAYER_TYPES = {"linear_attention", "mamba", "mamba2", "gated_deltanet", "gated_delta_net", "recurrent"}
# SGLang keeps recurrent (mamba / linear-attention) state in float32 unless told otherwise.
DEFAULT_RECURRENT_STATE_DTYPE_BYTES = 4
DEFAULT_KV_DTYPE_BYTES = 2


@dataclass(frozen=True)
class Geometry:
    """Resolved geometry; a field is ``None`` when neither the run file nor the checkpoint gives it."""

    weights_gib: float | None
    full_attention_layers: int | None
    kv_heads: int | None
    head_dim: int | None
    kv_dtype_bytes: int
    recurrent_layers: int | None  # None: the checkpoint's metadata was needed and could not be read
    recurrent_heads: int | None
    recurrent_state_dims: tuple[int, ...] | None
    recurrent_state_dtype_bytes: int
    sources: dict[str, str]  # key -> "run file" | "config.json" | "weight files" | "default"
    metadata_problem: str | None  # why the checkpoint's metadata could not be read, if it could not
    model_type: str | None = None
    max_position_embeddings: int | None = None

    def missing(self) -> list[str]:
        """Geometry keys still unknown that memory sizing needs."""
        needed = ["weights_gib", "full_attention_layers", "recurrent_layers"]
        if self.full_attention_layers:
            needed += ["kv_heads", "head_dim"]
        if self.recurrent_layers:
            needed += ["recurrent_heads", "recurrent_state_dims"]
        return [k for k in needed if getattr(self, k) is None]

    @property
    def kv_bytes_per_token(self) -> int | None:
        """2 (K and V) x full-attention layers x KV heads x head dim x dtype bytes."""
        if self.full_attention_layers is None:
            return None
        if self.full_attention_layers == 0:
            return 0
        if self.kv_heads is None or self.head_dim is None:
            return None
        return 2 * self.full_attention_layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def state_bytes_per_slot(self) -> int | None:
        """Recurrent layers x heads x product of state dims x dtype bytes (0 without recurrent layers)."""
        if self.recurrent_layers == 0:
            return 0
        if self.recurrent_layers is None or self.recurrent_heads is None or self.recurrent_state_dims is None:
            return None
        return (
            self.recurrent_layers
            * self.recurrent_heads
            * math.prod(self.recurrent_state_dims)
            * self.recurrent_state_dtype_bytes
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: (list(v) if isinstance(v, tuple) else v) for k in GEOMETRY_KEYS for v in [getattr(self, k)]},
            "model_type": self.model_type,
            "sources": dict(self.sources),
        }


def read_checkpoint_geometry(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Geometry keys read from a Hugging Face checkpoint folder, and config facts for the plan."""
    config = json.loads((path / "config.json").read_text())
    if isinstance(config.get("text_config"), dict):  # multimodal wrappers keep the LM in text_config
        config = {**config, **config["text_config"]}
    found: dict[str, Any] = {}
    layers = config.get("num_hidden_layers")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        found["full_attention_layers"] = sum(1 for t in layer_types if t in _FULL_LAYER_TYPES)
        found["recurrent_layers"] = sum(1 for t in layer_types if t in _RECURRENT_LAYER_TYPES)
    elif isinstance(layers, int) and isinstance(config.get("full_attention_interval"), int):
        full = layers // config["full_attention_interval"]
        found["full_attention_layers"] = full
        found["recurrent_layers"] = layers - full
    elif isinstance(layers, int):
        found["full_attention_layers"] = layers
        found["recurrent_layers"] = 0
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if isinstance(kv_heads, int):
        found["kv_heads"] = kv_heads
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int) and isinstance(config.get("hidden_size"), int) and isinstance(heads, int):
        head_dim = config["hidden_size"] // heads
    if isinstance(head_dim, int):
        found["head_dim"] = head_dim
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(dtype, str) and dtype in _DTYPE_BYTES:
        found["kv_dtype_bytes"] = _DTYPE_BYTES[dtype]
    if isinstance(config.get("linear_num_value_heads"), int):
        found["recurrent_heads"] = config["linear_num_value_heads"]
    dims = [config.get("linear_key_head_dim"), config.get("linear_value_head_dim")]
    if all(isinstance(d, int) for d in dims):
        found["recurrent_state_dims"] = tuple(dims)
    weight_bytes = sum(
        p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in path.glob(pattern) if p.is_file()
    )
    if weight_bytes:
        found["weights_gib"] = weight_bytes / GIB
    facts = {"model_type": config.get("model_type"), "max_position_embeddings": config.get("max_position_embeddings")}
    return found, facts
