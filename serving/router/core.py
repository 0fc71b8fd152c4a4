"""The router's core: fleet membership, sessions, adapter versions and the call path.

A session is the ``session_id`` of its calls (``rid`` is its older spelling): a routing key. The
replica gives each call its own request id for the engine, so a session's key is never reused as
an engine's request id. Its first call picks a replica (the policy,
:mod:`serving.router.policy`) and an adapter version; every later call goes to the same replica
with the same version, until the session ends (:meth:`Router.end_session`) or idles out.

``lora_path: "latest"`` asks for the newest adapter version that one replica in each pool
(reserved, on-demand) serves; the session keeps that version for its whole life. A replica that
fails a call is marked dead; its sessions move to other replicas and the failed call is retried
there (the prefix is recomputed). :meth:`Router.add_replica` loads the newest adapter before the
replica takes traffic. The HTTP face of all this is :mod:`serving.router.server`.

A session belongs to whoever started it (:mod:`serving.capture_store`): a call into it, reading it
and ending it need its key (``X-Session-Key``) or the trainer credential, checked here before the
session is placed or touched (so a caller without the key cannot pin another episode's session to a
replica or version either). The router holds the trainer credential (``credential``: this process's
by default) and calls the replicas with the session's key, and reads them with the credential.
Anonymous sessions (the ids the router makes for chat calls that name none) are capped
(``max_anonymous_sessions``, the oldest ended first).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from typing import Any
from urllib.parse import quote

from serving.adapters import newest_adapter, newest_version, version_sort_key
from serving.capture_store import (SESSION_KEY_HEADER, Credential, as_credential, may_use_session, refusal, session_key,
                                   trainer_headers)
from serving.client import EngineError, HttpPool
from serving.http import HttpError
from serving.protocol import BadRequest, parse_generate, parse_metrics
from serving.router.policy import POLICIES, Policy, Replica, Session, SessionLengths

POOLS = ("reserved", "on_demand")
LATEST = "latest"


class Router:
    def __init__(self, policy: str | Policy = "kv_headroom", *, adapters_volume: str | None = None,
                 poll_interval_s: float = 0.5, session_idle_s: float = 600.0, max_retries: int = 3,
                 affinity_tokens: int = 64, timeout_s: float = 600.0, credential: Credential | str | None = None,
                 max_anonymous_sessions: int = 1024):
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
        self.credential = as_credential(credential)  # this process's by default
        self.max_anonymous_sessions = max_anonymous_sessions
        self.pool = HttpPool(timeout_s)
        self.replicas: dict[str, Replica] = {}
        self.sessions: dict[str, Session] = {}
        self.anonymous_sessions: OrderedDict[str, None] = OrderedDict()  # live ones the router made, oldest first
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
        try:
            info = self.pool.json("GET", f"{url}/server_info")
        except EngineError as exc:  # an engine without /server_info: capacity from its metrics, adapters from here
            if exc.status != 404:
                raise
            info = {}
        loaded = info.get("loaded_adapters")
        replica = Replica(url, pool, size_gpus, max_total_tokens=int(info.get("max_total_num_tokens") or 0),
                          adapters=set(loaded) if isinstance(loaded, (list, dict)) else set())
        newest = self._newest_published()
        if newest is not None and newest[0] not in replica.adapters:
            self._load(url, *newest)
            replica.adapters.add(newest[0])
        self._poll(replica)
        with self.lock:
            self.replicas[url] = replica
        # A publication that began while this replica loaded took its targets before the replica was
        # registered, so it did not reach it: load whatever is newest now. Once registered, every later
        # publication reaches it, so this ends; until it does, "latest" routes to replicas that have it.
        while (newest := self._newest_published()) is not None and newest[0] not in replica.adapters:
            self._load(url, *newest)
            with self.lock:
                replica.adapters.add(newest[0])
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
                # The router's own table says what each replica serves (an engine's /server_info
                # may not list adapters); loading a version a replica already has is success.
                if lora_name not in replica.adapters:
                    self._load(replica.url, lora_name, lora_path)
                with self.lock:
                    replica.adapters.add(lora_name)
                loaded.append(replica.url)
            except OSError:
                self._mark_dead(replica)
        return {"lora_name": lora_name, "replicas": loaded, "newest_ready": self.newest_ready_version()}

    def _load(self, url: str, lora_name: str, lora_path: str) -> None:
        """Load a version on one replica; "already loaded" (SGLang's and vLLM's 400) is success."""
        try:
            self.pool.json("POST", f"{url}/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                           trainer_headers(self.credential))
        except EngineError as exc:
            if exc.status != 400 or "already" not in str(exc.message).lower():
                raise

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
        if not m:  # an engine's own names (vLLM's), normalized into the capture front's vocabulary
            from serving.capture import sglang_metrics
            from serving.engines.vllm import normalize_metrics

            m = sglang_metrics(normalize_metrics(data.decode()))
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
        """Take ``replica`` out of rotation, and wait for it to answer again: a replica that comes
        back under its address (a Kubernetes pod replaced under its StatefulSet name, an engine
        restarted on its port) joins as a new one does, loading the newest adapter first. Before,
        a dead replica stayed out for good: on the cluster a replaced engine pod never got work."""
        with self.lock:
            replica.healthy = False
            if self.replicas.get(replica.url) is replica:  # not one removed on purpose (remove_replica)
                self.pending.setdefault(replica.url, (replica.pool, replica.size_gpus))

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
            self._load(replica.url, *loadable)
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
            self.anonymous_sessions.pop(rid, None)
            session = self.sessions.pop(rid, None)
            if session is None:
                return False
            self._detach(session)
            self.session_lengths.add(session.turns)
            return True

    def end_session(self, rid: str) -> bool:
        return self._end_session(rid)

    def check_session(self, session_id: str, headers: dict[str, str] | None, doing: str) -> None:
        """Refuse (403) an HTTP caller without ``session_id``'s key or the trainer credential."""
        if not may_use_session(self.credential, session_id, headers):
            raise HttpError(403, refusal(session_id, doing))

    def note_anonymous(self, session_id: str) -> None:
        """Count a session the router made up; past ``max_anonymous_sessions`` the oldest ends."""
        with self.lock:
            self.anonymous_sessions[session_id] = None
            while len(self.anonymous_sessions) > self.max_anonymous_sessions:
                self._end_session(next(iter(self.anonymous_sessions)))

    def replica_headers(self, session_id: str | None) -> dict[str, str]:
        """What a call forwarded to a replica carries: its session's key."""
        return {SESSION_KEY_HEADER: session_key(self.credential, session_id)} if session_id is not None else {}

    # --- the call path -------------------------------------------------------------------

    def generate(self, body: dict[str, Any], raw: bytes | None = None) -> dict[str, Any]:
        """Route one call. ``raw`` is the body as received: forwarded as is when the router has
        nothing to change in it (saves re-encoding a long ``input_ids``). An HTTP caller's call into a
        session needs its key or the trainer credential, checked by the route's access
        (:func:`serving.router.server.generate_access`) before this runs."""
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
                status, data, _ = self.pool.request("POST", f"{replica.url}/generate", payload, self.replica_headers(rid))
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
                status, data, _ = self.pool.request("GET", f"{url}/sessions/{quote(rid, safe='')}",
                                                    headers=trainer_headers(self.credential))
            except OSError:
                continue
            if status == 403:  # never an empty session instead: the trainer would take it for a failed episode
                raise HttpError(502, f"replica {url} refused the router's trainer credential: the router and the "
                                     "replicas must be given the same one ($POSTTRAIN_TRAINER_CREDENTIAL)")
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
