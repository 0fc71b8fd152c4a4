"""The project's own engine (``python -m serving.local_engine``) as an :class:`serving.engines.base.UpstreamEngine`.

That engine speaks SGLang's native API itself (``/generate`` with ``input_ids``, ``rid``,
``lora_path``), so this client is what :mod:`serving.replica` uses with ``--engine local``: the
benchmarks compare it with vLLM, and a machine without vLLM can still serve.
"""

from __future__ import annotations

import json
from typing import Any

from serving.client import EngineError
from serving.engines.base import BlockingCalls, EngineMetrics, Generation
from serving.engines.transport import EngineHttp, answers_health
from serving.protocol import BadRequest, GenerateRequest, SamplingParams, parse_metrics


class LocalEngineClient(BlockingCalls):
    """The project's engine server at ``url``; ``http`` carries the trainer credential where the
    engine guards its sessions (:func:`serving.capture.upstream_engine`)."""

    kind = "local"

    def __init__(self, url: str, *, timeout_s: float = 600.0, http: EngineHttp | None = None):
        self.url = url.rstrip("/")
        self.http = http or EngineHttp(timeout_s)

    async def _json(self, method: str, path: str, payload: Any = None) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        status, data, _ = await self.http.request(method, f"{self.url}{path}", body)
        if status >= 300:
            try:
                message = json.loads(data).get("error", data.decode(errors="replace"))
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")
            raise BadRequest(message) if status == 400 else EngineError(status, message, self.url)
        return json.loads(data) if data else None

    async def agenerate(self, input_ids: list[int], params: SamplingParams, *, adapter: str | None,
                        request_id: str) -> Generation:
        body = GenerateRequest(list(input_ids), params, True, adapter, request_id).to_json()
        answer = await self._json("POST", "/generate", body)
        meta = answer.get("meta_info", {})
        return Generation(
            output_ids=list(answer["output_ids"]),
            output_logprobs=[float(item[0]) for item in meta.get("output_token_logprobs") or []],
            finish_reason=meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"},
            prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            engine_request_id=request_id,
        )

    async def aload_adapter(self, name: str, path: str) -> None:
        try:
            await self._json("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except BadRequest as exc:
            if "already loaded" not in str(exc):
                raise

    async def aunload_adapter(self, name: str) -> None:
        try:
            await self._json("POST", "/unload_lora_adapter", {"lora_name": name})
        except BadRequest as exc:
            if "is not loaded" not in str(exc):
                raise

    async def aloaded_adapters(self) -> set[str]:
        return set((await self._json("GET", "/server_info")).get("loaded_adapters", []))

    async def ahealth(self) -> bool:
        return await answers_health(self.http, self.url)

    async def ametrics(self) -> EngineMetrics:
        status, data, _ = await self.http.request("GET", f"{self.url}/metrics")
        if status != 200:
            raise EngineError(status, data.decode(errors="replace"), self.url)
        m = parse_metrics(data.decode())
        capacity = m.get("max_total_num_tokens", 0.0)
        prompt = m.get("prompt_tokens_total", 0.0)
        return EngineMetrics(
            running=m.get("num_running_reqs", 0.0), queued=m.get("num_queue_reqs", 0.0),
            kv_usage=m.get("token_usage", 0.0), max_total_tokens=capacity,
            prefix_cache_hits=m.get("cached_tokens_total", 0.0), prefix_cache_queries=prompt,
            generation_tokens_total=m.get("generation_tokens_total", 0.0), prompt_tokens_total=prompt,
        )
