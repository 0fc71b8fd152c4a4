"""The capture front awaits its engine on the server's event loop (issue 53): a call through it
holds no worker thread, its connections to the engine are closed when it shuts down, and an engine
that fails, refuses or does not answer is answered as the blocking client answered it. The exact
token ids and logprobs the engine gave are what the front records. Real servers on 127.0.0.1,
real HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

from sandboxes.httpserver import HttpLimits
from serving.capture import serve_front, serve_sidecar, upstream_engine
from serving.client import EngineClient
from serving.engines.local import LocalEngineClient
from serving.http import serve
from serving.protocol import GenerateRequest, SamplingParams
from serving.sim import ServiceModel, SimEngine
from tests.serving.conftest import sessions_at_once

AT_ONCE = 4
# Logprobs that only survive a round trip unchanged if nothing on the way rounds or recomputes them.
LOGPROBS = [-0.12345678901234567, -2.718281828459045, -1e-12]


class HeldEngine(SimEngine):
    """A simulated engine whose calls each wait until ``parties`` calls are in the engine at once
    (a broken wait answers 500), and answer with :data:`LOGPROBS`; a prompt starting with 666 fails."""

    def __init__(self, parties: int):
        super().__init__(service=ServiceModel(prefill_s_per_token=0.0, decode_step_s=0.0, decode_s_per_req=0.0))
        self.together = threading.Barrier(parties, timeout=20)

    def generate(self, request):
        if request.input_ids[0] == 666:
            raise RuntimeError("the engine broke")
        if self.together.parties > 1:
            self.together.wait()  # BrokenBarrierError (a 500) when the calls never meet
        answer = super().generate(request)
        answer["meta_info"]["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(LOGPROBS, answer["output_ids"])]
        return answer


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_calls_through_the_front_are_in_the_engine_at_once_with_one_worker_thread():
    """With one handler thread, a front that blocked a worker per engine call would hold every other
    call back until the first ended (and the engine here answers none until all are in): awaited on
    the loop, all reach the engine together. Each session records the engine's ids and logprobs exactly."""
    engine = serve(HeldEngine(AT_ONCE))
    front = serve_sidecar(engine.url, limits=HttpLimits(max_workers=1))
    client = EngineClient(front.url)
    try:
        answers = sessions_at_once(client, AT_ONCE, lambda i: [5, 6, 7, i], return_logprob=True)
        for sid, answer in answers.items():
            [record] = client.session(sid)
            assert record["output_ids"] == answer["output_ids"] and len(record["output_ids"]) == 3
            assert record["output_logprobs"] == LOGPROBS  # exactly: floats compared with ==
            assert answer["meta_info"]["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(LOGPROBS, record["output_ids"])]
            assert record["input_ids"] == [5, 6, 7, int(sid[1:])] and record["engine"] == "local"
    finally:
        front.shutdown()
        engine.shutdown()


def test_a_batch_is_in_the_engine_at_once_and_answered_in_order():
    engine = serve(HeldEngine(AT_ONCE))
    front = serve_sidecar(engine.url, limits=HttpLimits(max_workers=1))
    try:
        prompts = [[9, 9, i] for i in range(AT_ONCE)]
        status, body = _post(front.port, "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and isinstance(body, list) and len(body) == AT_ONCE
        alone = HeldEngine(1)  # the same simulated ids, without the wait: answers in the batch's order
        try:
            for prompt, answer in zip(prompts, body):
                expected = alone.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=2), False, None, None))
                assert answer["output_ids"] == expected["output_ids"]
        finally:
            alone.close()
    finally:
        front.shutdown()
        engine.shutdown()


def test_the_front_keeps_its_engine_connections_alive_and_closes_them_on_shutdown():
    engine = serve(HeldEngine(1))
    front = serve_sidecar(engine.url)
    client = EngineClient(front.url)
    try:
        for i in range(5):  # one after another: one kept-alive connection to the engine, reused
            client.generate([1, 2, i], {"max_new_tokens": 1})
        assert engine.open_connections() == 1
        threads = [threading.Thread(target=client.generate, args=([1, 2, i], {"max_new_tokens": 1})) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert client.health()
        assert engine.open_connections() >= 1  # the front's kept-alive connections
        front.shutdown()
        # The engine notices the closes as they arrive; well inside its own 60 s idle timeout.
        deadline = time.monotonic() + 15
        while engine.open_connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.open_connections() == 0
    finally:
        front.shutdown()
        engine.shutdown()


def test_engine_failures_are_answered_as_the_blocking_client_answered_them():
    engine = serve(HeldEngine(1))
    front = serve_sidecar(engine.url)
    down = serve_sidecar("http://127.0.0.1:9")  # nothing listens on port 9 (discard) here
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    mute = serve_front(LocalEngineClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=1.0))
    call = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    try:
        # the engine refuses the request (400): the caller's error, with the engine's message
        status, body = _post(front.port, "/generate", {**call, "lora_path": "v404"})
        assert status == 400 and body == {"error": "lora_path 'v404' is not loaded (loaded: [])"}
        # the engine fails (500): an engine error naming it
        status, body = _post(front.port, "/generate", {**call, "input_ids": [666, 1]})
        assert status == 500 and body == {"error": f"EngineError: {engine.url}: HTTP 500: RuntimeError: the engine broke"}
        # no engine: the socket's error, as the socket words it
        status, body = _post(down.port, "/generate", call)
        assert status == 500 and body == {"error": "ConnectionRefusedError: [Errno 111] Connection refused"}
        status, body = http_get(down.port, "/health")
        assert status == 503 and body == {"error": "engine local at http://127.0.0.1:9 is not healthy"}
        # an engine that never answers: the client's timeout
        status, body = _post(mute.port, "/generate", call)
        assert status == 500 and body == {"error": "TimeoutError: timed out"}
    finally:
        for server in (front, down, mute, engine):
            server.shutdown()
        silent.close()


def http_get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_the_blocking_call_runs_the_awaited_one_and_is_refused_on_a_loop():
    """One implementation: ``generate`` is ``agenerate`` run for a caller without a loop; on a
    running loop the blocking form is refused with what to call instead (it would stop the loop)."""
    engine = serve(HeldEngine(1))
    client = upstream_engine("local", engine.url)  # the front's client of it, with the trainer credential
    params = SamplingParams(max_new_tokens=3)
    try:
        blocking = client.generate([4, 5, 6], params, adapter=None, request_id="b")

        async def awaited():
            try:
                gen = await client.agenerate([4, 5, 6], params, adapter=None, request_id="a")
                with pytest.raises(RuntimeError, match="await the a-prefixed method"):
                    client.generate([4, 5, 6], params, adapter=None, request_id="c")
                return gen
            finally:
                await client.http.aclose()

        assert asyncio.run(awaited()).output_ids == blocking.output_ids
        assert blocking.output_logprobs == LOGPROBS and client.health()
    finally:
        client.close()
        engine.shutdown()


def test_a_header_value_that_would_end_the_head_is_refused_naming_it():
    from serving.engines.transport import EngineHttp

    http = EngineHttp(headers={"X-Session-Key": "abc\r\nAuthorization: Bearer forged"})
    with pytest.raises(ValueError, match="header 'X-Session-Key': a line break or NUL"):
        http.json("GET", "http://127.0.0.1:9/health")
    http.close()
