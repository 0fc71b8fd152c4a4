"""HTTP for engines: SGLang's native API in front of any ``Engine``, with capture in the replica.

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
  GET  /sessions, /sessions/{rid}; DELETE /sessions/{rid}   (captured calls)

Bad input is answered 400 with ``{"error": "..."}`` naming the field.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from serving.adapters import ShardAssembler
from serving.capture import CaptureStore, capture_generate
from serving.protocol import BadRequest, Engine, parse_adapter_name, parse_generate, render_metrics


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # thousands of sessions may connect at once

    def __init__(self, *args, **kwargs):
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request_thread(self, request, client_address):
        with self.sockets_lock:
            self.open_sockets.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.sockets_lock:
                self.open_sockets.discard(request)

    def handle_error(self, request, client_address):  # a peer that went away is not news
        pass

    def close_connections(self) -> None:
        with self.sockets_lock:
            sockets = list(self.open_sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# The largest request body a server reads: above a sharded adapter upload of a large model (one
# shard of a rank-64 adapter of an 8B model is well under it), far below what would exhaust memory.
MAX_BODY_BYTES = 1 << 30


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Route = Callable[["Request"], Any]


class Request:
    def __init__(self, method: str, path: str, query: dict[str, list[str]], body: bytes, params: list[str]):
        self.method, self.path, self.query, self.body, self.params = method, path, query, body, params

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc


class Text:
    """A non-JSON answer."""

    def __init__(self, text: str, content_type: str = "text/plain; version=0.0.4"):
        self.text, self.content_type = text, content_type


class JsonServer:
    """A threaded HTTP/1.1 server dispatching ``(method, path prefix)`` to handlers."""

    def __init__(self, routes: dict[tuple[str, str], Route], host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # small answers leave at once

            def log_message(self, *args):  # quiet: one line per call would swamp the logs
                pass

            def _handle(self, method: str) -> None:
                parts = urlsplit(self.path)
                claimed = self.headers.get("Content-Length") or "0"
                try:
                    length = int(claimed)
                except ValueError:
                    return self._refuse(400, f"Content-Length is not an integer: {claimed[:40]!r}")
                if not 0 <= length <= server.max_body_bytes:
                    # Refused before reading: a body is never buffered past the limit.
                    return self._refuse(413, f"Content-Length {length} outside 0..{server.max_body_bytes}")
                body = self.rfile.read(length) if length else b""
                status, payload, ctype = server.dispatch(method, parts.path, parse_qs(parts.query), body)
                self._send(status, payload, ctype)

            def _refuse(self, status: int, message: str) -> None:
                self.close_connection = True  # the unread body would be taken for the next request
                self._send(status, json.dumps({"error": message}).encode(), "application/json", close=True)

            def _send(self, status: int, payload: bytes, ctype: str, close: bool = False) -> None:
                # One write for status line, headers and body: a reader that takes the first segment
                # gets the whole answer, and no delayed ACK stalls a second small write.
                lines = [f"{self.protocol_version} {status} {self.responses.get(status, ('',))[0]}",
                         f"Server: {self.version_string()}", f"Date: {self.date_time_string()}",
                         f"Content-Type: {ctype}", f"Content-Length: {len(payload)}"]
                if close:
                    lines.append("Connection: close")
                self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def do_DELETE(self):
                self._handle("DELETE")

        self.httpd = _Server((host, port), Handler)
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None

    def dispatch(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> tuple[int, bytes, str]:
        segments = [unquote(s) for s in path.strip("/").split("/") if s]
        handler, params = None, []
        for (m, prefix), fn in self.routes.items():
            pre = [s for s in prefix.strip("/").split("/") if s]
            if m == method and segments[:len(pre)] == pre and (len(segments) == len(pre) or prefix.endswith("/")):
                handler, params = fn, segments[len(pre):]
                break
        try:
            if handler is None:
                raise HttpError(404, f"no route for {method} {path}")
            result = handler(Request(method, path, query, body, params))
        except BadRequest as exc:
            return 400, json.dumps({"error": str(exc)}).encode(), "application/json"
        except HttpError as exc:
            return exc.status, json.dumps({"error": str(exc)}).encode(), "application/json"
        except Exception as exc:  # an engine failure: 500 with the reason, the server keeps serving
            return 500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), "application/json"
        if isinstance(result, Text):
            return 200, result.text.encode(), result.content_type
        return 200, json.dumps(result).encode(), "application/json"

    def start(self) -> "JsonServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"http-{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_until_stopped(self) -> None:
        if self._thread is None:
            self.httpd.serve_forever()
        else:
            self._thread.join()

    def run_in_foreground(self, banner: str) -> int:
        """Print ``banner``, serve until interrupted, then shut down: the body of a server's ``__main__``."""
        print(banner, flush=True)
        try:
            self.serve_until_stopped()
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """Stop listening and cut every open connection (calls in flight see a reset, as from a crash)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)


class EngineServer(JsonServer):
    """An ``Engine`` behind SGLang's native API, capturing every call in ``self.capture``."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, *, staging_dir=None,
                 model_name: str = "posttrain"):
        self.engine = engine
        self.capture = CaptureStore()
        self.shards = ShardAssembler(staging_dir)
        self.model_name = model_name
        self._batch_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="batch")
        routes: dict[tuple[str, str], Route] = {
            ("POST", "/generate"): self._generate,
            ("POST", "/load_lora_adapter"): self._load,
            ("POST", "/unload_lora_adapter"): self._unload,
            ("PUT", "/lora_shards/"): self._shard,
            ("POST", "/commit_lora_adapter"): self._commit,
            ("GET", "/health"): lambda r: {"status": "ok"},
            ("GET", "/health_generate"): lambda r: {"status": "ok"},
            ("GET", "/server_info"): lambda r: self.engine.server_info(),
            ("GET", "/get_server_info"): lambda r: self.engine.server_info(),
            ("GET", "/metrics"): lambda r: Text(render_metrics(self.engine.metrics(), {"model_name": self.model_name})),
            ("GET", "/sessions"): lambda r: {"sessions": self.capture.sessions()},
            ("GET", "/sessions/"): self._session,
            ("DELETE", "/sessions/"): self._drop_session,
        }
        super().__init__(routes, host, port)

    def _generate(self, req: Request) -> Any:
        body = req.json()
        requests = parse_generate(body)
        if not isinstance(body["input_ids"][0], list):
            return capture_generate(self.engine.generate, requests[0], self.capture, self.url)
        return list(self._batch_pool.map(
            lambda r: capture_generate(self.engine.generate, r, self.capture, self.url), requests))

    def _load(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("lora_path must be the adapter's directory (a string)")
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

    def _session(self, req: Request) -> Any:
        rid = "/".join(req.params)
        calls = self.capture.session(rid)
        if calls is None:
            raise HttpError(404, f"no captured session {rid!r}")
        return {"rid": rid, "calls": calls}

    def _drop_session(self, req: Request) -> Any:
        rid = "/".join(req.params)
        return {"dropped": self.capture.drop(rid)}

    def shutdown(self) -> None:
        super().shutdown()
        self._batch_pool.shutdown(wait=False)
        self.engine.close()


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 0, **kwargs) -> EngineServer:
    """Serve ``engine`` on ``host:port`` from a background thread; returns the running server."""
    return EngineServer(engine, host, port, **kwargs).start()


class SidecarServer(JsonServer):
    """The capture sidecar for SGLang (see ``serving.capture``)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, staging_dir=None):
        from serving.client import HttpPool

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
        super().__init__(routes, host, port)

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


def serve_sidecar(upstream: str, host: str = "127.0.0.1", port: int = 0, staging_dir=None) -> SidecarServer:
    return SidecarServer(upstream, host, port, staging_dir).start()
