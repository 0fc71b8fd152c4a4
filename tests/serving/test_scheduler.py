"""The scheduler bookkeeping the local and simulated engines share: admission against the running
cap and the KV budget, retraction of the newest request, and a request's prefix hit counted at its
first admission only (plain records over a real prefix cache; no model)."""

from dataclasses import dataclass, field

from serving.prefix_cache import Block, PrefixCache
from serving.protocol import GenerateRequest, SamplingParams
from serving.scheduler import KvScheduler


@dataclass(eq=False)
class _Rec:
    request: GenerateRequest
    order: int
    produced: int = 0
    locked: list[Block] = field(default_factory=list)
    cached_tokens: int = 0
    admitted_before: bool = False

    def prefix_tokens(self):
        return self.request.input_ids

    def length(self):
        return len(self.request.input_ids) + self.produced

    def kv_tokens(self):
        return self.length()


def _scheduler(budget, cap, reserve=4):
    return KvScheduler(PrefixCache(block_size=4), max_total_tokens=budget, max_running_requests=cap,
                       admission_reserve_tokens=reserve)


def _submit(sched, prompt, max_new_tokens=10):
    rec = _Rec(GenerateRequest(list(prompt), SamplingParams(max_new_tokens=max_new_tokens)), sched.next_order())
    sched.submit(rec)
    return rec


def _lock_chain(rec, chain, hit):
    rec.locked = chain


def test_admission_fills_the_running_cap_in_one_pass_then_the_budget_stops_it():
    sched = _scheduler(budget=1000, cap=3)
    recs = [_submit(sched, range(i * 10, i * 10 + 8)) for i in range(4)]
    # Each running request counts once against the cap: three of four join at once.
    assert sched.admit(_lock_chain) == recs[:3]
    assert list(sched.waiting) == recs[3:] and sched.num_requests_total == 4

    tight = _scheduler(budget=26, cap=8)
    recs = [_submit(tight, range(i * 10, i * 10 + 8)) for i in range(3)]
    # Each needs its 8 prompt tokens plus a 4-token reserve: the second's 8 + 12 fits 26, the third's 16 + 12 does not.
    assert tight.admit(_lock_chain) == recs[:2]
    assert tight.used_tokens() == 16 and tight.metrics()["num_queue_reqs"] == 1


def test_a_request_that_never_fits_is_handed_over_only_when_nothing_else_holds_the_budget():
    sched = _scheduler(budget=16, cap=4)
    big = _submit(sched, range(20), max_new_tokens=1)
    unfit = []
    assert sched.admit(_lock_chain) == [] and list(sched.waiting) == [big]  # without on_unfit it waits
    assert sched.admit(_lock_chain, lambda rec, need: unfit.append((rec, need))) == []
    assert unfit == [(big, 21)] and not sched.waiting


def test_retraction_takes_the_newest_and_its_readmission_counts_its_prefix_once():
    sched = _scheduler(budget=48, cap=4)
    shared = list(range(16))
    old = _submit(sched, shared)
    sched.admit(lambda rec, chain, hit: setattr(rec, "locked", sched.cache.insert(None, shared, have=chain)))
    sched.cache.lock(old.locked)
    new = _submit(sched, shared + [99, 98, 97, 96])
    assert sched.admit(_lock_chain) == [new] and new.cached_tokens == 16  # old's four blocks
    assert sched.prompt_tokens_total == 36 and sched.cached_tokens_total == 16
    old.produced = new.produced = 6
    # Running: old's 16 locked + 6 of its own, new's 26 with 16 of them in old's blocks: 32 used of 48.
    assert sched.used_tokens() == 32
    assert sched.retract_newest(8) == []  # 16 more fit exactly
    assert sched.retract_newest(9) == [new]  # 18 more do not: the newest goes back to the queue's front
    assert list(sched.waiting) == [new] and new.locked == [] and sched.num_retracted_reqs == 1
    assert sched.used_tokens() == 22  # old's blocks stay locked by old
    assert sched.admit(_lock_chain) == [new]  # again with its prefix hit; its 6 tokens are recomputed
    assert sched.prompt_tokens_total == 36 and sched.cached_tokens_total == 16 and new.cached_tokens == 16
