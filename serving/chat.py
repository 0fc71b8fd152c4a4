"""``POST /v1/chat/completions`` in a replica: the OpenAI chat API with tools, every call captured.

Agent scaffolds (mini-swe-agent, SWE-agent, OpenHands, usually through LiteLLM) talk to a model
through the OpenAI chat API. The replica's capture front serves it by forwarding the request to the
engine's own chat endpoint, which parses tool calls with its own parser (vLLM:
``--enable-auto-tool-choice --tool-call-parser hermes``), and records the exact tokens of the call::

    routes[("POST", "/v1/chat/completions")] = Endpoint(ChatCompletions(engine_url, self.capture, self.url),
                                                        front_chat_access(self.capture))

or, in a replica's capture front (:class:`serving.capture.CaptureFront`), :func:`chat_completions`.

The front renders the prompt itself and sends its token ids with the call (vLLM takes them in
``kv_transfer_params.prompt_token_ids`` and skips its own templating): the model folder's chat
template writes the turns, its markers are special tokens, and every message's content, tool result,
tool call and tool declaration is encoded as text (:func:`serving.chat_template.render_chat`). An
engine that rendered the text itself would turn a ``<|im_end|>`` printed by the agent's command into
the real end-of-turn token, letting the policy forge turns. An answer whose prompt ids are not the
ones sent is refused (502), never captured as trainable.

What a call records in the replica's :class:`~serving.capture_store.CaptureStore`, under its session:
the prompt's token ids as the engine took them, the front's rendering (``input_ids``), the answer's token ids
(``output_ids``, the end-of-turn token included) and their log-probabilities (``output_logprobs``),
the adapter version (``lora_path``; ``None`` for the base model), the messages and tools as sent,
the prompt as the model reads it (``prompt_text``), the answer's message, the finish reason, and timings (``started_at``, ``latency_s``, and
``first_token_s`` when streamed). ``GET /sessions/{id}`` serves them in order; the trainer builds an
episode's rollout from them (:mod:`training.capture_rollouts`).

The session is the ``X-Session-Id`` header (or a ``session_id`` field in the body); a call into it
carries its key in ``X-Session-Key`` (or the trainer credential), else the route's access
(:func:`chat_access`, checked by the HTTP layer) refuses it (403) and the engine never sees it (:mod:`serving.capture_store`: a session belongs to whoever started it). A
request without a session gets a new one, made by the server; every answer carries its session in
the ``X-Session-Id`` header, and a new session's key in ``X-Session-Key``, so a client can keep using
it. ``model`` is the adapter version to sample from (``step_000012``), or
``base`` (also: empty, or the engine's own name for its base model).

Answers are OpenAI's, streamed as server-sent events when ``stream`` is true (the engine's events
passed on as they come, with the token ids this front asked for removed). The route is an ``async
def`` handler on the server's event loop: the engine's answer, whole or streamed, is awaited on
its connections (:class:`serving.engines.transport.EngineHttp`), so a call holds no worker thread
while the engine works; only the first call's loading of the tokenizer runs on one. The engine is asked for
token ids and log-probabilities on every call; the caller gets log-probabilities only when it asked.
Fields this front does not know (``user``, ``metadata``, penalties) are not forwarded; those that would
make the captured call differ from the answer (``n`` > 1, ``echo``, a caller's own ``chat_template``)
are refused. Bad input is refused before the engine sees it: a :class:`~serving.protocol.BadRequest` naming the
field (``messages[2].tool_calls[0].function.arguments``), which the HTTP layer answers 400.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator

from jinja2 import TemplateError

from serving.capture_store import (SESSION_HEADER, SESSION_KEY_HEADER, CaptureStore, engine_headers, new_session_id,
                                   session_key)
from serving.chat_template import render_chat
from serving.engines.transport import EngineHttp, Streamed
from serving.http import HttpError, Reply, Request, SessionAccess, Stream, check_session_access
from serving.protocol import BadRequest, engine_adapter

BASE_MODEL = "base"
ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,255}$")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")
# Fields that would make the captured call differ from what the caller sees, or give several answers
# per call: refused unless they hold the one value that changes nothing.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "one answer per call (the capture records one completion per call)"),
    "best_of": ((None, 1), "one answer per call"),
    "echo": ((None, False), "the answer is the model's turn only"),
    "continue_final_message": ((None, False), "each call is a new assistant turn"),
    "add_generation_prompt": ((None, True), "each call is a new assistant turn"),
    "chat_template": ((None,), "the model's own chat template renders every call"),
    "chat_template_kwargs": ((None,), "the model's own chat template renders every call"),
    "prompt_logprobs": ((None,), "not captured"),
    "logit_bias": ((None,), "not captured"),
    "functions": ((None,), "use tools"),
    "function_call": ((None,), "use tool_choice"),
}


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat call (see :func:`parse_chat_request`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    model: str  # the adapter version, or BASE_MODEL
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: list[str] | None
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    session_id: str | None

    @property
    def adapter(self) -> str | None:
        return None if self.model == BASE_MODEL else self.model

    def sampling(self) -> dict[str, Any]:
        out = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "seed": self.seed, "stop": self.stop}
        return {k: v for k, v in out.items() if v is not None}

    def engine_body(self, engine_model: str, request_id: str, prompt_ids: list[int]) -> dict[str, Any]:
        """The body sent to the engine's ``/v1/chat/completions``: the prompt's token ids as the front
        rendered them (:func:`serving.chat_template.render_chat`), token ids and logprobs asked for."""
        body: dict[str, Any] = {"model": engine_model, "messages": self.messages, **self.sampling(),
                                "stream": self.stream, "logprobs": True, "top_logprobs": self.top_logprobs,
                                "return_token_ids": True, "return_tokens_as_token_ids": True,
                                "kv_transfer_params": {"prompt_token_ids": list(prompt_ids)},
                                "request_id": request_id}
        if self.tools is not None:
            body["tools"] = self.tools
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def session_id_of(body: Any, headers: dict[str, str] | None) -> str | None:
    """The session of a chat call: the ``X-Session-Id`` header, else the body's ``session_id``."""
    value = (headers or {}).get(SESSION_HEADER.lower())
    where = f"header {SESSION_HEADER}"
    if value is None and isinstance(body, dict) and body.get("session_id") is not None:
        value, where = body["session_id"], "session_id"
    if value is None:
        return None
    if not isinstance(value, str) or not _SESSION_ID.match(value):
        raise BadRequest(f"{where} must be 1-256 characters of letters, digits and ._:/@+=- "
                         f"(starting with a letter or digit), got {str(value)[:80]!r}")
    return value


