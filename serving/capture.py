"""The capture sidecar: SGLang's replica with every call recorded, as the local engine's are.

The local and simulated engines record into a :class:`~serving.capture_store.CaptureStore` in the
same process (:class:`serving.http.EngineServer`). For SGLang the same record is kept by this sidecar
on localhost in the replica's pod:

    python -m serving.capture --upstream http://127.0.0.1:30000 --port 30001

The sidecar speaks the engine API: it forwards ``/generate`` to SGLang with ``return_logprob``
forced on, records the call, and answers the caller as SGLang would (logprobs stripped again when
the caller did not ask). Sharded adapter uploads are assembled on a volume SGLang also mounts and
loaded from there. Everything else is passed through. ``GET /sessions/{rid}`` serves a session's
calls in order.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from serving.adapters import ShardAssembler
from serving.capture_store import CaptureStore, capture_generate
from serving.client import HttpPool
from serving.http import EngineServer, HttpError, HttpLimits, JsonServer, Request, Route, Text
from serving.protocol import parse_adapter_name, parse_generate


class SidecarServer(JsonServer):
    """The capture sidecar for SGLang (see the module docstring)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, staging_dir=None,
                 limits: HttpLimits | None = None):
        self.upstream = upstream.rstrip("/")
        self.pool = HttpPool()
        self.capture = CaptureStore()
        self.shards = ShardAssembler(staging_dir)
        routes: dict[tuple[str, str], Route] = {
            ("POST", "/generate"): self._generate,
            ("PUT", "/lora_shards/"): lambda r: EngineServer._shard(self, r),  # same receiving code
            ("POST", "/commit_lora_adapter"): self._commit,
            ("GET", "/sessions"): lambda r: {"sessions": self.capture.sessions()},
            ("GET", "/sessions/"): lambda r: EngineServer._session(self, r),
            ("DELETE", "/sessions/"): lambda r: EngineServer._drop_session(self, r),
        }
        for method in ("GET", "POST"):
            for path in ("/load_lora_adapter", "/unload_lora_adapter", "/health", "/health_generate", "/server_info",
                         "/get_server_info", "/metrics", "/flush_cache", "/get_model_info"):
                routes.setdefault((method, path), self._passthrough)
        super().__init__(routes, host, port, limits=limits)

    def _upstream_generate(self, request) -> dict[str, Any]:
        status, data, _ = self.pool.request("POST", f"{self.upstream}/generate", json.dumps(request.to_json()).encode())
        if status >= 300:
            raise HttpError(status, data.decode(errors="replace"))
        return json.loads(data)

    def _generate(self, req: Request) -> Any:
        body = req.json()
        requests = parse_generate(body)
        answers = [capture_generate(self._upstream_generate, r, self.capture, self.upstream) for r in requests]
        return answers if isinstance(body["input_ids"][0], list) else answers[0]

    def _commit(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        path = self.shards.commit(name, body.get("num_shards"), body.get("adapter_config"))
        # The sidecar shares the pod (and a volume) with SGLang, which loads from the path.
        return self.pool.json("POST", f"{self.upstream}/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def _passthrough(self, req: Request) -> Any:
        status, data, ctype = self.pool.request(req.method, f"{self.upstream}{req.path}", req.body or None)
        if status >= 300:
            raise HttpError(status, data.decode(errors="replace"))
        if "json" in ctype:
            return json.loads(data) if data else {}
        return Text(data.decode(), ctype or "text/plain")


def serve_sidecar(upstream: str, host: str = "127.0.0.1", port: int = 0, staging_dir=None,
                  limits: HttpLimits | None = None) -> SidecarServer:
    return SidecarServer(upstream, host, port, staging_dir, limits).start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", required=True, help="the SGLang server on localhost, e.g. http://127.0.0.1:30000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30001)
    parser.add_argument("--staging-dir", default=None,
                        help="where sharded adapter uploads are assembled; SGLang must see it (a volume both containers mount)")
    parser.add_argument("--http-idle-timeout-s", type=float, default=None,
                        help="close a kept-alive client connection after this long without a request "
                             "(default: serving.http.HttpLimits.idle_timeout_s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.capture", description="capture sidecar in front of an SGLang replica")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    server = serve_sidecar(args.upstream, host=args.host, port=args.port, staging_dir=args.staging_dir,
                           limits=HttpLimits(idle_timeout_s=args.http_idle_timeout_s) if args.http_idle_timeout_s else None)
    return server.run_in_foreground(f"capture sidecar for {args.upstream} on {server.url}")


if __name__ == "__main__":
    raise SystemExit(main())
