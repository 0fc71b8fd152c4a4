""":class:`UpstreamEngine`: what a replica's capture front needs from the inference engine behind
it, whichever engine it is (vLLM, SGLang, or the project's local engine), each running in a
process of its own.

Each implementation is a thin client of one engine's own HTTP API (``serving.engines.vllm``,
``serving.engines.sglang``, ``serving.engines.local``); none inherits from another. Each call is
written once, awaitable (``agenerate``, ``aload_adapter``, ...: the capture front awaits them on
its server's event loop, :mod:`serving.engines.transport`); :class:`BlockingCalls` gives every
client the same call under its plain name (``generate``, ``health``, ...), which runs the awaitable
one, for callers outside an event loop (the replica before it serves, tests, tools). The capture
front (:mod:`serving.capture`) turns posttrain's engine API (SGLang-shaped ``/generate``,
``/load_lora_adapter``, ``/server_info``, ``/metrics``, ``/sessions/{id}``) into calls of this
protocol, so the router and the trainer never see an engine's own shapes.

Logprobs are those of the distribution sampled from: at temperature 1 without top-k/top-p
filtering they are the model's own, which is what the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serving.engines.transport import EngineHttp
from serving.protocol import SamplingParams


@dataclass
class Generation:
    output_ids: list[int]
    output_logprobs: list[float]          # one per output id
    finish_reason: dict                   # SGLang-shaped: {"type": "stop", "matched": id} | {"type": "length", "length": n} | {"type": "abort", "message": s}
    prompt_tokens: int
    cached_tokens: int = 0                # prefix-cache hit tokens when the engine reports it, else 0
    engine_request_id: str = ""


@dataclass
class EngineMetrics:
    running: float = 0.0                  # requests running
    queued: float = 0.0                   # requests waiting
    kv_usage: float = 0.0                 # 0..1 share of KV cache in use
    max_total_tokens: float = 0.0         # KV capacity in tokens when known
    prefix_cache_hits: float = 0.0        # counters (tokens)
    prefix_cache_queries: float = 0.0
    generation_tokens_total: float = 0.0
    prompt_tokens_total: float = 0.0


class UpstreamEngine(Protocol):
    """The client of one engine process, over that engine's own HTTP API (vLLM's OpenAI API,
    SGLang's native API): :class:`serving.engines.vllm.VllmEngine`,
    :class:`serving.engines.sglang.SglangEngine`, :class:`serving.engines.local.LocalEngineClient`.
    Not to be confused with :class:`serving.protocol.InProcessEngine`, an engine object that
    :mod:`serving.http` serves from this process."""

    kind: str                              # "vllm" | "sglang" | "local"
    url: str
    http: EngineHttp                       # its connections: closed by close()
    async def agenerate(self, input_ids: list[int], params: "SamplingParams", *, adapter: str | None,
                        request_id: str) -> Generation: ...
    async def aload_adapter(self, name: str, path: str) -> None: ...  # idempotent: already loaded is success
    async def aunload_adapter(self, name: str) -> None: ...
    async def aloaded_adapters(self) -> set[str]: ...
    async def ahealth(self) -> bool: ...
    async def ametrics(self) -> EngineMetrics: ...
    # the same calls, blocking (BlockingCalls)
    def generate(self, input_ids: list[int], params: "SamplingParams", *, adapter: str | None, request_id: str) -> Generation: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def loaded_adapters(self) -> set[str]: ...
    def health(self) -> bool: ...
    def metrics(self) -> EngineMetrics: ...
    def close(self) -> None: ...


class BlockingCalls:
    """The blocking form of an engine client's awaitable calls, each running the awaitable one on
    the client's ``http`` (:meth:`serving.engines.transport.EngineHttp.run`): for a caller without
    an event loop. On a loop, await the ``a``-prefixed call instead (a blocking one there is refused)."""

    http: EngineHttp

    def generate(self, input_ids: list[int], params: SamplingParams, *, adapter: str | None,
                 request_id: str) -> Generation:
        return self.http.run(self.agenerate(input_ids, params, adapter=adapter, request_id=request_id))  # type: ignore[attr-defined]

    def load_adapter(self, name: str, path: str) -> None:
        return self.http.run(self.aload_adapter(name, path))  # type: ignore[attr-defined]

    def unload_adapter(self, name: str) -> None:
        return self.http.run(self.aunload_adapter(name))  # type: ignore[attr-defined]

    def loaded_adapters(self) -> set[str]:
        return self.http.run(self.aloaded_adapters())  # type: ignore[attr-defined]

    def health(self) -> bool:
        return self.http.run(self.ahealth())  # type: ignore[attr-defined]

    def metrics(self) -> EngineMetrics:
        return self.http.run(self.ametrics())  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close the client's connections (a later call opens new ones)."""
        self.http.close()
