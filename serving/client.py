"""Clients of the engine API (a replica, the capture sidecar, or the router: all speak it).

    from serving.client import EngineClient
    client = EngineClient("http://127.0.0.1:30000")
    out = client.generate([1, 2, 3], {"max_new_tokens": 32, "temperature": 1.0},
                          return_logprob=True, lora_path="v000003", session_id="rollout-17")
    out["output_ids"], out["meta_info"]["output_token_logprobs"]   # [[logprob, token_id, None], ...]
    client.session("rollout-17")   # every captured call of the session, in order

A client holds the trainer credential (``credential``; by default this process's,
:func:`serving.capture_store.trainer_credential`): its calls carry their session's key and its
reads and deletes the credential, as the replicas and the router require.

Connections are kept alive and shared between threads (``http.client``), so a client is cheap to share between
threads and adds well under a millisecond per call on loopback.
"""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any
from urllib.parse import quote, urlsplit

from serving.capture_store import SESSION_KEY_HEADER, session_key, trainer_credential, trainer_headers
from serving.protocol import parse_metrics


class EngineError(RuntimeError):
    """A non-2xx answer; ``status`` is the HTTP status, the message is the server's."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


def error_message(data: bytes) -> str:
    """The message of an engine's error answer, whichever shape it has: posttrain's and SGLang's
    ``{"error": "..."}``, vLLM's ``{"error": {"message": ...}}``, SGLang's ``{"error_message": ...}``,
    ``{"message": ...}`` or FastAPI's ``{"detail": ...}``; else the body as text."""
    text = data.decode(errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text or "(empty answer)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
            return err["message"]
        for key in ("error", "error_message", "message", "detail"):
            if isinstance(body.get(key), str) and body[key]:
                return body[key]
    return text


class HttpPool:
    """Keep-alive HTTP/1.1 connections per host, shared by threads (idle ones are reused LIFO);
    ``headers`` go with every request (a request's own win)."""

    def __init__(self, timeout_s: float = 600.0, *, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def _checkout(self, netloc: str) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(netloc)
            if idle:
                return idle.pop()
        return self._fresh(netloc)

    def _fresh(self, netloc: str) -> http.client.HTTPConnection:
        host, _, port = netloc.partition(":")
        return http.client.HTTPConnection(host, int(port or 80), timeout=self.timeout_s)

    def _checkin(self, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault(netloc, []).append(conn)

    def request(self, method: str, url: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
        """Send one request; returns (status, body, content type). Raises ``OSError`` when the
        server cannot be reached (after one retry on a stale kept-alive connection)."""
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        hdrs.update(self.headers)
        hdrs.update(headers or {})
        for attempt in (0, 1):
            # The retry takes a new connection: the other idle ones may be as stale as the first.
            conn = self._checkout(parts.netloc) if attempt == 0 else self._fresh(parts.netloc)
            try:
                conn.request(method, path or "/", body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.CannotSendRequest,
                    http.client.BadStatusLine, http.client.IncompleteRead) as exc:  # IncompleteRead: died mid-answer
                conn.close()
                # A kept-alive connection the server closed: retry once on a fresh one. A request
                # that reached a dead server fails the same way twice and raises.
                if attempt == 1:
                    raise ConnectionError(f"{url}: {exc!r}") from exc
                continue
            except OSError:
                conn.close()
                raise
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
            else:
                self._checkin(parts.netloc, conn)
            return resp.status, data, resp.getheader("Content-Type", "")
        raise AssertionError("unreachable")

    def json(self, method: str, url: str, payload: Any = None, headers: dict[str, str] | None = None) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        status, data, _ = self.request(method, url, body, headers)
        if status >= 300:
            raise EngineError(status, error_message(data), url)
        return json.loads(data) if data else None


def answers_health(pool: HttpPool, url: str) -> bool:
    """True when ``url``'s ``GET /health`` answers 200 (a server that cannot be reached is not healthy)."""
    try:
        status, _, _ = pool.request("GET", f"{url}/health")
    except OSError:
        return False
    return status == 200


class EngineClient:
    """The engine API of one URL (replica, sidecar or router), with the trainer ``credential``
    (this process's unless given)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, pool: HttpPool | None = None,
                 credential: str | None = None):
        self.url = url.rstrip("/")
        self.pool = pool or HttpPool(timeout_s)
        self.credential = credential if credential is not None else trainer_credential()

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                 return_logprob: bool = False, lora_path: str | None = None, rid: str | None = None,
                 session_id: str | None = None) -> dict[str, Any]:
        """One call. ``session_id`` (``rid`` is its older name) keys the session: the router keeps
        its calls on one replica and version, capture records them together. It is a routing key,
        never an engine's request id: the replica gives each call a unique one. The call carries
        the session's key (``X-Session-Key``)."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if lora_path is not None:
            body["lora_path"] = lora_path
        session_id = session_id if session_id is not None else rid
        headers = {}
        if session_id is not None:
            body["session_id"] = session_id
            headers[SESSION_KEY_HEADER] = self.session_key(session_id)
        return self.pool.json("POST", f"{self.url}/generate", body, headers)

    def session_key(self, session_id: str) -> str:
        """The key of ``session_id`` (``X-Session-Key``): what a scaffold's calls into it carry."""
        return session_key(self.credential, session_id)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        return self.pool.json("POST", f"{self.url}/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)},
                              trainer_headers(self.credential))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self.pool.json("POST", f"{self.url}/unload_lora_adapter", {"lora_name": lora_name},
                              trainer_headers(self.credential))

    def health(self) -> bool:
        return answers_health(self.pool, self.url)

    def server_info(self) -> dict[str, Any]:
        return self.pool.json("GET", f"{self.url}/server_info")

    def metrics(self) -> dict[str, float]:
        status, data, _ = self.pool.request("GET", f"{self.url}/metrics")
        if status != 200:
            raise EngineError(status, data.decode(errors="replace"), self.url)
        return parse_metrics(data.decode())

    def session(self, rid: str) -> list[dict[str, Any]]:
        """The captured calls of session ``rid``, in order (empty when the replica has none)."""
        try:
            return self.pool.json("GET", f"{self.url}/sessions/{quote(rid, safe='')}",
                                  headers=trainer_headers(self.credential))["calls"]
        except EngineError as exc:
            if exc.status == 404:
                return []
            raise

    def sessions(self) -> list[str]:
        """The ids of the sessions a replica holds (the trainer credential's view)."""
        return self.pool.json("GET", f"{self.url}/sessions", headers=trainer_headers(self.credential))["sessions"]

    def drop_session(self, rid: str) -> None:
        self.pool.json("DELETE", f"{self.url}/sessions/{quote(rid, safe='')}", headers=trainer_headers(self.credential))
