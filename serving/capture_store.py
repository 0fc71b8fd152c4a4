"""Capture inside the replica: every call's exact token ids and logprobs, keyed by session, and who
may read them.

An engine server (:class:`serving.http.EngineServer`, in front of the local and simulated engines)
records each ``/generate`` call here through :func:`acapture_generate` (awaited on its event loop;
:func:`capture_generate` is its blocking form, for an engine whose call blocks), the capture front
(:mod:`serving.capture`) with the engine's request ids beside them, chat calls :mod:`serving.chat`;
``GET /sessions/{id}`` serves a session's calls in order (:func:`serving.http.session_routes`).

**A session belongs to its caller.** The RL policy is an adversary: its code runs in sandboxes and
may reach the replicas and the router on loopback. A session's calls become its episode's training
data, so reading, appending to and deleting a session each need one of:

- the session's key (header ``X-Session-Key``): ``HMAC-SHA256(trainer credential, session id)``
  (:func:`session_key`). Whoever starts an episode (the trainer, the harness, the scaffold's model)
  holds the credential and makes the key of the session it names; a key opens that one session only,
  so a key seen in one episode's calls opens no other, and a session cannot be created under another
  episode's id before it starts (making a key for a chosen id needs the credential);
- the trainer credential itself (``Authorization: Bearer <credential>``): any session, and the list
  of sessions (``GET /sessions``), which nothing else may see.

A chat call without a session id gets a new one made by the server (``chat-<random>``, an
*anonymous* session) with its key in the answer's ``X-Session-Key`` header. Anonymous sessions are
capped on their own (``max_anonymous_sessions``, oldest dropped first), so a flood of them never
evicts an episode's session; every session holds at most ``max_calls_per_session`` calls.

**The trainer credential** is a :class:`sandboxes.httpserver.auth.Credential`: given to a process as
``$POSTTRAIN_TRAINER_CREDENTIAL`` or the file named by ``$POSTTRAIN_TRAINER_CREDENTIAL_FILE`` (a
mounted secret), read in one place (``Credential.from_environment``), at least 32 printable
characters; a process given none makes one in memory, never exported, and passes it to each
process it starts that must share it (``env=credential.environment()``, :func:`environment_with`;
that module's docstring). A store, a router or a client holds the object it is given (this
process's by default), and the HTTP layer checks it where a route declares it (:mod:`serving.http`).
It is never put on a command line (``ps`` shows those to every user), and sandboxes start with an
empty environment.
"""

from __future__ import annotations

import hmac
import sys
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Iterable, Mapping

from sandboxes.httpserver.auth import (CREDENTIAL_ENV, CREDENTIAL_FILE_ENV, MIN_CREDENTIAL_CHARS,  # noqa: F401 (serving's names for them)
                             Credential, process_credential, require_given)
from serving.protocol import GenerateRequest

SESSION_HEADER = "X-Session-Id"
SESSION_KEY_HEADER = "X-Session-Key"
ANONYMOUS_PREFIX = "chat-"  # the ids a server makes up for calls that name no session
_KEY_DOMAIN = b"posttrain-session-key\0"
_ENGINE_KEY_DOMAIN = b"posttrain-engine-api-key\0"


def trainer_credential() -> str:
    """The value of this process's credential (:func:`sandboxes.httpserver.auth.process_credential`)."""
    return process_credential().value


def as_credential(credential: Credential | str | None) -> Credential:
    """``credential`` as an object; None is this process's (:func:`sandboxes.httpserver.auth.process_credential`)."""
    if credential is None:
        return process_credential()
    return credential if isinstance(credential, Credential) else Credential(credential)


def warn_if_credential_is_private(what: str) -> None:
    """A server started on its own with no trainer credential given made one that no other process
    knows: only the keys it hands out open its sessions. Say so on stderr, once at its start."""
    if process_credential().source == "generated":
        print(f"{what}: neither ${CREDENTIAL_ENV} nor ${CREDENTIAL_FILE_ENV} is set: sessions open only with the "
              "keys this process hands out; give the trainer, the router and the replicas one credential",
              file=sys.stderr, flush=True)


