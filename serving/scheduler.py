"""The scheduler's bookkeeping that the local engine and the simulated engine share.

Both run one scheduler thread shaped like SGLang's, over a :class:`~serving.prefix_cache.PrefixCache`
and a KV budget of ``max_total_tokens``:

- **admission** (:meth:`KvScheduler.admit`): the oldest waiting request joins the running ones
  while they are fewer than ``max_running_requests`` and the budget holds its sequence less its
  cached prefix plus a reserve for its output (``admission_reserve_tokens``, at most what it still
  has to generate); cached blocks nobody uses are evicted, least recently used first, to make room.
  A request's first admission records its prefix hit (``cached_tokens``, the cache's hit rate).
- **retraction** (:meth:`KvScheduler.retract_newest`): before a decode step, while the running
  requests' growth does not fit, the newest one is retracted: its blocks unlocked, it goes back to
  the front of the queue and recomputes its prefix when it is admitted again.
- **usage** (:meth:`KvScheduler.used_tokens`): the locked cache blocks plus each running request's
  tokens outside them, SGLang's ``token_usage`` numerator.

What a step computes is each engine's own: the local engine runs the model (prefill, one batched
decode step), the simulated engine sleeps by its service-time model. The caller holds its lock
around every call here.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Generic, Protocol, Sequence, TypeVar

from serving.prefix_cache import Block, PrefixCache
from serving.protocol import GenerateRequest


class Scheduled(Protocol):
    """A request as the scheduler sees it (``_Req`` of :mod:`serving.local_engine.engine`, ``_SimReq`` of
    :mod:`serving.sim`)."""

    request: GenerateRequest
    order: int  # arrival order: the newest is retracted first
    locked: list[Block]  # the cache blocks it holds while running
    cached_tokens: int
    admitted_before: bool

    def prefix_tokens(self) -> Sequence[int]:
        """The tokens whose cached KV it can reuse."""
        ...

    def length(self) -> int:
        """Its sequence so far: the prompt and the tokens generated."""
        ...

    def kv_tokens(self) -> int:
        """The tokens of KV it holds while running."""
        ...


R = TypeVar("R", bound=Scheduled)


class KvScheduler(Generic[R]):
    """The waiting queue, the running requests and their KV accounting (see the module docstring)."""

    def __init__(self, cache: PrefixCache, *, max_total_tokens: int, max_running_requests: int,
                 admission_reserve_tokens: int):
        self.cache = cache
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.admission_reserve_tokens = admission_reserve_tokens
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self._order = itertools.count()
        self.num_retracted_reqs = 0
        self.num_requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0

    def next_order(self) -> int:
        return next(self._order)

    def submit(self, req: R) -> None:
        self.waiting.append(req)
        self.num_requests_total += 1

    def used_tokens(self) -> int:
        bs = self.cache.block_size
        return self.cache.locked_tokens + sum(r.kv_tokens() - len(r.locked) * bs for r in self.running)

    def make_room(self, need_tokens: int) -> bool:
        return self.cache.make_room(need_tokens, self.max_total_tokens, self.used_tokens())

    def admit(self, on_admit: Callable[[R, list[Block], int], None],
              on_unfit: Callable[[R, int], None] | None = None) -> list[R]:
        """Admit waiting requests in order; ``on_admit(req, chain, hit_tokens)`` takes the locked
        cached prefix ``chain`` of each (it sets ``req.locked``). A request that cannot fit even
        with nothing else running and nothing left to evict is handed to ``on_unfit(req,
        need_tokens)`` and dropped from the queue (without ``on_unfit`` admission just waits)."""
        admitted: list[R] = []
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            tokens = req.prefix_tokens()
            # The last token is always recomputed, so the prefix hit is at most len - 1 tokens.
            chain = self.cache.match(req.request.lora_path, tokens, max_tokens=len(tokens) - 1)
            hit = len(chain) * self.cache.block_size
            length = req.length()
            remaining = req.request.sampling_params.max_new_tokens - (length - len(req.request.input_ids))
            need = length - hit + min(remaining, self.admission_reserve_tokens)
            self.cache.lock(chain)  # keep the hit alive while making room
            if not self.make_room(need):
                self.cache.unlock(chain)
                if on_unfit is not None and not self.running and self.cache.evictable_tokens == 0:
                    self.waiting.popleft()
                    on_unfit(req, need)
                    continue
                break
            self.waiting.popleft()
            if not req.admitted_before:
                req.admitted_before = True
                req.cached_tokens = hit
                self.cache.record_lookup(len(tokens), hit)
                self.prompt_tokens_total += len(tokens)
                self.cached_tokens_total += hit
            on_admit(req, chain, hit)
            admitted.append(req)
            self.running.append(req)
        return admitted

    def retract_newest(self, grow_tokens_per_request: int) -> list[R]:
        """Retract the newest running requests while ``grow_tokens_per_request`` more for each does
        not fit the budget (one request always stays); returns them, newest first."""
        retracted: list[R] = []
        while not self.make_room(grow_tokens_per_request * len(self.running)) and len(self.running) > 1:
            victim = max(self.running, key=lambda r: r.order)
            self.running.remove(victim)
            self.cache.unlock(victim.locked)
            victim.locked = []
            self.waiting.appendleft(victim)
            self.num_retracted_reqs += 1
            retracted.append(victim)
        return retracted

    def metrics(self) -> dict[str, float]:
        """The queue and KV figures of ``/metrics`` (SGLang's names)."""
        used = self.used_tokens()
        stats = self.cache.stats
        return {
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting),
            "num_used_tokens": used,
            "token_usage": used / self.max_total_tokens,
            "cache_hit_rate": stats.hit_tokens / stats.lookups_tokens if stats.lookups_tokens else 0.0,
            "num_retracted_reqs": self.num_retracted_reqs,
            "max_total_num_tokens": self.max_total_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "num_requests_total": self.num_requests_total,
        }
