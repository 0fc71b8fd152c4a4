"""Capture inside the replica: every call's exact token ids and logprobs, keyed by session.

An engine server (:class:`serving.http.EngineServer`, in front of the local and simulated engines)
and the SGLang capture sidecar (:mod:`serving.capture`) both record each ``/generate`` call here
through :func:`capture_generate`; ``GET /sessions/{rid}`` serves a session's calls in order.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from serving.protocol import GenerateRequest


def capture_record(request: GenerateRequest, response: dict[str, Any], *, started_at: float, latency_s: float,
                   replica: str) -> dict[str, Any]:
    meta = response.get("meta_info", {})
    logprobs = meta.get("output_token_logprobs") or []
    return {
        "rid": request.rid,
        "input_ids": list(request.input_ids),
        "output_ids": list(response.get("output_ids", [])),
        "output_logprobs": [float(item[0]) for item in logprobs],
        "lora_path": request.lora_path,
        "weight_version": meta.get("weight_version"),
        "finish_reason": meta.get("finish_reason"),
        "cached_tokens": meta.get("cached_tokens"),
        "sampling_params": request.to_json()["sampling_params"],
        "started_at": started_at,
        "latency_s": latency_s,
        "replica": replica,
    }


class CaptureStore:
    """Per-session call records, oldest sessions dropped past ``max_sessions``."""

    def __init__(self, max_sessions: int = 100_000):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, record: dict[str, Any]) -> None:
        rid = record.get("rid")
        if rid is None:
            return
        with self._lock:
            calls = self._sessions.get(rid)
            if calls is None:
                calls = self._sessions[rid] = []
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            record["call_index"] = len(calls)
            calls.append(record)

    def session(self, rid: str) -> list[dict[str, Any]] | None:
        with self._lock:
            calls = self._sessions.get(rid)
            return list(calls) if calls is not None else None

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def drop(self, rid: str) -> bool:
        with self._lock:
            return self._sessions.pop(rid, None) is not None


def capture_generate(generate, request: GenerateRequest, store: CaptureStore, replica: str) -> dict[str, Any]:
    """Run ``generate`` with logprobs forced on, record the call, and answer as asked."""
    asked = request.return_logprob
    request.return_logprob = True
    started_at = time.time()
    t0 = time.perf_counter()
    try:
        response = generate(request)
    finally:
        request.return_logprob = asked
    store.record(capture_record(request, response, started_at=started_at, latency_s=time.perf_counter() - t0, replica=replica))
    if not asked:
        response.get("meta_info", {}).pop("output_token_logprobs", None)
    return response
