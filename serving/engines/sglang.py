"""SGLang as an :class:`serving.engines.base.UpstreamEngine`: a thin client of SGLang's own native HTTP API.

    from serving.engines.sglang import SglangEngine
    from serving.protocol import BadRequest, SamplingParams

    engine = SglangEngine("http://127.0.0.1:30000")
    engine.load_adapter("v000003", "/run-data/runs/r/adapters/v000003")   # already loaded: no-op
    out = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=32), adapter="v000003",
                          request_id="rollout-17")       # on an event loop: await engine.agenerate(...)
    out.output_ids, out.output_logprobs, out.finish_reason, out.cached_tokens
    engine.loaded_adapters()       # {"v000003"}, from GET /v1/models
    engine.metrics().kv_usage      # sglang:token_usage

The shapes are those of the SGLang release in ``serving.sglang.SGLANG_VERSION`` (0.5.23):

- ``POST /generate`` takes ``input_ids``, ``sampling_params`` (unknown keys are refused),
  ``return_logprob``, ``lora_path`` (the adapter's name) and ``rid``. A ``rid`` must be unique among
  the requests in flight ("Duplicate request ID detected"), so each call gets its own: the caller's
  ``request_id`` plus a suffix. The answer is ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason", "prompt_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id,
  text], ...], ...}}``; errors are ``{"error": {"message"}}`` (or ``{"error": "..."}`` for a body
  that breaks the API contract, or ``{"object": "error", "message"}``). A 400 is raised as
  ``serving.protocol.BadRequest`` (the capture front answers it as the caller's error, as it does
  for vLLM's), any other failure as ``serving.client.EngineError``.
- ``POST /load_lora_adapter`` / ``/unload_lora_adapter`` answer ``{"success", "error_message",
  "loaded_adapters": {name: path}}`` (older releases: no ``loaded_adapters``), with HTTP 400 on
  failure. Loading a name that is loaded fails ("... because it is already loaded"): success here.
- The loaded adapters are the cards of ``GET /v1/models`` whose ``parent`` is set (the base model's
  card has none). ``/server_info`` is not used: it does not list adapters, and releases before
  it was added answer 404.
- ``GET /metrics`` (with ``--enable-metrics``): gauges ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (0..1, the fullest pool),
  ``sglang:max_total_num_tokens``; counters ``sglang:prompt_tokens_total``,
  ``sglang:generation_tokens_total`` and ``sglang:cached_tokens_total`` (prompt tokens served from
  the prefix cache, per cache source).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from serving.client import EngineError, error_message
from serving.engines.base import BlockingCalls, EngineMetrics, Generation
from serving.engines.transport import EngineHttp, answers_health
from serving.protocol import BadRequest, SamplingParams

# What SGLang says when the name is already loaded: its LoRA manager, or its registry.
_ALREADY_LOADED = re.compile(r"because it is already loaded|LoRA with name \S+ already exists")
# The message its registry gives when unloading a name that is not loaded.
_NOT_LOADED = re.compile(r"LoRA with name \S+ does not exist")

# One Prometheus sample: name, optional {labels}, value (timestamps are ignored).
_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


class SglangEngine(BlockingCalls):
    """One SGLang server (``python -m sglang.launch_server ... --enable-lora --enable-metrics``)."""

    kind = "sglang"

    def __init__(self, url: str, *, timeout_s: float = 600.0, http: EngineHttp | None = None):
        self.url = url.rstrip("/")
        self.http = http or EngineHttp(timeout_s)

    # -- HTTP --------------------------------------------------------------------------------------

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        status, data, _ = await self.http.request("POST", f"{self.url}{path}", json.dumps(payload).encode())
        return status, data

    def _json(self, path: str, status: int, data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise EngineError(status, f"{path} answered with something that is not JSON: {data[:200]!r}", self.url) from None

    # -- the protocol -------------------------------------------------------------------------------

    async def agenerate(self, input_ids: list[int], params: SamplingParams, *, adapter: str | None,
                        request_id: str) -> Generation:
        """One completion of ``input_ids``. ``request_id`` is the caller's (a session or rollout id,
        which may repeat); SGLang's ``rid`` is it plus a suffix unique to this call."""
        rid = f"{request_id}-{uuid.uuid4().hex[:16]}" if request_id else uuid.uuid4().hex
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": params.to_json(),
                                "return_logprob": True, "rid": rid}
        if adapter is not None:
            body["lora_path"] = adapter
        status, data = await self._post("/generate", body)
        if status == 400:  # refused as invalid (an adapter that is not loaded, ...): the caller's to fix
            raise BadRequest(f"SGLang at {self.url} refused the request: {error_message(data)}")
        if status >= 300:
            raise EngineError(status, error_message(data), self.url)
        out = self._json("/generate", status, data)
        if isinstance(out, list):  # a batch answer to a single request: not SGLang's behaviour
            raise EngineError(status, f"/generate answered a list of {len(out)} for one request", self.url)
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict) or not isinstance(out.get("output_ids"), list):
            raise EngineError(status, "/generate answer has no output_ids and meta_info", self.url)
        output_ids = [int(t) for t in out["output_ids"]]
        logprobs = meta.get("output_token_logprobs") or []
        if len(logprobs) != len(output_ids):
            raise EngineError(status, f"/generate returned {len(output_ids)} output ids but {len(logprobs)} "
                                      "output_token_logprobs", self.url)
        values = []
        for i, (entry, token) in enumerate(zip(logprobs, output_ids)):
            # [logprob, token_id, text or None]
            if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[1] != token
                    or not isinstance(entry[0], (int, float))):
                raise EngineError(status, f"/generate output_token_logprobs[{i}] is {entry!r}, not [logprob, {token}, ...]",
                                  self.url)
            values.append(float(entry[0]))
        finish = meta.get("finish_reason")
        return Generation(
            output_ids=output_ids,
            output_logprobs=values,
            finish_reason=finish if isinstance(finish, dict) else {"type": "abort", "message": "no finish_reason"},
            prompt_tokens=int(meta.get("prompt_tokens") or len(input_ids)),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            engine_request_id=str(meta.get("id") or rid),
        )

    async def aload_adapter(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` (a folder SGLang can read) as ``name``. A name already loaded
        is success, from whichever path: a version name is one adapter, and the same version may have
        been loaded from the sidecar's staging folder before it is published on the run volume."""
        status, data = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if status < 300:
            return
        message = error_message(data)
        if _ALREADY_LOADED.search(message):
            return
        raise EngineError(status, message, self.url)

    async def aunload_adapter(self, name: str) -> None:
        """Unload ``name``; a name that is not loaded is already unloaded."""
        status, data = await self._post("/unload_lora_adapter", {"lora_name": name})
        if status < 300:
            return
        message = error_message(data)
        if _NOT_LOADED.search(message):
            return
        raise EngineError(status, message, self.url)

    async def aloaded_adapters(self) -> set[str]:
        """The adapter names SGLang serves now: the cards of ``/v1/models`` that have a parent."""
        status, data, _ = await self.http.request("GET", f"{self.url}/v1/models")
        if status >= 300:
            raise EngineError(status, error_message(data), self.url)
        body = self._json("/v1/models", status, data)
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            raise EngineError(status, "/v1/models answer has no data list", self.url)
        return {str(card["id"]) for card in cards if isinstance(card, dict) and card.get("parent") and card.get("id")}

    async def ahealth(self) -> bool:
        return await answers_health(self.http, self.url)

    async def ametrics(self) -> EngineMetrics:
        status, data, _ = await self.http.request("GET", f"{self.url}/metrics")
        if status != 200:
            raise EngineError(status, error_message(data), self.url)
        return parse_sglang_metrics(data.decode(errors="replace"))


def parse_sglang_metrics(text: str) -> EngineMetrics:
    """EngineMetrics from SGLang's Prometheus text.

    Gauges come from the scheduler of each data-parallel rank (labels ``tp_rank``, ``dp_rank``, ...):
    request counts and capacity add up over ranks, the KV usage is the fullest rank's. With priority
    scheduling a gauge also has one series per priority next to the total (``priority=""``); only the
    total counts. Counters add up over their label sets (streaming or not, cache source)."""
    gauges: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group("name").startswith("sglang:"):
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name = m.group("name")[len("sglang:"):]
        labels = {lm.group("key"): lm.group("value") for lm in _LABEL.finditer(m.group("labels") or "")}
        if labels.get("priority", ""):
            continue
        if name.endswith("_total"):
            counters[name] = counters.get(name, 0.0) + value
        else:
            gauges.setdefault(name, []).append(value)

    def total(name: str) -> float:
        return float(sum(gauges.get(name, [])))

    return EngineMetrics(
        running=total("num_running_reqs"),
        queued=total("num_queue_reqs"),
        kv_usage=max(gauges.get("token_usage", [0.0])),
        max_total_tokens=total("max_total_num_tokens"),
        prefix_cache_hits=counters.get("cached_tokens_total", 0.0),
        prefix_cache_queries=counters.get("prompt_tokens_total", 0.0),
        generation_tokens_total=counters.get("generation_tokens_total", 0.0),
        prompt_tokens_total=counters.get("prompt_tokens_total", 0.0),
    )
