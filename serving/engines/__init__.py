"""Clients of inference engine processes, one protocol (:class:`serving.engines.base.UpstreamEngine`).

    from serving.engines import engine_client
    engine = engine_client("vllm", "http://127.0.0.1:31001")   # or "sglang", "local"
    engine.generate(ids, SamplingParams(max_new_tokens=32), adapter=None, request_id="s1-0")

``vllm``: :class:`serving.engines.vllm.VllmEngine` (the embedded default, and GPUs);
``sglang``: :class:`serving.engines.sglang.SglangEngine` (GPUs); ``local``:
:class:`serving.engines.local.LocalEngineClient` (the project's transformers engine).
"""

from __future__ import annotations

import importlib

from serving.engines.base import EngineMetrics, Generation, UpstreamEngine

ENGINES = {
    "vllm": ("serving.engines.vllm", "VllmEngine"),
    "sglang": ("serving.engines.sglang", "SglangEngine"),
    "local": ("serving.engines.local", "LocalEngineClient"),
}


def engine_client(kind: str, url: str, **kwargs) -> UpstreamEngine:
    """The protocol client of engine ``kind`` serving at ``url``."""
    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(sorted(ENGINES))}, got {kind!r}")
    module, name = ENGINES[kind]
    return getattr(importlib.import_module(module), name)(url, **kwargs)


__all__ = ["ENGINES", "EngineMetrics", "Generation", "UpstreamEngine", "engine_client"]
