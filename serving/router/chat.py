"""The router's ``POST /v1/chat/completions``: OpenAI chat calls, sticky per session.

    routes[("POST", "/v1/chat/completions")] = Endpoint(RouterChat(router), chat_access(router.check_session))

A chat session is its ``X-Session-Id`` header (or the body's ``session_id``), and a call into it
carries the session's key (``X-Session-Key``) or the trainer credential, else the route's access
(:func:`serving.chat.chat_access`) refuses it (403) before it is placed; a call without a session gets a new one, returned with its key in the answer's
``X-Session-Id`` and ``X-Session-Key``. The router passes the key on to the replica. The session's
first call picks a replica with the router's policy and an adapter version (``model``: a version
name, ``latest``, or ``base``); every later call of the session goes to the same replica with the
same version, so the replica's capture holds the whole session (``GET /sessions/{id}`` on the router collects it). The call is validated here first
(:func:`serving.chat.parse_chat_request`: 400 naming the field) and forwarded to the replica's own
``/v1/chat/completions`` (:mod:`serving.chat`), streamed answers passed on as they come. A replica that
cannot be reached is marked dead and the call goes to another one (the session moves with it).

The router places a chat call without token ids: a session's first message text stands in for its
prompt prefix (sessions of one task start alike and land together, for the prefix cache) and its
length in bytes over four for its prompt tokens.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any, Iterator
from urllib.parse import urlsplit

from serving.capture_store import ANONYMOUS_PREFIX, SESSION_KEY_HEADER, session_key
from serving.chat import BASE_MODEL, SESSION_HEADER, ChatRequest, new_session_id, parse_chat_request
from serving.http import HttpError, Reply, Request, Stream
from serving.protocol import BadRequest
from serving.router.core import LATEST, Router
from serving.router.policy import Session

BYTES_PER_TOKEN = 4


def prompt_hint(chat: ChatRequest) -> list[int]:
    """What stands in for a chat call's prompt ids when it is placed (see the module docstring)."""
    text = json.dumps([chat.tools, chat.messages], ensure_ascii=False).encode()
    return list(text[:max(1, len(text) // BYTES_PER_TOKEN)])


class RouterChat:
    """The route handler (see the module docstring)."""

    def __init__(self, router: Router):
        self.router = router

    def session(self, session_id: str, chat: ChatRequest) -> Session:
        """The session's state, placing it on a replica at its first call."""
        router = self.router
        wanted = None if chat.model == BASE_MODEL else chat.model
        with router.lock:
            session = router.sessions.get(session_id)
        if session is not None:
            if wanted not in (LATEST, session.adapter):
                raise BadRequest(f"model {chat.model!r} differs from session {session_id!r}'s adapter version "
                                 f"{session.adapter or BASE_MODEL!r}")
            router._maybe_rehome(session)
            return session
        adapter = router._resolve_adapter(wanted)
        hint = prompt_hint(chat)
        replica = router._place(session_id, hint, adapter)
        session = Session(session_id, replica, adapter, router._group_key(hint, adapter), prompt_tokens=len(hint))
        with router.lock:
            existing = router.sessions.get(session_id)
            if existing is not None:  # another call of the session placed it meanwhile
                return existing
            router._attach(session, replica)
            router.sessions[session_id] = session
        if session_id.startswith(ANONYMOUS_PREFIX):
            router.note_anonymous(session_id)
        return session

    def _move(self, session: Session, hint: list[int]) -> None:
        router = self.router
        new = router._place(session.rid, hint, session.adapter, avoid=session.replica, turns_done=session.turns)
        with router.lock:
            router._detach(session)
            router._attach(session, new)
            router.moved_sessions += 1

    def _done(self, session: Session, usage: dict[str, Any] | None) -> None:
        with self.router.lock:
            if usage:
                session.context_tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
            session.turns += 1
            session.last_call_s = time.monotonic()

    def __call__(self, req: Request) -> Reply | Stream:
        body = req.json()
        chat = parse_chat_request(body, req.headers)
        router = self.router
        if chat.session_id is None:
            session_id = new_session_id()
            reply_headers = {SESSION_HEADER: session_id, SESSION_KEY_HEADER: session_key(router.credential, session_id)}
        else:  # its key was checked by the route's access (serving.chat.chat_access)
            session_id = chat.session_id
            reply_headers = {SESSION_HEADER: session_id}
        session = self.session(session_id, chat)
        payload = {k: v for k, v in body.items() if k != "session_id"}
        payload["model"] = session.adapter or BASE_MODEL
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", **router.replica_headers(session_id), SESSION_HEADER: session_id}
        attempts = 0
        while True:
            replica = session.replica
            if not replica.healthy:
                self._move(session, prompt_hint(chat))
                continue
            with router.lock:
                session.last_call_s = time.monotonic()
                replica.in_flight += 1
            try:
                if chat.stream:
                    return self._stream(replica.url, data, headers, session, reply_headers)
                status, answer, _ = router.pool.request("POST", f"{replica.url}/v1/chat/completions", data, headers)
            except OSError:
                router._mark_dead(replica)
                attempts += 1
                if attempts > router.max_retries:
                    raise HttpError(503, f"chat call of session {session_id!r} failed on {attempts} replicas") from None
                with router.lock:
                    router.retried_calls += 1
                continue
            finally:
                with router.lock:
                    replica.in_flight -= 1
            break
        if status >= 300:
            try:
                message = json.loads(answer).get("error", "")
            except (ValueError, AttributeError):
                message = answer.decode(errors="replace")
            raise BadRequest(message) if status == 400 else HttpError(status, message)
        result = json.loads(answer)
        self._done(session, result.get("usage"))
        return Reply(result, reply_headers)

    def _stream(self, url: str, data: bytes, headers: dict[str, str], session: Session,
                reply_headers: dict[str, str]) -> Stream:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.router.pool.timeout_s)
        try:
            conn.request("POST", "/v1/chat/completions", body=data, headers=headers)
            resp = conn.getresponse()
        except OSError:
            conn.close()
            raise
        if resp.status >= 300:
            answer = resp.read()
            conn.close()
            try:
                message = json.loads(answer).get("error", "")
            except (ValueError, AttributeError):
                message = answer.decode(errors="replace")
            raise BadRequest(message) if resp.status == 400 else HttpError(resp.status, message)
        return Stream(self._relay(conn, resp, session), headers=reply_headers)

    def _relay(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, session: Session) -> Iterator[bytes]:
        usage = None
        try:
            event: list[bytes] = []
            while True:
                line = resp.readline()
                if not line:
                    break
                event.append(line)
                if line.strip():
                    if line.startswith(b"data:") and b'"usage"' in line:
                        try:
                            usage = json.loads(line[5:]).get("usage") or usage
                        except ValueError:
                            pass
                    continue
                yield b"".join(event)  # one whole event (up to its blank line) at a time
                event = []
            if event:
                yield b"".join(event)
        finally:
            conn.close()
            self._done(session, usage)
