"""SGLang's native HTTP API, as every engine and replica here speaks it, and :class:`InProcessEngine`.

Request validation lives here so that the local engine, the simulated engine, the capture sidecar
and the router reject bad input the same way: a ``BadRequest`` whose message names the field, sent
back as HTTP 400.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

BASE_WEIGHT_VERSION = "base"


class BadRequest(ValueError):
    """Invalid input from a caller; the HTTP layer answers 400 with this message."""


def engine_adapter(requested: str | None, merged_version: str | None, field: str) -> str | None:
    """The adapter the engine is asked for when a call names ``requested`` (None: the base model) on
    a replica whose weights have ``merged_version`` merged in (None: plain base weights): that version
    is the engine's own weights, and the base model is not served there, so asking for it is a
    ``BadRequest`` naming ``field`` rather than an answer from the checkpoint's weights."""
    if merged_version is None:
        return requested
    if requested is None:
        raise BadRequest(f"{field}: this replica serves adapter version {merged_version!r} merged into its "
                         f"weights, not the base model: ask for {merged_version!r}")
    return None if requested == merged_version else requested


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` object for these settings (``top_k`` -1 means off there too)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @property
    def is_plain(self) -> bool:
        """True when sampling needs no per-row filtering or private generator."""
        return self.top_p >= 1.0 and self.top_k <= 0 and self.seed is None


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    lora_path: str | None = None  # the adapter name (SGLang's meaning), None for the base model
    rid: str | None = None  # the session (rollout) id, sent as ``session_id``: capture and routing are keyed by it

    @property
    def session_id(self) -> str | None:
        return self.rid

    def to_json(self) -> dict[str, Any]:
        params = self.sampling_params.to_json()
        body: dict[str, Any] = {"input_ids": self.input_ids, "sampling_params": params, "return_logprob": self.return_logprob}
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        if self.rid is not None:
            body["session_id"] = self.rid
        return body


def _int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {value!r}")
    return float(value)


def parse_sampling_params(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed", "seed"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequest(f"sampling_params.{unknown[0]} is not supported (supported: {', '.join(sorted(known))})")
    out: dict[str, Any] = {}
    if "max_new_tokens" in raw:
        out["max_new_tokens"] = _int(raw["max_new_tokens"], "sampling_params.max_new_tokens", minimum=1)
    if "temperature" in raw:
        t = _float(raw["temperature"], "sampling_params.temperature")
        if t < 0:
            raise BadRequest(f"sampling_params.temperature must be >= 0, got {t}")
        out["temperature"] = t
    if "top_p" in raw:
        p = _float(raw["top_p"], "sampling_params.top_p")
        if not 0 < p <= 1:
            raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p}")
        out["top_p"] = p
    if "top_k" in raw:
        k = _int(raw["top_k"], "sampling_params.top_k")
        if k == 0 or k < -1:
            raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {k}")
        out["top_k"] = k
    if "stop_token_ids" in raw and raw["stop_token_ids"] is not None:
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list):
            raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
        out["stop_token_ids"] = tuple(_int(t, "sampling_params.stop_token_ids[]", minimum=0) for t in ids)
    if "ignore_eos" in raw:
        if not isinstance(raw["ignore_eos"], bool):
            raise BadRequest(f"sampling_params.ignore_eos must be a boolean, got {raw['ignore_eos']!r}")
        out["ignore_eos"] = raw["ignore_eos"]
    for key in ("sampling_seed", "seed"):
        if raw.get(key) is not None:
            out["seed"] = _int(raw[key], f"sampling_params.{key}")
    return SamplingParams(**out)


def parse_generate(body: Any, *, vocab_size: int | None = None) -> list[GenerateRequest]:
    """Validate a ``POST /generate`` body. ``input_ids`` may be one list (one request) or a list of
    lists (a batch; answered with a list). Returns the requests in order."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "input_ids" not in body:
        if "text" in body:
            raise BadRequest("input_ids is required: this engine takes token ids, not text (tokenize on the client)")
        raise BadRequest("input_ids is required")
    raw_ids = body["input_ids"]
    if not isinstance(raw_ids, list) or not raw_ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
    batch = isinstance(raw_ids[0], list)
    rows = raw_ids if batch else [raw_ids]
    sp = parse_sampling_params(body.get("sampling_params"))
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest(f"return_logprob must be a boolean, got {return_logprob!r}")
    lora = body.get("lora_path")
    # The session key: ``session_id``; ``rid`` is its older spelling. Engines get a request id of
    # their own for each call (unique among calls in flight), never this key.
    key = "session_id" if body.get("session_id") is not None else "rid"
    rid = body.get(key)
    loras = lora if isinstance(lora, list) else [lora] * len(rows)
    rids = rid if isinstance(rid, list) else [rid] * len(rows)
    if len(loras) != len(rows):
        raise BadRequest(f"lora_path has {len(loras)} entries for {len(rows)} input_ids rows")
    if len(rids) != len(rows):
        raise BadRequest(f"{key} has {len(rids)} entries for {len(rows)} input_ids rows")
    requests = []
    for i, row in enumerate(rows):
        where = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(row, list) or not row:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        # The fast check runs at C speed on long contexts; the loop only finds what to report.
        if set(map(type, row)) != {int} or min(row) < 0:
            bad = next(t for t in row if type(t) is not int or t < 0)
            raise BadRequest(f"{where} must hold non-negative integers, found {bad!r}")
        if vocab_size is not None and max(row) >= vocab_size:
            raise BadRequest(f"{where} holds token id {max(row)}, outside the vocabulary (size {vocab_size})")
        if loras[i] is not None and not isinstance(loras[i], str):
            raise BadRequest(f"lora_path must be an adapter name (string), got {loras[i]!r}")
        if rids[i] is not None and not isinstance(rids[i], str):
            raise BadRequest(f"{key} must be a string, got {rids[i]!r}")
        requests.append(GenerateRequest(list(row), sp, return_logprob, loras[i] or None, rids[i]))
    return requests


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_adapter_load(body: Any) -> tuple[str, str]:
    """Validate a ``POST /load_lora_adapter`` body: the adapter's name and its directory."""
    name = parse_adapter_name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("lora_path must be the adapter's directory (a string)")
    return name, path


def parse_adapter_name(body: Any, key: str = "lora_name") -> str:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    name = body.get(key)
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise BadRequest(f"{key} must be a name of letters, digits, '.', '_' or '-' (max 128), got {name!r}")
    return name


def finish_reason(kind: str, value: int | None = None) -> dict[str, Any]:
    """SGLang's finish_reason object: ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``."""
    if kind == "stop":
        return {"type": "stop", "matched": value}
    if kind == "length":
        return {"type": "length", "length": value}
    return {"type": "abort", "message": str(value)}


class InProcessEngine(Protocol):
    """An engine object in this process that :func:`serving.http.serve` puts behind SGLang's native
    API: the local engine (:class:`serving.local_engine.LocalEngine`) and the simulated engine
    (:class:`serving.sim.SimEngine`) implement it. Not to be confused with
    :class:`serving.engines.base.UpstreamEngine`, the client of an engine running in its own process,
    which a replica's capture front calls.

    A call is answered twice over, from one implementation: ``agenerate`` is awaited on the
    server's event loop (what :class:`serving.http.EngineServer` calls: no worker thread, no thread
    hop), ``generate`` blocks its caller (a test, a tool, a thread). The engine does its own work
    off the loop: both engines here hand a call to their scheduler thread and wait on its
    :class:`Completion`, which that thread sets and the loop awaits."""

    def generate(self, request: GenerateRequest) -> dict[str, Any]: ...
    async def agenerate(self, request: GenerateRequest) -> dict[str, Any]: ...
    def load_lora_adapter(self, name: str, path: str) -> None: ...
    def unload_lora_adapter(self, name: str) -> None: ...
    def adapters(self) -> list[str]: ...
    def server_info(self) -> dict[str, Any]: ...
    def metrics(self) -> dict[str, float]: ...
    def close(self) -> None: ...


def awaited_generate(engine: Any) -> Callable[[GenerateRequest], Awaitable[dict[str, Any]]] | None:
    """``engine.agenerate`` where it is the engine's call, else None (run ``engine.generate`` on a
    worker thread). An engine with no ``agenerate``, or a subclass that overrides ``generate`` below
    the class that defines ``agenerate`` (a test's engine that waits or fails in its own
    ``generate``), has a blocking call that the awaitable one would skip."""
    mro = type(engine).__mro__
    owners = {name: next((i for i, cls in enumerate(mro) if name in vars(cls)), None) for name in ("generate", "agenerate")}
    if owners["agenerate"] is None or (owners["generate"] is not None and owners["generate"] < owners["agenerate"]):
        return None
    return engine.agenerate


class Completion:
    """The end of one engine call, set once by the engine's scheduler thread and waited for by the
    call's caller: blocking (:meth:`wait`, a thread) or awaited (``await completion``, on an event
    loop, which the setting thread wakes with ``call_soon_threadsafe``). A drop-in for the
    ``threading.Event`` the engines used (``set``, ``is_set``, ``wait``)."""

    __slots__ = ("_lock", "_set", "_event", "_futures")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._event: threading.Event | None = None  # made for a blocking waiter only
        self._futures: list[asyncio.Future] = []

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            event, futures, self._futures = self._event, self._futures, []
        if event is not None:
            event.set()
        for future in futures:
            try:
                future.get_loop().call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop has closed: no one waits there any more
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def __await__(self):
        with self._lock:
            if self._set:
                return
            future = asyncio.get_running_loop().create_future()
            self._futures.append(future)
        yield from future.__await__()


def _wake(future: asyncio.Future) -> None:
    if not future.done():  # cancelled meanwhile (the caller's connection was cut)
        future.set_result(None)


# --- Prometheus metrics with SGLang's names -------------------------------------------------------

METRIC_PREFIX = "sglang:"


def render_metrics(values: dict[str, float], labels: dict[str, str]) -> str:
    """Prometheus text exposition with SGLang's ``sglang:`` metric names."""
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines = []
    for name, value in values.items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines.append(f"# TYPE {METRIC_PREFIX}{name} {kind}")
        lines.append(f"{METRIC_PREFIX}{name}{{{label_text}}} {float(value)!r}")
    return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Read SGLang metrics from Prometheus text. Both ``sglang:name`` and ``sglang_name`` spellings
    map to ``name``; samples with several label sets are summed (gauges of one replica have one)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m.group("name")
        for prefix in ("sglang:", "sglang_"):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        else:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out
