"""How the router places sessions: the policies and the records they reason over.

A policy is a small object (:class:`Policy`): ``choose`` picks the replica of a new session (or of a
session whose replica died), ``rehome`` may move a live session before its next call. It reads the
router's state through :class:`RouterView` (the router itself; tests pass a plain record) and never
calls out. Policies (``python -m serving.router --policy``):

- ``kv_headroom`` (ours): sample K replicas (weighted by GPU count), read each one's KV headroom
  (from its ``/metrics``, corrected by the tokens routed since), subtract the projected growth of its
  live sessions (each session's context grows by about the same amount every turn, for as many more
  turns as sessions that long have lasted: learned from the sessions that ended), subtract the new
  session's own projected footprint (less the prompt prefix it shares with a GRPO sibling already
  there; a sibling's replica is preferred while the projection fits) and pick the most room (once
  enough sessions have ended for the projection to be trusted: the fewest live sessions per GPU
  among the replicas where it fits). Big replicas have more KV, so absolute room already weighs
  replica size. When a replica's live sessions have outgrown it anyway (sessions longer than
  projected), a session whose cached context has most likely been evicted there (the replica's LRU
  order, from the sessions' last calls) is moved, on its next call, to a replica with projected
  room: it recomputes its prefix once instead of every turn.
- ``round_robin`` and ``least_loaded`` (fewest in-flight calls), for comparison.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(eq=False)
class Replica:
    """A replica as the router tracks it: pool and size, KV budget and usage (polled from its
    ``/metrics``, plus the tokens routed to it since), load, adapter versions and live sessions."""

    url: str
    pool: str = "on_demand"
    size_gpus: int = 1
    max_total_tokens: int = 0
    polled_used_tokens: float = 0.0
    routed_since_poll_tokens: int = 0
    running_reqs: float = 0.0
    queued_reqs: float = 0.0
    adapters: set[str] = field(default_factory=set)
    healthy: bool = True
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)
    failures: int = 0

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url, "pool": self.pool, "size_gpus": self.size_gpus, "healthy": self.healthy,
            "max_total_tokens": self.max_total_tokens, "used_tokens": self.polled_used_tokens,
            "in_flight": self.in_flight, "live_sessions": len(self.sessions), "adapters": sorted(self.adapters),
        }


@dataclass(eq=False)
class Session:
    """A live session (the ``rid`` of its calls): its replica, adapter version and GRPO group key,
    and how its context has grown per call."""

    rid: str
    replica: Replica
    adapter: str | None
    group_key: int
    prompt_tokens: int = 0  # the first call's input: the part a GRPO sibling on the same replica shares
    context_tokens: int = 0
    growth_per_turn_tokens: float = 0.0
    turns: int = 0
    last_call_s: float = field(default_factory=time.monotonic)
    replicas_seen: list[str] = field(default_factory=list)


class SessionLengths:
    """Calls per ended session (the last ``window`` of them), and from them how many more calls a
    live session that has made ``t`` is expected to make: the mean of ``n - t`` over ended sessions
    with ``n > t``, or None while fewer than ``min_samples`` such sessions were seen."""

    def __init__(self, window: int = 4096, min_samples: int = 16):
        self.window = window
        self.min_samples = min_samples
        self._turns: deque[int] = deque(maxlen=window)
        self._remaining: list[float | None] | None = None

    def __len__(self) -> int:
        return len(self._turns)

    def add(self, turns: int) -> None:
        if turns > 0:
            self._turns.append(turns)
            self._remaining = None

    def mean_remaining(self, turns_done: int) -> float | None:
        if len(self._turns) < self.min_samples:
            return None
        if self._remaining is None:  # suffix counts and sums over the session lengths, rebuilt after an end
            top = max(self._turns)
            count, total = [0] * (top + 2), [0] * (top + 2)
            for n in self._turns:
                count[n] += 1
                total[n] += n
            table: list[float | None] = [None] * (top + 1)
            longer, longer_sum = 0, 0
            for t in range(top, -1, -1):
                longer, longer_sum = longer + count[t + 1], longer_sum + total[t + 1]
                table[t] = longer_sum / longer - t if longer >= self.min_samples else None
            self._remaining = table
        return self._remaining[turns_done] if turns_done < len(self._remaining) else None


class RouterView(Protocol):
    """What a policy reads of the router: live sessions by ``rid``, how many sessions of each GRPO
    group (``group_key``) each replica holds, the lengths of ended sessions, and the mean growth of
    a session's context per turn (0 before any was seen)."""

    sessions: dict[str, Session]
    group_replicas: dict[int, dict[Replica, int]]
    session_lengths: SessionLengths
    mean_growth_per_turn_tokens: float


class Policy(Protocol):
    """Picks a replica for a new session (``turns_done`` > 0: a live session whose replica died);
    ``rehome`` may move a live session before its next call (None: it stays)."""

    name: str

    def choose(self, candidates: list[Replica], prompt_tokens: int, group_key: int | None, router: RouterView,
               turns_done: int = 0) -> Replica: ...

    def rehome(self, session: Session, candidates: list[Replica], router: RouterView) -> Replica | None: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def choose(self, candidates, prompt_tokens, group_key, router, turns_done=0):
        return candidates[next(self._counter) % len(candidates)]

    def rehome(self, session, candidates, router):
        return None


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates, prompt_tokens, group_key, router, turns_done=0):
        return min(candidates, key=lambda r: (r.in_flight + r.queued_reqs, len(r.sessions)))

    def rehome(self, session, candidates, router):
        return None