def environment_with(credential: Credential | str | None = None,
                     base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``credential`` (default: this process's)
    as the trainer credential: the environment of a child that must share it, a replica, an engine,
    a router or the trainer (never passed on its command line)."""
    return as_credential(credential).environment(base)


def session_key(credential: Credential | str, session_id: str) -> str:
    """The key of ``session_id``: what its calls and reads carry in ``X-Session-Key``."""
    return as_credential(credential).derive(_KEY_DOMAIN, session_id.encode())


def trainer_headers(credential: Credential | str | None = None) -> dict[str, str]:
    """Headers that present the trainer credential (any session, the list of sessions)."""
    return as_credential(credential).headers()


def engine_headers(credential: Credential | str | None = None) -> dict[str, str]:
    """Headers for the engine server behind a capture front (vLLM's own API, which the project
    starts with ``VLLM_API_KEY`` set to :func:`engine_api_key`): made from the trainer credential,
    so the front and the trainer's tools agree on it and no other loopback client can load adapters
    or generate past the front."""
    return {"Authorization": f"Bearer {engine_api_key(credential)}"}


def engine_api_key(credential: Credential | str | None = None) -> str:
    """The engine server's key (see :func:`engine_headers`); not the credential itself, which the
    engine never needs."""
    return as_credential(credential).derive(_ENGINE_KEY_DOMAIN)


def session_headers(session_id: str, credential: Credential | str | None = None) -> dict[str, str]:
    """Headers of a call into ``session_id``: its id and its key."""
    return {SESSION_HEADER: session_id, SESSION_KEY_HEADER: session_key(as_credential(credential), session_id)}


def new_session_id() -> str:
    """An anonymous session's id, made by the server (unguessable; never an episode's)."""
    return f"{ANONYMOUS_PREFIX}{uuid.uuid4().hex}"


def presents_credential(credential: Credential | str, headers: Mapping[str, str] | None) -> bool:
    """True when ``headers`` (lower-case names, as :class:`sandboxes.httpserver.Request` has them) carry
    ``Authorization: Bearer <credential>``."""
    return as_credential(credential).presented_by(headers)


def may_use_session(credential: Credential | str, session_id: str, headers: Mapping[str, str] | None) -> bool:
    """True when ``headers`` carry ``session_id``'s key or the trainer credential."""
    credential = as_credential(credential)
    given = (headers or {}).get(SESSION_KEY_HEADER.lower())
    if given is not None and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                 session_key(credential, session_id).encode()):
        return True
    return credential.presented_by(headers)


def refusal(session_id: str, doing: str) -> str:
    """What a caller without the key is told (the same whether or not the session exists)."""
    return (f"session {session_id[:256]!r}: {doing} needs the session's key (header {SESSION_KEY_HEADER}, "
            "made by whoever started the session) or the trainer credential (Authorization: Bearer)")


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
    """Per-session call records and who may use them (see the module docstring): the oldest sessions
    are dropped past ``max_sessions``, the oldest anonymous ones past ``max_anonymous_sessions``.
    ``credential`` is the trainer credential the store checks keys against (the process's by default)."""

    def __init__(self, max_sessions: int = 100_000, *, credential: Credential | str | None = None,
                 max_anonymous_sessions: int = 1024, max_calls_per_session: int = 10_000):
        self.credential = as_credential(credential)
        self.max_sessions = max_sessions
        self.max_anonymous_sessions = max_anonymous_sessions
        self.max_calls_per_session = max_calls_per_session
        self._sessions: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._anonymous: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    # --- who may use a session ---------------------------------------------------------------

    def may_use(self, session_id: str, headers: Mapping[str, str] | None) -> bool:
        """True when ``headers`` carry ``session_id``'s key or the trainer credential."""
        return may_use_session(self.credential, session_id, headers)

    def is_trainer(self, headers: Mapping[str, str] | None) -> bool:
        return self.credential.presented_by(headers)

    def is_full(self, session_id: str) -> bool:
        """True when the session holds ``max_calls_per_session`` calls: it takes no more."""
        with self._lock:
            return len(self._sessions.get(session_id) or ()) >= self.max_calls_per_session

    # --- records ------------------------------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        rid = record.get("rid")
        if rid is None:
            return
        with self._lock:
            calls = self._sessions.get(rid)
            if calls is None:
                calls = self._sessions[rid] = []
                if rid.startswith(ANONYMOUS_PREFIX):
                    self._anonymous[rid] = None
                    while len(self._anonymous) > self.max_anonymous_sessions:
                        self._sessions.pop(self._anonymous.popitem(last=False)[0], None)
                while len(self._sessions) > self.max_sessions:
                    self._anonymous.pop(self._sessions.popitem(last=False)[0], None)
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
            self._anonymous.pop(rid, None)
            return self._sessions.pop(rid, None) is not None


def sessions_of(requests: Iterable[GenerateRequest]) -> list[str]:
    """The distinct sessions a ``/generate`` call writes into (calls without one are not recorded)."""
    return list(dict.fromkeys(r.rid for r in requests if r.rid is not None))


async def acapture_generate(agenerate: Callable[[GenerateRequest], Awaitable[dict[str, Any]]], request: GenerateRequest,
                            store: CaptureStore, replica: str) -> dict[str, Any]:
    """Await ``agenerate`` with logprobs forced on, record the call, and answer as asked."""
    asked = request.return_logprob
    request.return_logprob = True
    started_at = time.time()
    t0 = time.perf_counter()
    try:
        response = await agenerate(request)
    finally:
        request.return_logprob = asked
    store.record(capture_record(request, response, started_at=started_at, latency_s=time.perf_counter() - t0, replica=replica))
    if not asked:
        response.get("meta_info", {}).pop("output_token_logprobs", None)
    return response


def capture_generate(generate: Callable[[GenerateRequest], dict[str, Any]], request: GenerateRequest,
                     store: CaptureStore, replica: str) -> dict[str, Any]:
    """:func:`acapture_generate` for a blocking ``generate`` (an engine call on a worker thread). The
    coroutine never suspends (nothing in it is awaited but ``generate``'s answer, already there), so
    it runs to its end here, with no event loop."""

    async def answered(req: GenerateRequest) -> dict[str, Any]:
        return generate(req)

    coroutine = acapture_generate(answered, request, store, replica)
    try:
        coroutine.send(None)
    except StopIteration as end:
        return end.value
    coroutine.close()
    raise RuntimeError("acapture_generate suspended without an event loop")  # cannot happen: nothing awaits there
