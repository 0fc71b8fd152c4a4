"""The router over HTTP: the engine API in front of the replicas, plus fleet management.

    server = serve_router(Router("kv_headroom"), port=0)   # 127.0.0.1 by default; server.url

Endpoints: the engine API (``POST /generate``, ``POST /v1/chat/completions``: OpenAI chat calls,
sticky per ``X-Session-Id``, :mod:`serving.router.chat`, ``GET /health``, ``/metrics``, ``/server_info``,
``/sessions/{rid}``: a session's captured calls from every replica it used), plus
``POST /end_session {rid}``, ``POST /workers {url, pool, size_gpus}`` (alias ``/add_worker``),
``POST /remove_worker {url}``, ``GET /workers``, ``POST /publish_adapter {lora_name, lora_path}``.
Bad input is answered 400 naming the field. A call into a session, reading it and ending it need the
session's key or the trainer credential (403 otherwise: :mod:`serving.router.core`); adding or
removing a worker needs the trainer credential, since a replica of a caller's own would serve and
capture the sessions placed on it; so does publishing an adapter (it names what replicas load and
serve). The replicas' own adapter routes need it too (:mod:`serving.http`).
"""

from __future__ import annotations

from typing import Any

from serving.http import Endpoint, HttpError, HttpLimits, JsonServer, Request, SessionAccess, Text, needs_bearer
from serving.chat import chat_access
from serving.protocol import BadRequest, parse_adapter_name, parse_generate
from serving.router.chat import RouterChat
from serving.router.core import Router


def _rid_in_body(req: Request) -> list[str]:
    body = req.json()
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise BadRequest("rid must be the session id (a string)")
    return [rid]


def _rid_in_path(req: Request) -> list[str]:
    return ["/".join(req.params)]


def _rid_of_call(req: Request) -> list[str]:
    requests = parse_generate(req.json())
    return [requests[0].rid] if len(requests) == 1 and requests[0].rid is not None else []


def generate_access(router: Router) -> SessionAccess:
    """``POST /generate``: a call into a session needs its key or the trainer credential."""
    return SessionAccess(router.check_session, "a call into it", _rid_of_call)


class RouterServer(JsonServer):
    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0, limits: HttpLimits | None = None):
        self.router = router
        routes = {
            ("POST", "/generate"): Endpoint(lambda r: router.generate(r.json(), r.body), generate_access(router)),
            ("POST", "/v1/chat/completions"): Endpoint(RouterChat(router), chat_access(router.check_session)),
            ("POST", "/end_session"): Endpoint(self._end_session, SessionAccess(router.check_session, "ending it", _rid_in_body)),
            ("GET", "/sessions/"): Endpoint(self._session, SessionAccess(router.check_session, "reading it", _rid_in_path)),
            ("POST", "/workers"): Endpoint(self._add_worker, needs_bearer(router.credential, "adding a worker")),
            ("POST", "/add_worker"): Endpoint(self._add_worker, needs_bearer(router.credential, "adding a worker")),
            ("POST", "/remove_worker"): Endpoint(self._remove_worker, needs_bearer(router.credential, "removing a worker")),
            ("GET", "/workers"): lambda r: {"workers": [x.describe() for x in list(router.replicas.values())]},
            ("POST", "/publish_adapter"): Endpoint(self._publish, needs_bearer(router.credential, "publishing an adapter")),
            ("GET", "/health"): lambda r: {"status": "ok"},
            ("GET", "/server_info"): lambda r: {"policy": router.policy.name, "newest_ready_version": router.newest_ready_version(),
                                                "replicas": len(router.replicas)},
            ("GET", "/metrics"): lambda r: Text("".join(f"posttrain:{k} {float(v)!r}\n" for k, v in router.metrics().items())),
        }
        super().__init__(routes, host, port, limits=limits)

    def _end_session(self, req: Request) -> Any:
        return {"ended": self.router.end_session(_rid_in_body(req)[0])}

    def _session(self, req: Request) -> Any:
        rid = "/".join(req.params)
        return {"rid": rid, "session_id": rid, "calls": self.router.session_record(rid)}

    def _add_worker(self, req: Request) -> Any:
        body = req.json()
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        url = body.get("url") or (req.query.get("url") or [None])[0]
        if not isinstance(url, str) or not url.startswith("http"):
            raise BadRequest(f"url must be the replica's http:// address, got {url!r}")
        try:
            replica = self.router.add_replica(url, body.get("pool", "on_demand"), body.get("size_gpus", 1))
        except OSError as exc:
            raise HttpError(502, f"url {url}: replica not reachable: {exc}") from exc
        return replica.describe()

    def _remove_worker(self, req: Request) -> Any:
        body = req.json()
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        url = body.get("url") or (req.query.get("url") or [None])[0]
        if not isinstance(url, str):
            raise BadRequest("url must be the replica's address")
        self.router.remove_replica(url)
        return {"removed": url}

    def _publish(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("lora_path must be the adapter's directory on the shared volume")
        return self.router.publish_adapter(name, path)

    def shutdown(self) -> None:
        super().shutdown()
        self.router.close()


def serve_router(router: Router, host: str = "127.0.0.1", port: int = 0, limits: HttpLimits | None = None) -> RouterServer:
    """Serve ``router`` from a background thread; ``limits`` bounds slow or odd clients (``serving.http``)."""
    return RouterServer(router, host, port, limits).start()
