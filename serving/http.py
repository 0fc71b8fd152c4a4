"""SGLang's native API in front of any ``InProcessEngine``, with capture in the replica, on the
project's HTTP layer (:mod:`sandboxes.httpserver`).

    server = serve(engine, host="127.0.0.1", port=0)   # port 0: pick a free one
    server.url                                         # http://127.0.0.1:PORT
    server.shutdown()

Endpoints (JSON unless said):
  POST /generate              {input_ids, sampling_params, return_logprob, lora_path, rid}
                              -> {text, output_ids, meta_info{prompt_tokens, completion_tokens,
                                 cached_tokens, finish_reason, weight_version, output_token_logprobs}}
                              (input_ids a list of lists -> a list of answers)
  POST /load_lora_adapter     {lora_name, lora_path}
  POST /unload_lora_adapter   {lora_name}
  PUT  /lora_shards/{lora_name}/{shard_index}?num_shards=N   (body: safetensors bytes)
  POST /commit_lora_adapter   {lora_name, num_shards, adapter_config}
  GET  /health, /health_generate, /server_info (alias /get_server_info), /metrics (Prometheus text)
  GET  /sessions, /sessions/{rid}; DELETE /sessions/{rid}   (captured calls: the session's key or
                              the trainer credential, serving.capture_store)

Who may call a route is declared with it (an :class:`sandboxes.httpserver.Endpoint`'s access) and checked by
the HTTP layer before the handler runs: the four adapter routes need the trainer credential
(``Authorization: Bearer``, else ``403``, before any of the body is read): an adapter loaded is the
policy every later call may sample, and ``lora_path`` names a folder the replica reads. A call into
a session, reading it and deleting it need its key or the credential (:class:`SessionAccess`).

Bad input is answered 400 with ``{"error": "..."}`` naming the field (a ``BadRequest``). The
transport, its bounds on slow, stalled or odd clients (``HttpLimits``) and the framing it refuses
are :mod:`sandboxes.httpserver`'s, the same for every server of the project.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from sandboxes.httpserver import (MAX_BODY_BYTES, Bearer, Endpoint, HttpError, HttpLimits, HttpServer, Reply, Request, Route, Stream,
                        Text, needs_bearer, stop_as_interrupt)
from serving.adapters import ShardAssembler
from serving.capture_store import CaptureStore, acapture_generate, capture_generate, refusal, sessions_of
from serving.protocol import (BadRequest, InProcessEngine, awaited_generate, parse_adapter_load, parse_adapter_name,
                              parse_generate, render_metrics)

__all__ = ["EngineServer", "HttpError", "HttpLimits", "JsonServer", "MAX_BODY_BYTES", "Reply", "Request", "Route",
           "SessionAccess", "Stream", "Text", "check_session_access", "serve", "session_routes", "stop_as_interrupt",
           "trainer_only"]


class JsonServer(HttpServer):
    """An :class:`sandboxes.httpserver.HttpServer` whose handlers' ``BadRequest`` (serving's bad input)
    is a 400; ``max_body_bytes``, where given, overrides ``limits``'s."""

    def __init__(self, routes: dict[tuple[str, str], Route | Endpoint], host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int | None = None, limits: HttpLimits | None = None):
        limits = limits or HttpLimits()
        if max_body_bytes is not None:
            limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
        super().__init__(routes, host, port, limits, errors=(BadRequest,))


def check_session_access(capture: CaptureStore, session_id: str, headers: dict[str, str] | None, doing: str,
                         *, appending: bool = False) -> None:
    """Refuse (403) a caller without ``session_id``'s key or the trainer credential
    (:mod:`serving.capture_store`), whether or not the session exists; refuse (429) a call into a
    session that holds as many calls as one may."""
    if not capture.may_use(session_id, headers):
        raise HttpError(403, refusal(session_id, doing))
    if appending and capture.is_full(session_id):
        raise HttpError(429, f"session {session_id!r} holds {capture.max_calls_per_session} calls, "
                             "the most one session may hold")


