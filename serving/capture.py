"""The capture front: posttrain's engine API in front of any engine, with every call recorded.

The router, :class:`serving.client.EngineClient`, the trainer's publisher and the harness speak one
API (SGLang-native-shaped ``POST /generate``, ``/load_lora_adapter``, ``/unload_lora_adapter``,
sharded ``PUT /lora_shards/{name}/{i}`` + ``POST /commit_lora_adapter``, ``GET /health``,
``/server_info``, ``/metrics`` with ``sglang:`` names, ``GET|DELETE /sessions/{id}``). This front
translates it into the engine protocol (:mod:`serving.engines.base`) of the engine behind it,
vLLM, SGLang or the local engine, and records each call's exact token ids and logprobs by session
(:mod:`serving.capture_store`). Locally it is part of a replica process (:mod:`serving.replica`);
in a pod it runs beside the engine container:

    python -m serving.capture --upstream http://127.0.0.1:30000 --engine sglang --port 30001

What the front adds to the engine:
- each call gets a request id of its own (``{session}#{n}``), unique among calls in flight, while
  the session id stays a routing and capture key;
- the adapter table: ``/server_info``'s ``loaded_adapters`` lists what was loaded through this
  front (an engine's own listing is not relied on), and loading a version already loaded succeeds;
- metrics in one vocabulary, whatever names the engine uses (:class:`EngineMetrics`);
- sessions that belong to their caller: a call into a session, and reading or deleting it, needs the
  session's key or the trainer credential (:mod:`serving.capture_store`), which this process takes
  from ``$POSTTRAIN_TRAINER_CREDENTIAL`` or ``$POSTTRAIN_TRAINER_CREDENTIAL_FILE`` (the router and
  the trainer must have the same);
- adapters that only the trainer changes: loading, unloading and uploading one needs the trainer
  credential (403 otherwise), since a version loaded is what later calls sample.

The chat route (``POST /v1/chat/completions``) is served by :mod:`serving.chat` when that module
is installed: ``serving.chat.chat_completions(front, request)``, awaited on the loop as the routes
below are, gets this front (its ``engine``, ``capture`` and ``adapters``) and the HTTP request.

The routes that call the engine are ``async def`` handlers, run on the server's event loop
(:mod:`sandboxes.httpserver`), awaiting the engine client's calls (``agenerate``, ``aload_adapter``,
...) on its connections to the engine (:class:`serving.engines.transport.EngineHttp`, one pool
for the process): a call through the front takes no worker thread and no thread hop. Only the
sharded upload (disk writes) runs on a worker thread. The front owns the engine client it is given
and closes its connections on :meth:`CaptureFront.shutdown`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import importlib.util
import itertools
import threading
import time
from typing import Any

from serving.adapters import ShardAssembler
from serving.capture_store import CaptureStore, trainer_headers, warn_if_credential_is_private
from serving.engines import ENGINES, UpstreamEngine, engine_client
from serving.engines.base import EngineMetrics
from serving.engines.transport import EngineHttp
from serving.http import (Endpoint, EngineServer, HttpError, HttpLimits, JsonServer, Request, Route, Text,
                          generate_and_adapter_routes, parsed_generate, session_routes)
from serving.protocol import (BASE_WEIGHT_VERSION, GenerateRequest, engine_adapter, parse_adapter_load,
                              parse_adapter_name, render_metrics)


def sglang_metrics(m: EngineMetrics) -> dict[str, float]:
    """:class:`EngineMetrics` under the ``sglang:`` names the router reads."""
    return {
        "num_running_reqs": m.running, "num_queue_reqs": m.queued, "token_usage": m.kv_usage,
        "num_used_tokens": m.kv_usage * m.max_total_tokens, "max_total_num_tokens": m.max_total_tokens,
        "cache_hit_rate": m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0.0,
        "prompt_tokens_total": m.prompt_tokens_total, "generation_tokens_total": m.generation_tokens_total,
        "cached_tokens_total": m.prefix_cache_hits, "prefix_cache_queries_total": m.prefix_cache_queries,
    }


class CaptureFront(JsonServer):
    """Posttrain's engine API over one protocol engine (see the module docstring)."""

    def __init__(self, engine: UpstreamEngine, host: str = "127.0.0.1", port: int = 0, *, staging_dir=None,
                 limits: HttpLimits | None = None, model_name: str = "posttrain", merged_version: str | None = None):
        self.engine = engine
        # An adapter version merged into the weights the engine serves (serving.adapters.merge_adapter):
        # calls asking for it go to the engine's base model and are recorded under its name.
        self.merged_version = merged_version
        self.capture = CaptureStore()
        self.shards = ShardAssembler(staging_dir)
        self.model_name = model_name
        self.adapters: dict[str, str] = {}  # version name -> path, loaded through this front
        self._lock = threading.Lock()
        self._calls = itertools.count()
        routes: dict[tuple[str, str], Route | Endpoint] = {
            **generate_and_adapter_routes(self, self.capture),
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/metrics"): self._metrics,
            **session_routes(self.capture),
        }
        if importlib.util.find_spec("serving.chat") is not None:  # the OpenAI chat route, where installed
            chat = importlib.import_module("serving.chat")
            # an ``async def`` handler: run on the loop, awaiting the engine (sandboxes.httpserver.Endpoint)
            routes[("POST", "/v1/chat/completions")] = Endpoint(functools.partial(chat.chat_completions, self),
                                                                chat.front_chat_access(self.capture))
        super().__init__(routes, host, port, limits=limits)

    # --- generation and capture -------------------------------------------------------------

    def request_id(self, session_id: str | None) -> str:
        """A request id for one engine call: unique among this front's calls (and so among those in
        flight), prefixed by the session for reading an engine's log."""
        return f"{session_id or 'call'}#{next(self._calls)}-{time.monotonic_ns() % 10**9:09d}"

    async def generate_one(self, request: GenerateRequest) -> dict[str, Any]:
        """Run one call on the engine, record it, and answer in SGLang's ``/generate`` shape."""
        if request.lora_path is not None and request.lora_path == BASE_WEIGHT_VERSION:
            request.lora_path = None
        adapter = engine_adapter(request.lora_path, self.merged_version, "lora_path")
        request_id = self.request_id(request.rid)
        started_at = time.time()
        t0 = time.perf_counter()
        gen = await self.engine.agenerate(request.input_ids, request.sampling_params, adapter=adapter,
                                          request_id=request_id)
        latency_s = time.perf_counter() - t0
        meta: dict[str, Any] = {
            "id": request_id, "session_id": request.rid, "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": len(gen.output_ids), "cached_tokens": gen.cached_tokens,
            "finish_reason": gen.finish_reason, "weight_version": request.lora_path or BASE_WEIGHT_VERSION,
            "lora_path": request.lora_path, "e2e_latency": latency_s, "engine": self.engine.kind,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(gen.output_logprobs, gen.output_ids)]
        self.capture.record({
            "rid": request.rid, "session_id": request.rid, "request_id": request_id,
            "engine_request_id": gen.engine_request_id, "engine": self.engine.kind,
            "input_ids": list(request.input_ids), "output_ids": list(gen.output_ids),
            "output_logprobs": list(gen.output_logprobs), "lora_path": request.lora_path,
            "weight_version": meta["weight_version"], "finish_reason": gen.finish_reason,
            "cached_tokens": gen.cached_tokens, "sampling_params": request.to_json()["sampling_params"],
            "started_at": started_at, "latency_s": latency_s, "replica": self.url,
        })
        return {"text": "", "output_ids": list(gen.output_ids), "meta_info": meta}

    async def _generate(self, req: Request) -> Any:
        body = req.json()
        requests = parsed_generate(req)
        if not isinstance(body["input_ids"][0], list):
            return await self.generate_one(requests[0])
        # A batch: its calls at once, 32 at most in flight (as the thread pool this replaced); every
        # call ends before the answer, and the first failure in the batch's order is the answer.
        room = asyncio.Semaphore(32)

        async def one(request: GenerateRequest) -> dict[str, Any]:
            async with room:
                return await self.generate_one(request)

        answers = await asyncio.gather(*(one(r) for r in requests), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return answers

    # --- adapters ---------------------------------------------------------------------------

    async def aload_adapter(self, name: str, path: str) -> None:
        """Load version ``name`` from ``path`` on the engine (a version already loaded is success)."""
        await self.engine.aload_adapter(name, str(path))
        with self._lock:
            self.adapters[name] = str(path)

    def load_adapter(self, name: str, path: str) -> None:
        """:meth:`aload_adapter`, blocking: for a caller outside the server's loop (the replica
        loading its newest version at start)."""
        self.engine.http.run(self.aload_adapter(name, path))

    def _loaded(self) -> list[str]:
        with self._lock:
            return sorted(self.adapters)

    async def _load(self, req: Request) -> Any:
        name, path = parse_adapter_load(req.json())
        await self.aload_adapter(name, path)
        return {"success": True, "loaded_adapters": self._loaded()}

    async def _unload(self, req: Request) -> Any:
        name = parse_adapter_name(req.json())
        await self.engine.aunload_adapter(name)
        with self._lock:
            self.adapters.pop(name, None)
        return {"success": True, "loaded_adapters": self._loaded()}

    def _shard(self, req: Request) -> Any:
        return EngineServer._shard(self, req)  # the engine server's receiving code, on this front's assembler

    async def _commit(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        # The engine reads the assembled adapter from this path: the same machine, or a volume both
        # mount. Assembling it writes files: on a thread, off the loop.
        path = await asyncio.to_thread(self.shards.commit, name, body.get("num_shards"), body.get("adapter_config"))
        await self.aload_adapter(name, str(path))
        return {"success": True, "lora_path": str(path), "loaded_adapters": self._loaded()}

    # --- the rest ---------------------------------------------------------------------------

    async def _health(self, req: Request) -> Any:
        if not await self.engine.ahealth():
            raise HttpError(503, f"engine {self.engine.kind} at {self.engine.url} is not healthy")
        return {"status": "ok"}

    async def _server_info(self, req: Request) -> Any:
        m = await self.engine.ametrics()
        return {"engine": self.engine.kind, "engine_url": self.engine.url, "loaded_adapters": self._loaded(),
                "max_total_num_tokens": int(m.max_total_tokens), "weight_version": self.merged_version or BASE_WEIGHT_VERSION,
                "enable_lora": True}

    async def _metrics(self, req: Request) -> Any:
        return Text(render_metrics(sglang_metrics(await self.engine.ametrics()), {"model_name": self.model_name}))

    def shutdown(self) -> None:
        """Close the connections to the engine (on the server's loop, while it runs), then stop
        serving. A call in flight fails either way: its caller sees an error answer or the reset."""
        self.engine.close()
        super().shutdown()


def serve_front(engine: UpstreamEngine, host: str = "127.0.0.1", port: int = 0, staging_dir=None,
                limits: HttpLimits | None = None, merged_version: str | None = None) -> CaptureFront:
    return CaptureFront(engine, host, port, staging_dir=staging_dir, limits=limits, merged_version=merged_version).start()


def upstream_engine(kind: str, url: str) -> UpstreamEngine:
    """The protocol client of the engine server behind a front. The project's own engine server
    (``local``) guards its sessions as the front does, so the front calls it with the trainer
    credential; the others get no credential of ours."""
    if kind == "local":
        return engine_client(kind, url, http=EngineHttp(headers=trainer_headers()))
    return engine_client(kind, url)


def serve_sidecar(upstream: str, host: str = "127.0.0.1", port: int = 0, staging_dir=None,
                  limits: HttpLimits | None = None, engine: str = "local") -> CaptureFront:
    """The front in front of an engine server at ``upstream`` (``engine`` names its API)."""
    return serve_front(upstream_engine(engine, upstream), host, port, staging_dir, limits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, help="the engine server on localhost, e.g. http://127.0.0.1:30000")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="sglang", help="which engine serves at --upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30001)
    parser.add_argument("--staging-dir", default=None,
                        help="where sharded adapter uploads are assembled; the engine must see it (a volume both containers mount)")
    parser.add_argument("--http-idle-timeout-s", type=float, default=None,
                        help="close a kept-alive client connection after this long without a request "
                             "(default: serving.http.HttpLimits.idle_timeout_s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.capture", description="capture front of an engine replica")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    limits = HttpLimits(idle_timeout_s=args.http_idle_timeout_s) if args.http_idle_timeout_s else None
    warn_if_credential_is_private("serving.capture")
    server = serve_front(upstream_engine(args.engine, args.upstream), host=args.host, port=args.port,
                         staging_dir=args.staging_dir, limits=limits)
    return server.run_in_foreground(f"capture front for {args.engine} at {args.upstream} on {server.url}")


if __name__ == "__main__":
    raise SystemExit(main())
