"""The router: an HTTP service in front of the replicas, sticky per session.

Run it locally (127.0.0.1 by default):

    python -m serving.router --port 30100 --policy kv_headroom \
        --worker http://127.0.0.1:30000 --worker http://127.0.0.1:30001@reserved:8 \
        [--adapters-volume RUN_DIR/adapters]

or in-process: ``router = Router(policy="kv_headroom"); server = serve_router(router, port=0)``.

A session is the ``rid`` of its calls. Its first call picks a replica and an adapter version; every
later call goes to the same replica with the same version, until the session ends
(``POST /end_session``) or idles out. Policies (``--policy``):

- ``kv_headroom`` (ours): sample K replicas (weighted by GPU count), read each one's KV headroom
  (from its ``/metrics``, corrected by the tokens routed since), subtract the projected growth of its
  live sessions (each session's context grows by about the same amount every turn, for as many more
  turns as sessions that long have lasted: learned from the sessions that ended), subtract the new
  session's own projected footprint (less the prompt prefix it shares with a GRPO sibling already
  there; a sibling's replica is preferred while the projection fits) and pick the most room (once
  enough sessions have ended for the projection to be trusted: the fewest live sessions per GPU
  among the replicas where it fits). Big replicas have more KV, so absolute room already weighs
  replica size. When a replica's live
  sessions have outgrown it anyway (sessions longer than projected), a session whose cached context
  has most likely been evicted there (the replica's LRU order, from the sessions' last calls) is
  moved, on its next call, to a replica with projected room: it recomputes its prefix once instead
  of every turn.
- ``round_robin`` and ``least_loaded`` (fewest in-flight calls), for comparison.

``lora_path: "latest"`` asks for the newest adapter version that one replica in each pool
(reserved, on-demand) serves; the session keeps that version for its whole life. A replica that
fails a call is marked dead; its sessions move to other replicas and the failed call is retried
there (the prefix is recomputed). ``add_replica`` loads the newest adapter before the replica takes
traffic. Endpoints: the engine API (``/generate``, ``/health``, ``/metrics``, ``/sessions/{rid}``),
plus ``POST /end_session {rid}``, ``POST /workers {url, pool, size_gpus}``,
``POST /remove_worker {url}``, ``GET /workers``, ``POST /publish_adapter {lora_name, lora_path}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from serving.adapters import newest_adapter, newest_version, version_sort_key
from serving.client import EngineError, HttpPool
from serving.http import HttpError, HttpLimits, JsonServer, Request, Text
from serving.protocol import BadRequest, parse_adapter_name, parse_generate, parse_metrics

POOLS = ("reserved", "on_demand")
LATEST = "latest"


@dataclass(eq=False)
class Replica:
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


class Policy:
    """Picks a replica for a new session: ``choose(candidates, prompt_tokens, group_key, router)``;
    ``rehome(session, candidates, router)`` may move a live session before its next call (None: stay)."""

    name = "policy"

    def choose(self, candidates: list[Replica], prompt_tokens: int, group_key: int | None, router: "Router",
               turns_done: int = 0) -> Replica:
        raise NotImplementedError

    def rehome(self, session: Session, candidates: list[Replica], router: "Router") -> Replica | None:
        return None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def choose(self, candidates, prompt_tokens, group_key, router, turns_done=0):
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, candidates, prompt_tokens, group_key, router, turns_done=0):
        return min(candidates, key=lambda r: (r.in_flight + r.queued_reqs, len(r.sessions)))


class KvHeadroom(Policy):
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

    def _expected_growth(self, router: "Router") -> float:
        # Learned across the fleet once sessions have been seen growing; the default before that.
        return getattr(router, "mean_growth_per_turn_tokens", 0.0) or self.expected_growth_tokens

    def remaining_turns(self, turns_done: int, router: "Router") -> float:
        lengths: SessionLengths | None = getattr(router, "session_lengths", None)
        learned = lengths.mean_remaining(turns_done) if lengths is not None else None
        if learned is not None:
            return learned
        if lengths is not None and len(lengths) >= lengths.min_samples:
            return self.lookahead_turns  # longer than nearly every session that ended: near its end
        return max(self.lookahead_turns, float(turns_done))

    def projected_room_tokens(self, replica: Replica, router: "Router") -> float:
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

    def evicted_tokens(self, session: Session, router: "Router") -> float:
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


class Router:
    def __init__(self, policy: str | Policy = "kv_headroom", *, adapters_volume: str | None = None,
                 poll_interval_s: float = 0.5, session_idle_s: float = 600.0, max_retries: int = 3,
                 affinity_tokens: int = 64, timeout_s: float = 600.0):
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
            policy = POLICIES[policy]()
        self.policy = policy
        self.adapters_volume = adapters_volume
        self.poll_interval_s = poll_interval_s
        self.session_idle_s = session_idle_s
        self.max_retries = max_retries
        self.affinity_tokens = affinity_tokens
        self.pool = HttpPool(timeout_s)
        self.replicas: dict[str, Replica] = {}
        self.sessions: dict[str, Session] = {}
        self.group_replicas: dict[int, dict[Replica, int]] = {}
        self.published: dict[str, str] = {}  # adapter version -> path on the shared volume
        self.pending: dict[str, tuple[str, int]] = {}  # replicas not reachable yet: url -> (pool, size)
        self.lock = threading.RLock()
        self.overhead_s: deque[float] = deque(maxlen=100_000)
        self.mean_growth_per_turn_tokens = 0.0  # EWMA over every session's turns
        self.session_lengths = SessionLengths()  # calls per ended session
        self.rehomed_sessions = 0
        self.retried_calls = 0
        self.moved_sessions = 0
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="router-poll", daemon=True)
        self._poller.start()

    # --- fleet membership ------------------------------------------------------------------

    def add_replica(self, url: str, pool: str = "on_demand", size_gpus: int = 1) -> Replica:
        """Register a replica; it first loads the newest published adapter (from the shared volume)
        and only then takes traffic."""
        if pool not in POOLS:
            raise BadRequest(f"pool must be one of {POOLS}, got {pool!r}")
        if isinstance(size_gpus, bool) or not isinstance(size_gpus, int) or size_gpus < 1:
            raise BadRequest(f"size_gpus must be a positive integer, got {size_gpus!r}")
        url = url.rstrip("/")
        info = self.pool.json("GET", f"{url}/server_info")
        replica = Replica(url, pool, size_gpus, max_total_tokens=int(info.get("max_total_num_tokens", 0)),
                          adapters=set(info.get("loaded_adapters", [])))
        newest = self._newest_published()
        if newest is not None and newest[0] not in replica.adapters:
            self.pool.json("POST", f"{url}/load_lora_adapter", {"lora_name": newest[0], "lora_path": newest[1]})
            replica.adapters.add(newest[0])
        self._poll(replica)
        with self.lock:
            self.replicas[url] = replica
        return replica

    def add_replica_when_up(self, url: str, pool: str = "on_demand", size_gpus: int = 1) -> None:
        """Register a replica that may not be up yet (pods start in any order): it joins, loading
        the newest adapter first, once it answers."""
        try:
            self.add_replica(url, pool, size_gpus)
        except (OSError, EngineError):
            with self.lock:
                self.pending[url.rstrip("/")] = (pool, size_gpus)

    def remove_replica(self, url: str) -> None:
        with self.lock:
            replica = self.replicas.pop(url.rstrip("/"), None)
            if replica is None:
                raise BadRequest(f"url {url!r} is not a registered worker")
            replica.healthy = False

    def _newest_published(self) -> tuple[str, str] | None:
        with self.lock:
            candidates = dict(self.published)
        if self.adapters_volume:
            found = newest_adapter(self.adapters_volume)
            if found:
                candidates.setdefault(found[0], found[1])
        version = newest_version(candidates)
        return (version, candidates[version]) if version else None

    def publish_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Record a new adapter version and load it on every healthy replica that lacks it
        (replicas that got it by sharded HTTP push already have it)."""
        with self.lock:
            self.published[lora_name] = lora_path
            targets = [r for r in self.replicas.values() if r.healthy]
        loaded = []
        for replica in targets:
            try:
                info = self.pool.json("GET", f"{replica.url}/server_info")
                if lora_name not in info.get("loaded_adapters", []):
                    self.pool.json("POST", f"{replica.url}/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})
                with self.lock:
                    replica.adapters.add(lora_name)
                loaded.append(replica.url)
            except OSError:
                self._mark_dead(replica)
        return {"lora_name": lora_name, "replicas": loaded, "newest_ready": self.newest_ready_version()}

    def newest_ready_version(self) -> str | None:
        """The newest version served by at least one healthy replica in each pool that has any."""
        with self.lock:
            healthy = [r for r in self.replicas.values() if r.healthy]
            pools = {r.pool for r in healthy}
            versions = set().union(*(r.adapters for r in healthy)) if healthy else set()
            ready = [v for v in versions if all(any(v in r.adapters for r in healthy if r.pool == p) for p in pools)]
        return max(ready, key=version_sort_key) if ready else None

    # --- metrics polling and failure detection -------------------------------------------------

    def _poll(self, replica: Replica) -> None:
        status, data, _ = self.pool.request("GET", f"{replica.url}/metrics")
        if status != 200:
            raise EngineError(status, data.decode(errors="replace"), replica.url)
        m = parse_metrics(data.decode())
        with self.lock:
            if m.get("max_total_num_tokens"):
                replica.max_total_tokens = int(m["max_total_num_tokens"])
            replica.polled_used_tokens = m.get("token_usage", 0.0) * replica.max_total_tokens
            replica.running_reqs = m.get("num_running_reqs", 0.0)
            replica.queued_reqs = m.get("num_queue_reqs", 0.0)
            replica.routed_since_poll_tokens = 0

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            with self.lock:
                replicas = [r for r in self.replicas.values() if r.healthy]
            for replica in replicas:
                try:
                    self._poll(replica)
                    replica.failures = 0
                except (OSError, EngineError, ValueError):
                    replica.failures += 1
                    if replica.failures >= 2:
                        self._mark_dead(replica)
            self._expire_sessions()
            with self.lock:
                pending = list(self.pending.items())
            for url, (pool, size) in pending:
                try:
                    self.add_replica(url, pool, size)
                except (OSError, EngineError):
                    continue
                with self.lock:
                    self.pending.pop(url, None)

    def _mark_dead(self, replica: Replica) -> None:
        with self.lock:
            replica.healthy = False

    def _expire_sessions(self) -> None:
        cutoff = time.monotonic() - self.session_idle_s
        with self.lock:
            for rid in [rid for rid, s in self.sessions.items() if s.last_call_s < cutoff]:
                self._end_session(rid)

    # --- sessions -------------------------------------------------------------------------

    def _group_key(self, input_ids: list[int], adapter: str | None) -> int:
        return hash((adapter, tuple(input_ids[:self.affinity_tokens])))

    def _resolve_adapter(self, lora_path: str | None) -> str | None:
        if lora_path != LATEST:
            return lora_path
        version = self.newest_ready_version()
        if version is None:
            raise BadRequest("lora_path 'latest': no adapter version is served by a replica of every pool yet")
        return version

    def _candidates(self, adapter: str | None, avoid: Replica | None = None) -> tuple[list[Replica], tuple[str, str] | None]:
        """Healthy replicas serving ``adapter``; when none does, every healthy one and the published
        version to load on the chosen one."""
        healthy = [r for r in self.replicas.values() if r.healthy and r is not avoid]
        if not healthy:
            raise HttpError(503, "no healthy replica")
        candidates = [r for r in healthy if adapter is None or adapter in r.adapters]
        if candidates:
            return candidates, None
        path = self.published.get(adapter) if adapter else None
        if path is None:
            raise BadRequest(f"lora_path {adapter!r} is not served by any replica")
        return healthy, (adapter, path)

    def _place(self, rid: str, input_ids: list[int], adapter: str | None, avoid: Replica | None = None,
               turns_done: int = 0) -> Replica:
        with self.lock:
            candidates, loadable = self._candidates(adapter, avoid)
            key = self._group_key(input_ids, adapter) if not turns_done else None
            replica = self.policy.choose(candidates, len(input_ids), key, self, turns_done)
        if loadable is not None:  # a moved session whose version only dead replicas had
            self.pool.json("POST", f"{replica.url}/load_lora_adapter", {"lora_name": loadable[0], "lora_path": loadable[1]})
            replica.adapters.add(loadable[0])
        return replica

    def _attach(self, session: Session, replica: Replica) -> None:
        session.replica = replica
        replica.sessions.add(session.rid)
        session.replicas_seen.append(replica.url)
        groups = self.group_replicas.setdefault(session.group_key, {})
        groups[replica] = groups.get(replica, 0) + 1

    def _detach(self, session: Session) -> None:
        replica = session.replica
        replica.sessions.discard(session.rid)
        groups = self.group_replicas.get(session.group_key)
        if groups and replica in groups:
            groups[replica] -= 1
            if groups[replica] <= 0:
                del groups[replica]
            if not groups:
                del self.group_replicas[session.group_key]

    def _end_session(self, rid: str) -> bool:
        with self.lock:
            session = self.sessions.pop(rid, None)
            if session is None:
                return False
            self._detach(session)
            self.session_lengths.add(session.turns)
            return True

    def end_session(self, rid: str) -> bool:
        return self._end_session(rid)

    # --- the call path -------------------------------------------------------------------

    def generate(self, body: dict[str, Any], raw: bytes | None = None) -> dict[str, Any]:
        """Route one call. ``raw`` is the body as received: forwarded as is when the router has
        nothing to change in it (saves re-encoding a long ``input_ids``)."""
        t_start = time.perf_counter()
        requests = parse_generate(body)
        if len(requests) != 1:
            raise BadRequest("input_ids must be one list: the router routes one call (one session) at a time")
        request = requests[0]
        rid = request.rid
        upstream_s = 0.0
        with self.lock:
            session = self.sessions.get(rid) if rid is not None else None
        if session is None:
            adapter = self._resolve_adapter(request.lora_path)
            replica = self._place(rid or "", request.input_ids, adapter)
            session = Session(rid or "", replica, adapter, self._group_key(request.input_ids, adapter),
                              prompt_tokens=len(request.input_ids))
            if rid is not None:  # a call without a session id is routed once and not tracked
                with self.lock:
                    self._attach(session, replica)
                    self.sessions[rid] = session
        elif request.lora_path not in (None, LATEST, session.adapter):
            raise BadRequest(f"lora_path {request.lora_path!r} differs from session {rid!r}'s adapter version {session.adapter!r}")
        else:
            self._maybe_rehome(session)
        with self.lock:
            session.last_call_s = time.monotonic()  # in flight: at the recent end of its replica's LRU order
        if raw is not None and body.get("lora_path") == session.adapter:
            payload = raw
        else:
            request.lora_path = session.adapter
            payload = json.dumps({**body, "lora_path": session.adapter} if session.adapter else
                                 {k: v for k, v in body.items() if k != "lora_path"}).encode()
        attempts = 0
        while True:
            replica = session.replica
            if not replica.healthy:
                new = self._place(session.rid, request.input_ids, session.adapter, avoid=replica, turns_done=session.turns)
                with self.lock:
                    if rid is not None:
                        self._detach(session)
                        self._attach(session, new)
                        self.moved_sessions += 1
                    else:
                        session.replica = new
                continue
            with self.lock:
                replica.in_flight += 1
                replica.routed_since_poll_tokens += max(0, len(request.input_ids) - session.context_tokens)
            t_up = time.perf_counter()
            try:
                status, data, _ = self.pool.request("POST", f"{replica.url}/generate", payload)
            except OSError:
                upstream_s += time.perf_counter() - t_up
                self._mark_dead(replica)
                attempts += 1
                if attempts > self.max_retries:
                    raise HttpError(503, f"call failed on {attempts} replicas") from None
                with self.lock:
                    self.retried_calls += 1
                continue
            finally:
                with self.lock:
                    replica.in_flight -= 1
            upstream_s += time.perf_counter() - t_up
            break
        if status >= 300:
            try:
                message = json.loads(data).get("error", "")
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")
            raise HttpError(status, message) if status != 400 else BadRequest(message)
        answer = json.loads(data)
        completion = int(answer.get("meta_info", {}).get("completion_tokens", 0))
        with self.lock:
            new_context = len(request.input_ids) + completion
            if session.turns:
                growth = new_context - session.context_tokens
                self.mean_growth_per_turn_tokens = (growth if not self.mean_growth_per_turn_tokens
                                                    else 0.99 * self.mean_growth_per_turn_tokens + 0.01 * growth)
                session.growth_per_turn_tokens = growth if session.turns == 1 else 0.7 * session.growth_per_turn_tokens + 0.3 * growth
            session.context_tokens = new_context
            session.turns += 1
            session.last_call_s = time.monotonic()
            answer.setdefault("meta_info", {})["replica"] = replica.url
            self.overhead_s.append(time.perf_counter() - t_start - upstream_s)
        return answer

    def _maybe_rehome(self, session: Session) -> None:
        """Before a live session's next call: let the policy move it (its prefix is recomputed there,
        as it would have been where its cache was evicted)."""
        with self.lock:
            if not session.replica.healthy or session.rid not in self.sessions:
                return  # a dead replica's sessions move in the call loop
            candidates = [r for r in self.replicas.values()
                          if r.healthy and (session.adapter is None or session.adapter in r.adapters)]
            target = self.policy.rehome(session, candidates, self)
            if target is None or target is session.replica:
                return
            self._detach(session)
            self._attach(session, target)
            self.rehomed_sessions += 1

    def session_record(self, rid: str) -> list[dict[str, Any]]:
        """The captured calls of a session from every replica it used (still alive), in order."""
        with self.lock:
            session = self.sessions.get(rid)
            urls = list(dict.fromkeys(session.replicas_seen)) if session else [r.url for r in self.replicas.values() if r.healthy]
        calls = []
        for url in urls:
            try:
                status, data, _ = self.pool.request("GET", f"{url}/sessions/{rid}")
            except OSError:
                continue
            if status == 200:
                calls.extend(json.loads(data)["calls"])
        calls.sort(key=lambda c: c.get("started_at", 0.0))
        return calls

    def overhead_quantiles_ms(self) -> dict[str, float]:
        with self.lock:
            values = sorted(self.overhead_s)
        if not values:
            return {"p50": 0.0, "p99": 0.0}
        return {"p50": values[len(values) // 2] * 1e3, "p99": values[min(len(values) - 1, int(len(values) * 0.99))] * 1e3}

    def metrics(self) -> dict[str, float]:
        with self.lock:
            healthy = sum(1 for r in self.replicas.values() if r.healthy)
            q = self.overhead_quantiles_ms()
            return {
                "router_live_sessions": len(self.sessions), "router_healthy_replicas": healthy,
                "router_replicas": len(self.replicas), "router_retried_calls_total": self.retried_calls,
                "router_moved_sessions_total": self.moved_sessions, "router_rehomed_sessions_total": self.rehomed_sessions,
                "router_overhead_p50_ms": q["p50"], "router_overhead_p99_ms": q["p99"],
            }

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)


class RouterServer(JsonServer):
    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0, limits: HttpLimits | None = None):
        self.router = router
        routes = {
            ("POST", "/generate"): lambda r: router.generate(r.json(), r.body),
            ("POST", "/end_session"): self._end_session,
            ("GET", "/sessions/"): self._session,
            ("POST", "/workers"): self._add_worker,
            ("POST", "/add_worker"): self._add_worker,
            ("POST", "/remove_worker"): self._remove_worker,
            ("GET", "/workers"): lambda r: {"workers": [x.describe() for x in list(router.replicas.values())]},
            ("POST", "/publish_adapter"): self._publish,
            ("GET", "/health"): lambda r: {"status": "ok"},
            ("GET", "/server_info"): lambda r: {"policy": router.policy.name, "newest_ready_version": router.newest_ready_version(),
                                                "replicas": len(router.replicas)},
            ("GET", "/metrics"): lambda r: Text("".join(f"posttrain:{k} {float(v)!r}\n" for k, v in router.metrics().items())),
        }
        super().__init__(routes, host, port, limits=limits)

    def _end_session(self, req: Request) -> Any:
        body = req.json()
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise BadRequest("rid must be the session id (a string)")
        return {"ended": self.router.end_session(rid)}

    def _session(self, req: Request) -> Any:
        rid = "/".join(req.params)
        return {"rid": rid, "calls": self.router.session_record(rid)}

    def _add_worker(self, req: Request) -> Any:
        body = req.json()
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        url = body.get("url") or (req.query.get("url") or [None])[0]
        if not isinstance(url, str) or not url.startswith("http"):
            raise BadRequest(f"url must be the replica's http:// address, got {url!r}")
        try:
            replica = self.router.add_replica(url, body.get("pool", "on_demand"), body.get("size_gpus", 1))
        except OSError as exc:
            raise HttpError(502, f"url {url}: replica not reachable: {exc}") from exc
        return replica.describe()

    def _remove_worker(self, req: Request) -> Any:
        body = req.json()
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        url = body.get("url") or (req.query.get("url") or [None])[0]
        if not isinstance(url, str):
            raise BadRequest("url must be the replica's address")
        self.router.remove_replica(url)
        return {"removed": url}

    def _publish(self, req: Request) -> Any:
        body = req.json()
        name = parse_adapter_name(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("lora_path must be the adapter's directory on the shared volume")
        return self.router.publish_adapter(name, path)

    def shutdown(self) -> None:
        super().shutdown()
        self.router.close()


def serve_router(router: Router, host: str = "127.0.0.1", port: int = 0, limits: HttpLimits | None = None) -> RouterServer:
    """Serve ``router`` from a background thread; ``limits`` bounds slow or odd clients (``serving.http``)."""
    return RouterServer(router, host, port, limits).start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30100)
    parser.add_argument("--policy", default="kv_headroom", choices=sorted(POLICIES))
    parser.add_argument("--worker", action="append", default=[], metavar="URL[@POOL:GPUS]")
    parser.add_argument("--adapters-volume", default=None, help="shared folder of published adapter versions")
    parser.add_argument("--http-idle-timeout-s", type=float, default=HttpLimits.idle_timeout_s,
                        help="close a kept-alive client connection after this long without a request")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.router", description="session-sticky router in front of replicas")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    router = Router(args.policy, adapters_volume=args.adapters_volume)
    for spec in args.worker:
        url, _, rest = spec.partition("@")
        pool, _, gpus = rest.partition(":")
        router.add_replica_when_up(url, pool or "on_demand", int(gpus or 1))
    server = serve_router(router, args.host, args.port, HttpLimits(idle_timeout_s=args.http_idle_timeout_s))
    return server.run_in_foreground(f"router ({args.policy}) on {server.url} over {len(router.replicas)} replicas")


if __name__ == "__main__":
    raise SystemExit(main())
