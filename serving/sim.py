"""A simulated engine: the engine HTTP API, real KV-cache accounting, a service-time model, no model.

It exists so the router can be measured against a fleet of 64+ replicas and thousands of sessions
on a laptop (``bench/router.py``). Each replica runs the local engine's scheduler
(:mod:`serving.scheduler`, shaped like SGLang's): admit waiting requests while the KV budget allows
(a block prefix cache with LRU eviction gives the hits), prefill the uncached tokens, decode every
running request together, and retract the newest request when the running ones outgrow the budget.
Time is spent by sleeping:

    prefill_s = uncached_tokens * prefill_s_per_token / size_gpus
    decode step (decode_chunk_tokens for every running request) =
        decode_step_s + running_reqs * decode_s_per_req / size_gpus

Output tokens are pseudo-random ids (a hash of the sequence), logprobs are 0.0: nothing is computed.
A call is queued for the scheduler thread and either awaited (``agenerate``: the engine server's
``/generate``, on its event loop) or waited for (``generate``); the thread wakes whichever waits.
Run a fleet of them in one process:

    python -m serving.sim --replicas 56x1 --replicas 8x8 --max-total-tokens-per-gpu 16384
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from serving.http import serve
from serving.prefix_cache import Block, PrefixCache
from serving.protocol import BadRequest, Completion, GenerateRequest, finish_reason
from serving.scheduler import KvScheduler


@dataclass
class ServiceModel:
    prefill_s_per_token: float = 20e-6
    decode_step_s: float = 0.010
    decode_s_per_req: float = 0.0004
    decode_chunk_tokens: int = 8


@dataclass(eq=False)
class _SimReq:
    request: GenerateRequest
    order: int
    seq_len: int
    output_ids: list[int]
    produced: int = 0
    locked: list[Block] = field(default_factory=list)
    cached_tokens: int = 0
    admitted_before: bool = False
    done: Completion = field(default_factory=Completion)
    arrived_s: float = field(default_factory=time.perf_counter)

    # What the scheduler reads (serving.scheduler.Scheduled): the prompt's cached KV is reused; the
    # tokens produced before a retraction are recomputed.
    def prefix_tokens(self) -> list[int]:
        return self.request.input_ids

    def length(self) -> int:
        return self.seq_len + self.produced

    def kv_tokens(self) -> int:
        return self.seq_len + self.produced


class SimEngine:
    def __init__(self, *, size_gpus: int = 1, max_total_tokens: int = 16384, max_running_requests: int = 64,
                 block_size: int = 16, service: ServiceModel | None = None, admission_reserve_tokens: int = 32,
                 name: str = "sim"):
        self.size_gpus = size_gpus
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests * size_gpus
        self.service = service or ServiceModel()
        self.name = name
        self.cache = PrefixCache(block_size)
        self.scheduler: KvScheduler[_SimReq] = KvScheduler(
            self.cache, max_total_tokens=max_total_tokens, max_running_requests=self.max_running_requests,
            admission_reserve_tokens=admission_reserve_tokens)
        self._adapters: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"sim-{name}", daemon=True)
        self._thread.start()

    # --- the InProcessEngine protocol -------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> dict[str, Any]:
        req = self._submit(request)
        req.done.wait()
        return self._answer(req)

    async def agenerate(self, request: GenerateRequest) -> dict[str, Any]:
        """:meth:`generate` awaited on the caller's event loop: the scheduler thread wakes it."""
        req = self._submit(request)
        await req.done
        return self._answer(req)

    def _submit(self, request: GenerateRequest) -> _SimReq:
        if request.lora_path is not None and request.lora_path not in self._adapters:
            raise BadRequest(f"lora_path {request.lora_path!r} is not loaded (loaded: {sorted(self._adapters)})")
        need = len(request.input_ids) + request.sampling_params.max_new_tokens
        if need > self.max_total_tokens:
            raise BadRequest(f"input_ids plus max_new_tokens is {need} tokens; the KV budget is {self.max_total_tokens}")
        n = request.sampling_params.max_new_tokens
        seed = hash((tuple(request.input_ids[-8:]), n)) & 0xFFFFFFFFFFFF
        output_ids = [(seed >> (i % 40)) % 1000 + 10 for i in range(n)]
        with self._lock:
            req = _SimReq(request, self.scheduler.next_order(), len(request.input_ids), output_ids)
            self.scheduler.submit(req)
            self._wake.notify()
        return req

    @staticmethod
    def _answer(req: _SimReq) -> dict[str, Any]:
        request, output_ids = req.request, req.output_ids
        n = len(output_ids)
        meta = {
            "id": request.rid, "prompt_tokens": len(request.input_ids), "completion_tokens": n,
            "cached_tokens": req.cached_tokens, "finish_reason": finish_reason("length", n),
            "weight_version": request.lora_path or "base", "lora_path": request.lora_path,
            "e2e_latency": time.perf_counter() - req.arrived_s,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[0.0, t, None] for t in output_ids]
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    def load_lora_adapter(self, name: str, path: str) -> None:
        with self._lock:
            self._adapters[name] = path

    def unload_lora_adapter(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise BadRequest(f"lora_name {name!r} is not loaded")
            self.cache.drop_adapter(name)

    def adapters(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def server_info(self) -> dict[str, Any]:
        return {"engine": "posttrain-sim (no model compute)", "max_total_num_tokens": self.max_total_tokens,
                "max_running_requests": self.max_running_requests, "size_gpus": self.size_gpus,
                "loaded_adapters": self.adapters(), "page_size": self.cache.block_size}

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self.scheduler.metrics()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()

    # --- the scheduler thread (admission, retraction and KV accounting: serving.scheduler) -----

    def _loop(self) -> None:
        svc = self.service
        sched = self.scheduler
        while True:
            with self._lock:
                while not sched.waiting and not sched.running and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                prefill_tokens = 0

                def prefill(req: _SimReq, chain: list[Block], hit: int) -> None:
                    nonlocal prefill_tokens
                    req.locked = self.cache.insert(req.request.lora_path, req.request.input_ids, have=chain)
                    self.cache.lock(req.locked[len(chain):])
                    prefill_tokens += req.length() - hit

                sched.admit(prefill)
                batch = len(sched.running)
            step_s = prefill_tokens * svc.prefill_s_per_token / self.size_gpus
            if batch:
                step_s += svc.decode_step_s + batch * svc.decode_s_per_req / self.size_gpus
            if step_s:  # a step that takes no time (a service model of zeros) costs no sleep call
                time.sleep(step_s)
            with self._lock:
                grow = svc.decode_chunk_tokens
                sched.retract_newest(grow)
                finished = []
                for req in sched.running:
                    step = min(grow, req.request.sampling_params.max_new_tokens - req.produced)
                    req.produced += step
                    sched.generation_tokens_total += step
                    if req.produced >= req.request.sampling_params.max_new_tokens:
                        finished.append(req)
                for req in finished:
                    sched.running.remove(req)
                    # The generated tokens' KV stays cached, as in SGLang: the next turn hits it.
                    self.cache.insert(req.request.lora_path, req.request.input_ids + req.output_ids, have=req.locked)
                    self.cache.unlock(req.locked)
                    req.locked = []
                    req.done.set()


def parse_replica_spec(spec: str) -> tuple[int, int]:
    """``COUNTxGPUS`` -> (count, gpus)."""
    count, _, gpus = spec.partition("x")
    try:
        return int(count), int(gpus or 1)
    except ValueError:
        raise ValueError(f"--replicas must look like COUNTxGPUS (e.g. 56x1), got {spec!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.sim", description="a fleet of simulated engines in one process")
    parser.add_argument("--replicas", action="append", default=[], help="COUNTxGPUS, repeatable (default 4x1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-total-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--decode-step-ms", type=float, default=10.0)
    parser.add_argument("--prefill-us-per-token", type=float, default=20.0)
    args = parser.parse_args(argv)
    service = ServiceModel(prefill_s_per_token=args.prefill_us_per_token * 1e-6, decode_step_s=args.decode_step_ms / 1e3)
    servers = []
    for spec in args.replicas or ["4x1"]:
        count, gpus = parse_replica_spec(spec)
        for _ in range(count):
            engine = SimEngine(size_gpus=gpus, max_total_tokens=args.max_total_tokens_per_gpu * gpus, service=service)
            servers.append((serve(engine, host=args.host, port=0), gpus))
    for server, gpus in servers:
        print(f"{server.url} {gpus}", flush=True)
    print("ready", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