class SessionAccess:
    """A route that uses the sessions ``sessions(request)`` names: ``verify(session_id, headers, doing)``
    refuses a caller without each one's key or the trainer credential (403), or a call into a full
    session (429). Checked by the HTTP layer once the body is read (a ``/generate`` call names its
    sessions there)."""

    from_headers = False

    def __init__(self, verify: Callable[[str, dict[str, str], str], None], doing: str,
                 sessions: Callable[[Request], list[str]]):
        self.verify, self.doing, self.sessions = verify, doing, sessions

    def check(self, request: Request) -> None:
        for session_id in self.sessions(request):
            self.verify(session_id, request.headers, self.doing)


def capture_access(capture: CaptureStore, doing: str, sessions: Callable[[Request], list[str]], *,
                   appending: bool = False) -> SessionAccess:
    """Sessions of ``capture``: each needs its key or the credential; ``appending``: and room for a call."""
    return SessionAccess(functools.partial(check_session_access, capture, appending=appending), doing, sessions)


def trainer_only(capture: CaptureStore, doing: str) -> Bearer:
    """The access of a route that needs the trainer credential the capture store checks keys against."""
    return needs_bearer(capture.credential, doing)


def generate_access(capture: CaptureStore) -> SessionAccess:
    """``POST /generate`` writes into each session its calls name: each needs its key (or the credential)."""
    return capture_access(capture, "a call into it", _generate_sessions, appending=True)


def generate_and_adapter_routes(server: Any, capture: CaptureStore) -> dict[tuple[str, str], Endpoint]:
    """The SGLang routes that call the engine and change its adapters, as every engine-facing server
    (:class:`EngineServer`, the capture front) declares them: ``server`` has ``_generate``, ``_load``,
    ``_unload``, ``_shard`` and ``_commit``; each adapter change needs the trainer credential."""
    return {
        ("POST", "/generate"): Endpoint(server._generate, generate_access(capture)),
        ("POST", "/load_lora_adapter"): Endpoint(server._load, trainer_only(capture, "loading an adapter")),
        ("POST", "/unload_lora_adapter"): Endpoint(server._unload, trainer_only(capture, "unloading an adapter")),
        ("PUT", "/lora_shards/"): Endpoint(server._shard, trainer_only(capture, "uploading an adapter")),
        ("POST", "/commit_lora_adapter"): Endpoint(server._commit, trainer_only(capture, "loading an adapter")),
    }


def _generate_sessions(req: Request) -> list[str]:
    req.state["generate"] = requests = parse_generate(req.json())  # parsed once, for the handler too
    return sessions_of(requests)


def parsed_generate(req: Request) -> list:
    """A ``/generate`` call's requests, as its access check parsed them."""
    requests = req.state.get("generate")
    return requests if requests is not None else parse_generate(req.json())


def _session_in_path(req: Request) -> list[str]:
    return ["/".join(req.params)]


def session_routes(capture: CaptureStore) -> dict[tuple[str, str], Endpoint]:
    """``GET /sessions`` (with the trainer credential only) and ``GET|DELETE /sessions/{id}`` (with
    the session's key or the trainer credential); any other caller gets 403."""

    def read(req: Request) -> Any:
        rid = "/".join(req.params)
        calls = capture.session(rid)
        if calls is None:
            raise HttpError(404, f"no captured session {rid!r}")
        return {"rid": rid, "session_id": rid, "calls": calls}

    return {
        ("GET", "/sessions"): Endpoint(lambda req: {"sessions": capture.sessions()}, trainer_only(capture, "listing sessions")),
        ("GET", "/sessions/"): Endpoint(read, capture_access(capture, "reading it", _session_in_path)),
        ("DELETE", "/sessions/"): Endpoint(lambda req: {"dropped": capture.drop("/".join(req.params))},
                                           capture_access(capture, "deleting it", _session_in_path)),
    }