def _number(body: dict, key: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise BadRequest(f"{key} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _integer(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _text(content: Any, where: str, *, optional: bool) -> str | None:
    """Message content as one string: a string, or a list of text parts (joined)."""
    if content is None:
        if optional:
            return None
        raise BadRequest(f"{where} is required (a string)")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, got {kind!r} "
                                 "(this model reads text only)")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise BadRequest(f"{where} must be an object, got {type(call).__name__}")
    if call.get("type", "function") != "function":
        raise BadRequest(f"{where}.type must be 'function', got {call.get('type')!r}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be an object with name and arguments")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    arguments = fn.get("arguments")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise BadRequest(f"{where}.function.arguments must be a JSON object encoded as a string, got {type(arguments).__name__}")
    try:
        decoded = json.loads(arguments)
    except ValueError as exc:
        raise BadRequest(f"{where}.function.arguments is not valid JSON: {exc}") from None
    if not isinstance(decoded, dict):
        raise BadRequest(f"{where}.function.arguments must encode a JSON object, got {type(decoded).__name__}")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise BadRequest(f"{where}.id must be a string, got {call['id']!r}")
        out["id"] = call["id"]
    return out


def parse_messages(raw: Any) -> list[dict[str, Any]]:
    """Validate ``messages``; returns them with only the keys the chat template reads."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list of message objects")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        clean: dict[str, Any] = {"role": role}
        if role == "assistant":
            clean["content"] = _text(message.get("content"), f"{where}.content", optional=True)
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise BadRequest(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
                if calls:
                    clean["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            if clean["content"] is None and not clean.get("tool_calls"):
                raise BadRequest(f"{where}: an assistant message needs content or tool_calls")
        else:
            clean["content"] = _text(message.get("content"), f"{where}.content", optional=False)
            if "tool_calls" in message and message["tool_calls"]:
                raise BadRequest(f"{where}.tool_calls: only assistant messages carry tool calls")
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise BadRequest(f"{where}.tool_call_id must be a string, got {message['tool_call_id']!r}")
            clean["tool_call_id"] = message["tool_call_id"]
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise BadRequest(f"{where}.name must be a string, got {message['name']!r}")
            clean["name"] = message["name"]
        if role == "system" and i:
            raise BadRequest(f"{where}.role: a system message may only be the first message")
        out.append(clean)
    return out


def parse_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadRequest(f"tools must be a list of tool objects, got {type(raw).__name__}")
    out, names = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}")
        if tool.get("type") != "function":
            raise BadRequest(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be an object with name, description and parameters")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise BadRequest(f"{where}.function.name {name!r} is declared twice")
        names.add(name)
        clean = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise BadRequest(f"{where}.function.description must be a string")
            clean["description"] = fn["description"]
        if fn.get("parameters") is not None:
            params = fn["parameters"]
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise BadRequest(f"{where}.function.parameters must be a JSON Schema object ({{\"type\": \"object\", ...}})")
            clean["parameters"] = params
        out.append({"type": "function", "function": clean})
    return out


def parse_tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> Any:
    if raw is None:
        return None
    names = {t["function"]["name"] for t in tools or []}
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise BadRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got {raw!r}")
        if raw != "none" and not names:
            raise BadRequest(f"tool_choice {raw!r} needs tools")
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in names:
            raise BadRequest(f"tool_choice.function.name {name!r} is not one of the declared tools ({sorted(names)})")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


def parse_chat_request(body: Any, headers: dict[str, str] | None = None) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; a :class:`BadRequest` names the field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for key, (allowed, why) in _REFUSED.items():
        if key in body and not any(body[key] is a or (type(body[key]) is type(a) and body[key] == a) for a in allowed):
            raise BadRequest(f"{key}={json.dumps(body[key])[:40]} is not supported: {why}")
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    model = body.get("model")
    if model in (None, ""):
        model = BASE_MODEL
    if not isinstance(model, str) or not _MODEL_NAME.match(model):
        raise BadRequest(f"model must be an adapter version name or {BASE_MODEL!r}, got {model!r}")
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadRequest("max_tokens and max_completion_tokens differ: give one")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 20) if body.get("max_completion_tokens") is not None \
        else _integer(body, "max_tokens", 1, 1 << 20)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
                             or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    for key in ("stream", "logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"{key} must be a boolean, got {body[key]!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true")
    return ChatRequest(
        messages=messages, tools=tools, tool_choice=tool_choice, model=model, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1), stop=stop, stream=bool(body.get("stream")),
        include_usage=bool((options or {}).get("include_usage")), logprobs=bool(body.get("logprobs")),
        top_logprobs=top_logprobs, session_id=session_id_of(body, headers),
    )


def _engine_error(status: int, data: bytes, url: str) -> Exception:
    """The engine's refusal as this front's: 400 stays a BadRequest, the rest keep their status."""
    try:
        error = json.loads(data).get("error", "")
        message = error.get("message", "") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = data.decode(errors="replace")
    message = message or f"HTTP {status}"
    if status == 400:
        return BadRequest(f"the engine refused the call: {message}")
    return HttpError(status if status < 500 else 502, f"engine {url}: {message}")


def _token_logprobs(entries: list[dict[str, Any]]) -> tuple[list[int | None], list[float]]:
    """Token ids (from ``token_id:N``, as asked with ``return_tokens_as_token_ids``) and logprobs."""
    ids: list[int | None] = []
    lps: list[float] = []
    for entry in entries:
        token = entry.get("token", "")
        ids.append(int(token[9:]) if isinstance(token, str) and token.startswith("token_id:") else None)
        lps.append(float(entry.get("logprob", 0.0)))
    return ids, lps


class ChatCompletions:
    """The ``/v1/chat/completions`` route of a replica's capture front (see the module docstring).

    ``engine_url`` is the engine's own server (vLLM's OpenAI server); ``replica`` is how capture
    records name this replica; ``engine_model`` is the engine's name for the base model and
    ``tokenizer`` the model folder's tokenizer with its chat template (both found from the engine's
    ``/v1/models`` when not given: the base model's ``id`` and the folder it serves, ``root``);
    ``merged_version`` is an adapter version merged into that base model's weights, asked for by name."""

    def __init__(self, engine_url: str, capture: CaptureStore, replica: str, *, engine_model: str | None = None,
                 tokenizer: Any = None, timeout_s: float = 600.0, http: EngineHttp | None = None,
                 merged_version: str | None = None):
        self.engine_url = engine_url.rstrip("/")
        self.merged_version = merged_version  # served by the engine's base model (the front's merged_version)
        self.capture = capture
        self.replica = replica
        self.timeout_s = timeout_s
        # vLLM started by the project refuses its /v1 routes without this key (serving.engines.vllm)
        self.http = http or EngineHttp(timeout_s, headers=engine_headers())
        self._engine_model = engine_model
        self._tokenizer = tokenizer
        self._loading = threading.Lock()  # one load of the model card and the tokenizer, on a worker thread

    def _base_model_card(self) -> dict[str, Any]:
        """The engine's base model in its ``/v1/models`` (blocking: called on a worker thread)."""
        status, data, _ = self.http.run(self.http.request("GET", f"{self.engine_url}/v1/models"))
        if status != 200:
            raise HttpError(502, f"engine {self.engine_url}: /v1/models answered {status}")
        base = [m for m in json.loads(data).get("data", []) if not m.get("parent")]
        if not base:
            raise HttpError(502, f"engine {self.engine_url}: /v1/models lists no base model")
        return base[0]

    def engine_model(self) -> str:
        with self._loading:
            if self._engine_model is None:
                self._engine_model = self._base_model_card()["id"]
            return self._engine_model

    def tokenizer(self) -> Any:
        """The tokenizer that renders every prompt (:func:`serving.chat_template.render_chat`), loaded
        once from the model folder the engine serves."""
        with self._loading:
            if self._tokenizer is None:
                folder = self._base_model_card().get("root")
                if not folder:
                    raise HttpError(502, f"engine {self.engine_url}: /v1/models names no folder (root) for the base "
                                         "model; the chat route renders prompts with the folder's tokenizer")
                from transformers import AutoTokenizer  # seconds to import: only a process that serves chat pays

                try:
                    tokenizer = AutoTokenizer.from_pretrained(folder)
                except Exception as exc:  # a folder this process cannot read: no call can be rendered
                    raise HttpError(502, f"chat route: the tokenizer of {folder} (the engine's base model) does not "
                                         f"load: {type(exc).__name__}: {exc}") from exc
                if not getattr(tokenizer, "chat_template", None):
                    raise HttpError(502, f"chat route: {folder} has no chat template "
                                         "(serving.chat_template.install_chat_template writes one)")
                self._tokenizer = tokenizer
            return self._tokenizer

    async def _loaded(self, adapter: str | None) -> str:
        """The engine's name for the model to sample (``adapter``, or its base model); the first call
        loads the model card and the tokenizer (seconds) on a worker thread, never on the loop."""
        if self._tokenizer is None or (adapter is None and self._engine_model is None):
            await asyncio.to_thread(lambda: (self.tokenizer(), self.engine_model() if adapter is None else None))
        return self._engine_model if adapter is None else adapter  # type: ignore[return-value]

    def render(self, chat: ChatRequest) -> tuple[list[int], str]:
        """The call's prompt as token ids and as text (:func:`serving.chat_template.render_chat`)."""
        tokenizer = self._tokenizer if self._tokenizer is not None else self.tokenizer()  # loaded: no lock on the loop
        try:
            return render_chat(tokenizer, chat.messages, chat.tools)
        except TemplateError as exc:
            raise BadRequest(f"messages: the model's chat template refused them: {exc}") from None

    def _check_prompt(self, engine_ids: Any, prompt_ids: list[int]) -> None:
        if list(engine_ids or []) != prompt_ids:
            raise HttpError(502, f"engine {self.engine_url}: its prompt ({len(engine_ids or [])} tokens) is not the "
                                 f"{len(prompt_ids)} token ids the front rendered (an engine that re-renders the chat "
                                 "as text would let message contents become control tokens)")

    async def __call__(self, req: Request) -> Reply | Stream:
        """The route's handler, on the server's event loop: the engine's answer (or its stream) is
        awaited on its connections (:class:`serving.engines.transport.EngineHttp`), no worker
        thread held while the engine works. Rendering the prompt (the front's own work, as parsing
        the body is) runs there too."""
        body = req.json()
        chat = parse_chat_request(body, req.headers)
        session_id, headers = self.open_session(chat.session_id, req.headers)
        adapter = engine_adapter(chat.adapter, self.merged_version, "model")
        engine_model = await self._loaded(adapter)
        request_id = f"{session_id}-{uuid.uuid4().hex[:12]}"  # unique per call: engines require it
        prompt_ids, prompt_text = self.render(chat)
        payload = json.dumps(chat.engine_body(engine_model, request_id, prompt_ids)).encode()
        record = {
            "rid": session_id, "session_id": session_id, "kind": "chat", "request_id": request_id,
            "lora_path": chat.adapter, "weight_version": chat.model, "messages": chat.messages, "tools": chat.tools,
            "tool_choice": chat.tool_choice, "sampling_params": chat.sampling(), "stream": chat.stream,
            "started_at": time.time(), "replica": self.replica, "prompt_text": prompt_text,
        }
        if chat.stream:
            return Stream(await self._stream(chat, payload, record, prompt_ids), headers=headers)
        t0 = time.perf_counter()
        try:
            status, data, _ = await self.http.request("POST", f"{self.engine_url}/v1/chat/completions", payload)
        except OSError as exc:
            raise HttpError(502, f"engine {self.engine_url} unreachable: {exc}") from exc
        if status >= 300:
            raise _engine_error(status, data, self.engine_url)
        answer = json.loads(data)
        self._check_prompt(answer.get("prompt_token_ids"), prompt_ids)
        choice = answer["choices"][0]
        output_ids = list(choice.get("token_ids") or [])
        lp_ids, lps = _token_logprobs((choice.get("logprobs") or {}).get("content") or [])
        record.update(self._outcome(answer.get("prompt_token_ids") or [], output_ids, lp_ids, lps,
                                    choice.get("message") or {}, choice.get("finish_reason"), answer.get("usage")))
        record["latency_s"] = time.perf_counter() - t0
        record["complete"] = True
        self.capture.record(record)
        return Reply(self._for_client(answer, chat), headers)

    def open_session(self, session_id: str | None, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The call's session and the answer's headers: a call that names none gets a new anonymous
        session and its key (a named session's key was checked by the route's access, :func:`chat_access`)."""
        if session_id is None:
            session_id = new_session_id()
            return session_id, {SESSION_HEADER: session_id, SESSION_KEY_HEADER: session_key(self.capture.credential, session_id)}
        return session_id, {SESSION_HEADER: session_id}

    @staticmethod
    def _outcome(prompt_ids: list[int], output_ids: list[int], lp_ids: list[int | None], lps: list[float],
                 message: dict[str, Any], finish_reason: Any, usage: Any) -> dict[str, Any]:
        # The logprobs name their tokens: they must be the output's, one each, in order.
        consistent = bool(prompt_ids) and lp_ids == output_ids
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return {
            "input_ids": list(prompt_ids), "output_ids": list(output_ids), "output_logprobs": lps,
            "consistent": consistent, "finish_reason": finish_reason, "cached_tokens": cached,
            "response": {"content": message.get("content"), "tool_calls": message.get("tool_calls") or []},
        }

    @staticmethod
    def _for_client(answer: dict[str, Any], chat: ChatRequest) -> dict[str, Any]:
        """The engine's answer without what this front asked for on its own behalf."""
        answer = dict(answer)
        answer["model"] = chat.model
        for key in ("prompt_token_ids", "prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params"):
            answer.pop(key, None)
        choices = []
        for choice in answer.get("choices", []):
            choice = {k: v for k, v in choice.items() if k not in ("token_ids", "routed_experts")}
            if not chat.logprobs:
                choice["logprobs"] = None
            choices.append(choice)
        answer["choices"] = choices
        return answer

    async def _stream(self, chat: ChatRequest, payload: bytes, record: dict[str, Any],
                      sent_ids: list[int]) -> AsyncIterator[bytes]:
        """Open the engine's stream; its server-sent events are passed on as they come (:meth:`_relay`),
        collecting the call's tokens. A refusal or an engine out of reach is this call's error answer."""
        t0 = time.perf_counter()
        try:
            answer = await self.http.stream("POST", f"{self.engine_url}/v1/chat/completions", payload)
        except OSError as exc:
            raise HttpError(502, f"engine {self.engine_url} unreachable: {exc}") from exc
        if answer.status >= 300:
            try:
                data = await answer.read()
            except OSError as exc:
                raise HttpError(502, f"engine {self.engine_url}: its refusal (HTTP {answer.status}) was cut: {exc}") from exc
            finally:
                answer.close()
            raise _engine_error(answer.status, data, self.engine_url)
        return self._relay(answer, chat, record, t0, sent_ids)

    async def _relay(self, answer: Streamed, chat: ChatRequest, record: dict[str, Any], t0: float,
                     sent_ids: list[int]) -> AsyncIterator[bytes]:
        prompt_ids: list[int] = []
        output_ids: list[int] = []
        lp_ids: list[int | None] = []
        lps: list[float] = []
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish_reason, usage, first_token_s, done = None, None, None, False
        try:
            async for line in _lines(answer.pieces()):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    yield b"data: [DONE]\n\n"
                    break
                event = json.loads(data)
                if event.get("prompt_token_ids"):
                    prompt_ids = list(event["prompt_token_ids"])
                    self._check_prompt(prompt_ids, sent_ids)  # the first event: cut before any piece is sent
                if event.get("usage"):
                    usage = event["usage"]
                out_choices = []
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first_token_s is None:
                        first_token_s = time.perf_counter() - t0
                    output_ids.extend(ids)
                    got_ids, got_lps = _token_logprobs((choice.get("logprobs") or {}).get("content") or [])
                    lp_ids.extend(got_ids)
                    lps.extend(got_lps)
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        content.append(delta["content"])
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(int(tc.get("index", 0)), {"type": "function", "function": {"name": "", "arguments": ""}})
                        if tc.get("id"):
                            slot["id"] = tc["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
                    choice = {k: v for k, v in choice.items() if k not in ("token_ids", "routed_experts")}
                    if not chat.logprobs:
                        choice.pop("logprobs", None)
                    if choice.get("delta") or choice.get("finish_reason") or choice.get("logprobs"):
                        out_choices.append(choice)
                if not out_choices and not (event.get("usage") and chat.include_usage and not event.get("choices")):
                    continue  # an event that only carried token ids for this front
                event = {k: v for k, v in event.items() if k not in ("prompt_token_ids", "prompt_text")}
                event["choices"] = out_choices
                event["model"] = chat.model
                if not chat.include_usage:
                    event.pop("usage", None)
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
        finally:
            answer.close()
            message = {"content": "".join(content) or None, "tool_calls": [calls[i] for i in sorted(calls)]}
            record.update(self._outcome(prompt_ids, output_ids, lp_ids, lps, message, finish_reason, usage))
            record["latency_s"] = time.perf_counter() - t0
            record["first_token_s"] = first_token_s
            record["complete"] = done  # a stream cut short is kept for inspection, never trained on
            self.capture.record(record)


async def _lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a body that arrives in pieces, each with its ``\\n`` (the last one without, if unended)."""
    rest = b""
    async for piece in pieces:
        rest += piece
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


_HANDLERS: "weakref.WeakKeyDictionary[Any, ChatCompletions]" = weakref.WeakKeyDictionary()
_HANDLERS_LOCK = threading.Lock()


def chat_access(verify) -> SessionAccess:
    """The access of a ``/v1/chat/completions`` route: a call that names its session (``X-Session-Id``
    or ``session_id``) needs the session's key or the trainer credential, checked by ``verify``
    (the capture store's check, or the router's) before the handler runs; one that names none is
    given a new session by the handler."""

    def named(req: Request) -> list[str]:
        session_id = parse_chat_request(req.json(), req.headers).session_id
        return [] if session_id is None else [session_id]

    return SessionAccess(verify, "a call into it", named)


def front_chat_access(capture: CaptureStore) -> SessionAccess:
    """:func:`chat_access` for a capture front's store (a full session takes no more calls: 429)."""
    return chat_access(functools.partial(check_session_access, capture, appending=True))


async def chat_completions(front: Any, req: Request) -> Reply | Stream:
    """The route as a replica's capture front mounts it: ``front.engine.url`` is the engine's own
    server, ``front.capture`` its capture store, ``front.url`` the replica's name in the records,
    ``front.merged_version`` the adapter version merged into the engine's weights (None: none)."""
    with _HANDLERS_LOCK:
        handler = _HANDLERS.get(front)
        if handler is None:
            handler = _HANDLERS[front] = ChatCompletions(front.engine.url, front.capture, front.url,
                                                         merged_version=front.merged_version)
    return await handler(req)
