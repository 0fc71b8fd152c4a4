"""The engine server awaits its in-process engine on the server's event loop (issue 53): a
``/generate`` call holds no worker thread while the engine works, so calls beyond the worker
threads' number are in the engine at once, and each is still captured exactly. An engine whose
call blocks (a ``generate`` of its own) is still called on a worker. Real servers on 127.0.0.1,
real HTTP, the real simulated engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sandboxes.httpserver import HttpLimits
from serving.client import EngineClient
from serving.http import serve
from serving.protocol import Completion, awaited_generate
from serving.sim import ServiceModel, SimEngine
from tests.serving.conftest import sessions_at_once

AT_ONCE = 4
NO_SERVICE_TIME = ServiceModel(prefill_s_per_token=0.0, decode_step_s=0.0, decode_s_per_req=0.0)


class MeetingEngine(SimEngine):
    """A simulated engine whose calls each wait until ``AT_ONCE`` calls are in the engine at once,
    in both forms of the call; a wait that breaks (calls that never meet) fails the call (500)."""

    def __init__(self):
        super().__init__(service=NO_SERVICE_TIME)
        self.together = threading.Barrier(AT_ONCE, timeout=10)
        self.arrived = 0
        self.met: asyncio.Event | None = None
        self.threads: set[str] = set()

    def generate(self, request):
        self.threads.add(threading.current_thread().name)
        self.together.wait()  # on a worker thread each: BrokenBarrierError when they never meet
        return super().generate(request)

    async def agenerate(self, request):
        self.threads.add(threading.current_thread().name)
        self.met = self.met or asyncio.Event()
        self.arrived += 1
        if self.arrived == AT_ONCE:
            self.met.set()
        await asyncio.wait_for(self.met.wait(), 20)
        return await super().agenerate(request)


def test_calls_beyond_the_worker_threads_are_in_the_engine_at_once_and_captured():
    """One worker thread: a server that called the engine on it would hold every other call back
    while the first waits for them (a broken wait: 500). Awaited on the loop, all meet."""
    engine = MeetingEngine()
    server = serve(engine, limits=HttpLimits(max_workers=1))
    client = EngineClient(server.url)
    try:
        answers = sessions_at_once(client, AT_ONCE, lambda i: [5, 6, i])
        assert len(engine.threads) == 1 and not any("worker" in name for name in engine.threads), engine.threads
        for sid, answer in answers.items():
            [record] = client.session(sid)
            assert record["output_ids"] == answer["output_ids"] and len(answer["output_ids"]) == 3
            assert record["output_logprobs"] == [0.0, 0.0, 0.0] and record["input_ids"] == [5, 6, int(sid[1:])]
            assert "output_token_logprobs" not in answer["meta_info"]  # not asked for: captured, not answered
    finally:
        server.shutdown()


def test_a_batch_is_awaited_at_once_and_answered_in_order():
    engine = MeetingEngine()
    server = serve(engine, limits=HttpLimits(max_workers=1))
    alone = SimEngine(service=NO_SERVICE_TIME)
    try:
        prompts = [[9, 9, i] for i in range(AT_ONCE)]
        body = EngineClient(server.url).pool.json("POST", f"{server.url}/generate",
                                                  {"input_ids": prompts, "sampling_params": {"max_new_tokens": 2}})
        assert isinstance(body, list) and len(body) == AT_ONCE
        for prompt, answer in zip(prompts, body):  # the simulated ids are a function of the prompt
            assert answer["output_ids"] == alone.generate(parse(prompt))["output_ids"]
    finally:
        alone.close()
        server.shutdown()


def parse(prompt: list[int]):
    from serving.protocol import parse_generate

    return parse_generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})[0]


def test_an_engine_with_a_blocking_call_of_its_own_is_called_on_a_worker():
    """A subclass that overrides only ``generate`` changed what a call does: the awaitable call it
    inherits would skip that, so the server calls ``generate``, on a worker thread."""

    class Blocking(SimEngine):
        def generate(self, request):
            answer = super().generate(request)
            answer["meta_info"]["thread"] = threading.current_thread().name
            return answer

    plain, blocking = SimEngine(service=NO_SERVICE_TIME), Blocking(service=NO_SERVICE_TIME)
    assert awaited_generate(plain) == plain.agenerate and awaited_generate(blocking) is None
    plain.close()
    server = serve(blocking)
    try:
        answer = EngineClient(server.url).generate([1, 2], {"max_new_tokens": 1})
        assert "worker" in answer["meta_info"]["thread"]
    finally:
        server.shutdown()


def test_a_completion_wakes_a_blocked_thread_and_an_awaiting_loop_once():
    done = Completion()
    woke: list[str] = []
    waiter = threading.Thread(target=lambda: woke.append("thread") if done.wait(20) else None)
    waiter.start()

    async def awaiting() -> None:
        setter = threading.Thread(target=lambda: (done.set(), done.set()))  # a second set changes nothing
        task = asyncio.ensure_future(_await(done))
        await asyncio.sleep(0)  # the awaiting task is registered before the set
        setter.start()
        await asyncio.wait_for(task, 20)
        woke.append("loop")
        await asyncio.wait_for(_await(done), 20)  # already set: no wait
        setter.join()

    asyncio.run(awaiting())
    waiter.join()
    assert sorted(woke) == ["loop", "thread"] and done.is_set()


async def _await(done: Completion) -> None:
    await done


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