class KvHeadroom:
    """See the module docstring. ``lookahead_turns``: the turns of growth reserved for a session
    before any session of its length has ended (a session that has made ``t`` calls is then expected
    to make ``max(t, lookahead_turns)`` more); ``expected_growth_tokens``: the growth per turn assumed
    before any session has been seen growing. A live session is moved when the tokens its replica
    has most likely evicted, times its expected remaining calls plus this one, exceed its context:
    staying would recompute them every call (its replica is overfull), moving recomputes the context
    once."""

    name = "kv_headroom"

    def __init__(self, sample_k: int = 4, lookahead_turns: float = 8.0, expected_growth_tokens: float = 256.0,
                 seed: int = 0):
        self.sample_k = sample_k
        self.lookahead_turns = lookahead_turns
        self.expected_growth_tokens = expected_growth_tokens
        self._rng = random.Random(seed)

    def _expected_growth(self, router: RouterView) -> float:
        # Learned across the fleet once sessions have been seen growing; the default before that.
        return getattr(router, "mean_growth_per_turn_tokens", 0.0) or self.expected_growth_tokens

    def remaining_turns(self, turns_done: int, router: RouterView) -> float:
        lengths: SessionLengths | None = getattr(router, "session_lengths", None)
        learned = lengths.mean_remaining(turns_done) if lengths is not None else None
        if learned is not None:
            return learned
        if lengths is not None and len(lengths) >= lengths.min_samples:
            return self.lookahead_turns  # longer than nearly every session that ended: near its end
        return max(self.lookahead_turns, float(turns_done))

    def projected_room_tokens(self, replica: Replica, router: RouterView) -> float:
        live = [router.sessions[rid] for rid in replica.sessions if rid in router.sessions]
        context = sum(s.context_tokens for s in live)
        used = max(replica.polled_used_tokens + replica.routed_since_poll_tokens, context)
        default = self._expected_growth(router)
        growth = sum((s.growth_per_turn_tokens or default) * self.remaining_turns(getattr(s, "turns", 0), router)
                     for s in live)
        return replica.max_total_tokens - used - growth

    def _sample(self, candidates: list[Replica]) -> list[Replica]:
        if len(candidates) <= self.sample_k:
            return list(candidates)
        sample = []
        pool, w = list(candidates), [r.size_gpus for r in candidates]
        for _ in range(self.sample_k):
            i = self._rng.choices(range(len(pool)), weights=w)[0]
            sample.append(pool.pop(i))
            w.pop(i)
        return sample

    def _room_after(self, candidates, prompt_tokens, group_key, router, turns_done):
        sample = self._sample(candidates)
        siblings = router.group_replicas.get(group_key, {}) if group_key is not None else {}
        for replica in candidates:
            if replica in siblings and replica not in sample:
                sample.append(replica)
        footprint = prompt_tokens + self._expected_growth(router) * self.remaining_turns(turns_done, router)
        room = {r: self.projected_room_tokens(r, router) - (footprint - (prompt_tokens if r in siblings else 0))
                for r in sample}
        return sample, siblings, room

    def choose(self, candidates, prompt_tokens, group_key, router, turns_done=0):
        sample, siblings, room = self._room_after(candidates, prompt_tokens, group_key, router, turns_done)
        # A GRPO sibling's replica already holds the prompt: go there while the projection fits.
        fitting_siblings = [r for r in sample if r in siblings and room[r] >= 0]
        if fitting_siblings:
            return max(fitting_siblings, key=lambda r: room[r])
        # Otherwise, once session lengths are learned (the projection can be trusted), the fewest
        # live sessions per GPU where it fits (every running session waits on its replica's decode
        # steps), then the most room. Before that, or where it fits nowhere: the most room.
        lengths = getattr(router, "session_lengths", None)
        fitting = [r for r in sample if room[r] >= 0]
        if fitting and lengths is not None and len(lengths) >= lengths.min_samples:
            return min(fitting, key=lambda r: ((len(r.sessions) + 1) / r.size_gpus, -room[r]))
        return self._most_room(sample, room)

    @staticmethod
    def _most_room(sample: list[Replica], room: dict[Replica, float]) -> Replica:
        return max(sample, key=lambda r: (room[r], -len(r.sessions) / r.size_gpus))

    def evicted_tokens(self, session: Session, router: RouterView) -> float:
        """How much of ``session``'s context its replica has most likely evicted: the replica's LRU
        cache keeps the sessions used since this one's last call first (a GRPO group's prompt once)."""
        replica = session.replica
        newer, groups = 0, {session.group_key}
        for rid in replica.sessions:
            other = router.sessions.get(rid)
            if other is None or other is session or other.last_call_s < session.last_call_s:
                continue
            shared = other.prompt_tokens if other.group_key in groups else 0
            groups.add(other.group_key)
            newer += other.context_tokens - shared
        return max(0.0, newer + session.context_tokens - replica.max_total_tokens)

    def rehome(self, session, candidates, router):
        if not session.turns or not session.replica.max_total_tokens:
            return None
        evicted = self.evicted_tokens(session, router)
        if evicted * (1.0 + self.remaining_turns(session.turns, router)) <= session.context_tokens:
            return None
        others = [r for r in candidates if r is not session.replica]
        if not others:
            return None
        # Its prefix is recomputed wherever it goes: no sibling credit, the whole context is the prompt.
        sample, _, room = self._room_after(others, session.context_tokens, None, router, session.turns)
        best = self._most_room(sample, room)
        return best if room[best] >= 0 else None


POLICIES = {"kv_headroom": KvHeadroom, "round_robin": RoundRobin, "least_loaded": LeastLoaded}
