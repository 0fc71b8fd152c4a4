"""The geometry of a run's model (``serving.admission.Geometry``: what one token of KV cache and one
recurrent-state slot cost), from the run file's ``[model]`` keys and the ``config.json`` (and weight
files) of the checkpoint at ``[model] path``; a key set in the run file wins over the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.admission import (
    DEFAULT_KV_DTYPE_BYTES,
    DEFAULT_RECURRENT_STATE_DTYPE_BYTES,
    GEOMETRY_KEYS,
    Geometry,
    read_checkpoint_geometry,
)
from training.planner.schema import PlanError
from training.planner.sections import ModelSection


def resolve_geometry(model: ModelSection, source: str) -> Geometry:
    """Merge the run file's geometry with the checkpoint's; raise ``PlanError`` on impossible values."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    problem: str | None = None
    facts: dict[str, Any] = {}
    if model.path:
        path = Path(model.path).expanduser()
        try:
            found, facts = read_checkpoint_geometry(path)
        except FileNotFoundError:
            problem = f"{path / 'config.json'} does not exist"
        except (OSError, ValueError) as exc:
            problem = f"{path / 'config.json'} cannot be read: {exc}"
        else:
            for key, value in found.items():
                values[key] = value
                sources[key] = "weight files" if key == "weights_gib" else "config.json"
    for key in GEOMETRY_KEYS:
        value = getattr(model, key)
        if value is not None:
            values[key] = value
            sources[key] = "run file"
    defaults: list[tuple[str, Any]] = [
        ("kv_dtype_bytes", DEFAULT_KV_DTYPE_BYTES),
        ("recurrent_state_dtype_bytes", DEFAULT_RECURRENT_STATE_DTYPE_BYTES),
    ]
    if problem is None:
        # A model described by the run file alone, or by a readable checkpoint, has no recurrent
        # layers unless it says so; with unreadable metadata the count stays unknown.
        defaults.append(("recurrent_layers", 0))
    for key, default in defaults:
        if key not in values:
            values[key] = default
            sources[key] = "default"
    geometry = Geometry(
        weights_gib=values.get("weights_gib"),
        full_attention_layers=values.get("full_attention_layers"),
        kv_heads=values.get("kv_heads"),
        head_dim=values.get("head_dim"),
        kv_dtype_bytes=values["kv_dtype_bytes"],
        recurrent_layers=values.get("recurrent_layers"),
        recurrent_heads=values.get("recurrent_heads"),
        recurrent_state_dims=values.get("recurrent_state_dims"),
        recurrent_state_dtype_bytes=values["recurrent_state_dtype_bytes"],
        sources=sources,
        metadata_problem=problem,
        model_type=facts.get("model_type"),
        max_position_embeddings=facts.get("max_position_embeddings")
        if isinstance(facts.get("max_position_embeddings"), int)
        else None,
    )
    _check_geometry(geometry, source)
    return geometry


def _check_geometry(g: Geometry, source: str) -> None:
    problems = []
    if g.full_attention_layers == 0 and g.recurrent_layers == 0:
        problems.append(
            f"{source}: [model] full_attention_layers, recurrent_layers: a model needs at least one layer; both are 0"
        )
    if g.recurrent_layers and g.sources.get("recurrent_layers") == "run file":
        for key in ("recurrent_heads", "recurrent_state_dims"):
            if getattr(g, key) is None:
                problems.append(
                    f"{source}: [model] {key}: required when recurrent_layers = {g.recurrent_layers} "
                    "(the recurrent state per slot is layers x heads x product of state dims x dtype bytes)"
                )
    if not g.recurrent_layers and g.sources.get("recurrent_heads") == "run file":
        problems.append(f"{source}: [model] recurrent_heads: set, but recurrent_layers is 0; set recurrent_layers too")
    if problems:
        raise PlanError(problems)
