"""The chat route awaits its engine on the server's event loop (issue 53): a ``/v1/chat/completions``
call, answered whole or streamed, holds no worker thread while the engine works, so calls beyond
the worker threads' number are in the engine at once; each is captured with the engine's token ids
and logprobs, and an engine that refuses or is out of reach is answered as before. Real servers on
127.0.0.1, real HTTP; the engine is a small OpenAI-chat server in this test (vLLM's own is
tests/serving/test_chat.py's, minutes to start), the tokenizer a real tiny one with the project's
chat template."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest

from serving.http import Endpoint, HttpError, HttpLimits, JsonServer, Stream
from serving.capture_store import CaptureStore, SESSION_HEADER
from serving.chat import ChatCompletions, front_chat_access
from serving.chat_template import CHAT_TEMPLATE, render_chat
from serving.tiny import build_tiny_tokenizer

AT_ONCE = 3
OUTPUT = [(41, -0.5), (42, -0.25), (43, -0.125)]  # the engine's answer: token ids and their logprobs


class MeetingChatEngine:
    """An OpenAI chat endpoint that answers no call until ``AT_ONCE`` calls are in (a wait that
    breaks: 504), echoing the prompt ids it was sent; streamed calls get their head at once and
    their events once all have met."""

    def __init__(self, at_once: int):
        self.at_once, self.arrived, self.met = at_once, 0, None
        self.server = JsonServer({("POST", "/v1/chat/completions"): self.completions}).start()

    async def _meet(self) -> None:
        self.met = self.met or asyncio.Event()
        self.arrived += 1
        if self.arrived >= self.at_once:
            self.met.set()
        try:
            await asyncio.wait_for(self.met.wait(), 20)
        except TimeoutError:
            raise HttpError(504, f"{self.arrived} of {self.at_once} calls met") from None

    async def completions(self, req):
        body = req.json()
        prompt = body["kv_transfer_params"]["prompt_token_ids"]
        logprobs = {"content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in OUTPUT]}
        if not body.get("stream"):
            await self._meet()
            return {"id": body["request_id"], "object": "chat.completion", "model": body["model"],
                    "prompt_token_ids": prompt,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"},
                                 "token_ids": [t for t, _ in OUTPUT], "logprobs": logprobs, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(OUTPUT)}}

        async def events():
            await self._meet()
            yield _event({"prompt_token_ids": prompt, "choices": []})
            for t, lp in OUTPUT:
                yield _event({"choices": [{"index": 0, "delta": {"content": f"<{t}>"}, "token_ids": [t],
                                           "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}]}}]})
            yield _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            yield b"data: [DONE]\n\n"

        return Stream(events())


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _front(engine_url: str, tokenizer) -> tuple[JsonServer, CaptureStore]:
    """The chat route alone on a server with one worker thread, as a capture front mounts it."""
    store = CaptureStore()
    handler = ChatCompletions(engine_url, store, "replica-under-test", engine_model="tiny", tokenizer=tokenizer)
    route = Endpoint(handler, front_chat_access(store))
    return JsonServer({("POST", "/v1/chat/completions"): route}, limits=HttpLimits(max_workers=1)).start(), store


def _chat(port: int, i: int, stream: bool) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "base", "messages": [{"role": "user", "content": f"call {i}"}], "stream": stream}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _at_once(port: int, stream: bool) -> list[tuple[int, dict[str, str], bytes]]:
    answers: list = [None] * AT_ONCE
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _chat(port, i, stream))) for i in range(AT_ONCE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_calls_beyond_the_worker_threads_are_in_the_engine_at_once_and_captured(tokenizer, stream):
    """One worker thread: a route that held it while the engine worked would keep the other calls
    out of the engine (which answers none until all are in: 504, a 502 here). Awaited, all meet."""
    engine = MeetingChatEngine(AT_ONCE)
    front, store = _front(engine.server.url, tokenizer)
    try:
        for i, (status, headers, data) in enumerate(_at_once(front.port, stream)):
            assert status == 200, data[:300]
            [record] = store.session(headers[SESSION_HEADER.lower()])
            assert record["complete"] and record["output_ids"] == [t for t, _ in OUTPUT]
            assert record["output_logprobs"] == [lp for _, lp in OUTPUT] and record["consistent"]
            # the prompt as the front rendered it, and the engine echoed it
            assert record["input_ids"] == render_chat(tokenizer, [{"role": "user", "content": f"call {i}"}], None)[0]
            if stream:
                events = [line for line in data.split(b"\n\n") if line]
                assert events[-1] == b"data: [DONE]" and b"token_ids" not in data and b"prompt_token_ids" not in data
                assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-2]) \
                    == "".join(f"<{t}>" for t, _ in OUTPUT)
            else:
                answer = json.loads(data)
                assert answer["choices"][0]["message"]["content"] == "done" and "token_ids" not in answer["choices"][0]
    finally:
        front.shutdown()
        engine.server.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_refusal_or_absence_is_the_calls_answer(tokenizer, stream):
    refusing = JsonServer({("POST", "/v1/chat/completions"): lambda r: (_ for _ in ()).throw(
        HttpError(400, "max_tokens is too large"))}).start()
    front, _ = _front(refusing.url, tokenizer)
    gone, _ = _front("http://127.0.0.1:9", tokenizer)  # nothing listens on port 9 (discard) here
    try:
        status, _, data = _chat(front.port, 0, stream)
        assert status == 400 and json.loads(data) == {"error": "the engine refused the call: max_tokens is too large"}
        status, _, data = _chat(gone.port, 0, stream)
        assert status == 502 and json.loads(data)["error"].startswith("engine http://127.0.0.1:9 unreachable: ")
    finally:
        for server in (front, gone, refusing):
            server.shutdown()