class EngineServer(JsonServer):
    """An ``InProcessEngine`` behind SGLang's native API, capturing every call in ``self.capture``.

    ``/generate`` awaits the engine's ``agenerate`` on the server's event loop (the engine's own
    thread does the work and wakes the loop): a call takes no worker thread and no hop to one. An
    engine whose call blocks (no ``agenerate``, or a ``generate`` of its own that the awaitable call
    would skip: :func:`serving.protocol.awaited_generate`) is called on a worker thread instead."""

    def __init__(self, engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0, *, staging_dir=None,
                 model_name: str = "posttrain", limits: HttpLimits | None = None):
        self.engine = engine
        self.capture = CaptureStore()
        self.shards = ShardAssembler(staging_dir)
        self.model_name = model_name
        self._agenerate = awaited_generate(engine)
        self._batch_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="batch") if self._agenerate is None else None
        # the route's handler (an ``async def`` one runs on the loop: sandboxes.httpserver.Endpoint)
        self._generate = self._generate_awaited if self._agenerate is not None else self._generate_blocking
        routes: dict[tuple[str, str], Route | Endpoint] = {
            **generate_and_adapter_routes(self, self.capture),
            # answered on the event loop: a health check is never queued behind calls that hold every worker
            ("GET", "/health"): Endpoint(lambda r: {"status": "ok"}, on_loop=True),
            ("GET", "/health_generate"): Endpoint(lambda r: {"status": "ok"}, on_loop=True),
            ("GET", "/server_info"): lambda r: self.engine.server_info(),
            ("GET", "/get_server_info"): lambda r: self.engine.server_info(),
            ("GET", "/metrics"): lambda r: Text(render_metrics(self.engine.metrics(), {"model_name": self.model_name})),
            **session_routes(self.capture),
        }
        super().__init__(routes, host, port, limits=limits)

    async def _generate_awaited(self, req: Request) -> Any:
        requests = parsed_generate(req)
        if not isinstance(req.json()["input_ids"][0], list):
            return await acapture_generate(self._agenerate, requests[0], self.capture, self.url)
        # A batch: its calls in the engine at once; every call ends before the answer, and the first
        # failure in the batch's order is the answer (as the worker threads' map answered it).
        answers = await asyncio.gather(*(acapture_generate(self._agenerate, r, self.capture, self.url) for r in requests),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return answers

    def _generate_blocking(self, req: Request) -> Any:
        requests = parsed_generate(req)
        if not isinstance(req.json()["input_ids"][0], list):
            return capture_generate(self.engine.generate, requests[0], self.capture, self.url)
        return list(self._batch_pool.map(
            lambda r: capture_generate(self.engine.generate, r, self.capture, self.url), requests))

    def _load(self, req: Request) -> Any:
        name, path = parse_adapter_load(req.json())
        self.engine.load_lora_adapter(name, path)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _unload(self, req: Request) -> Any:
        name = parse_adapter_name(req.json())
        self.engine.unload_lora_adapter(name)
        return {"success": True, "loaded_adapters": self.engine.adapters()}

    def _shard(self, req: Request) -> Any:
        if len(req.params) != 2:
            raise BadRequest("use PUT /lora_shards/{lora_name}/{shard_index}?num_shards=N")
        name = parse_adapter_name({"lora_name": req.params[0]})
        try:
            index = int(req.params[1])
            num_shards = int(req.query.get("num_shards", [""])[0])
        except ValueError:
            raise BadRequest("shard_index and the num_shards query parameter must be integers") from None
        self.shards.put(name, index, num_shards, req.body)
        return {"success": True}

    def _commit(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        path = self.shards.commit(name, body.get("num_shards"), body.get("adapter_config"))
        self.engine.load_lora_adapter(name, str(path))
        return {"success": True, "lora_path": str(path), "loaded_adapters": self.engine.adapters()}

    def shutdown(self) -> None:
        super().shutdown()
        if self._batch_pool is not None:
            self._batch_pool.shutdown(wait=False)
        self.engine.close()


def serve(engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0, **kwargs) -> EngineServer:
    """Serve ``engine`` on ``host:port`` from a background thread; returns the running server."""
    return EngineServer(engine, host, port, **kwargs).start()
