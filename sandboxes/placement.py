"""Sandbox placement: image locality first, then bin packing with overcommit; and its simulator.

**Scheduler.** A sandbox asks for a fraction of its limits (CPU 25 %, memory 40 % by default):
most of an episode is spent waiting for the model, so measured use is far below the limits. A node
fits a sandbox when the *requests* fit. Among the nodes that fit, :class:`ImageAwarePolicy` takes
the ones that already hold the task image (no pull), and among those the fullest one (bin packing:
it keeps other nodes empty for large sandboxes and for images yet to come).

**Kubernetes defaults**, for comparison (:class:`KubernetesDefaultPolicy`): requests equal limits,
and the default scoring: ``NodeResourcesFit`` (LeastAllocated), ``NodeResourcesBalancedAllocation``
and ``ImageLocality`` at weight 1 each, the last one scaled by the image's spread over the nodes
and clamped between 23 MB and 1000 MB, as the upstream plugin does.

**Simulator.** :func:`simulate` replays one trace against a policy on a cluster of nodes with LRU
image caches. The trace follows the published distributions: tasks declare 1-8 vCPUs (mean 2.3);
CPU use averages 20 % of the limit with p99 at 100 %; memory use averages 5 % with p99 at 87 %;
nodes have 16 vCPUs. Episodes arrive in GRPO groups (several attempts of one task at once). A node
whose sandboxes' memory use exceeds its memory evicts the sandboxes furthest over their requests.
It reports sandboxes per node, evictions, the image cache hit rate and start latency.

Assumptions that the published figures do not fix are parameters of :class:`TraceConfig` (memory
per vCPU, image sizes, pull bandwidth, episode lengths, group size, number of tasks).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

GIB = 1024**3


@dataclass(frozen=True)
class TraceConfig:
    episodes: int = 6000
    tasks: int = 2000
    group_size: int = 8
    nodes: int = 20
    node_vcpus: int = 16
    node_memory_gib: float = 64.0
    node_image_cache_gib: float = 100.0
    vcpu_min: int = 1
    vcpu_max: int = 8
    vcpu_mean: float = 2.3
    memory_gib_per_vcpu: float = 2.0
    cpu_use_mean: float = 0.20
    cpu_use_p99: float = 1.00
    memory_use_mean: float = 0.05
    memory_use_p99: float = 0.87
    image_gib_median: float = 1.5
    image_gib_sigma: float = 0.6
    pull_mib_per_s: float = 200.0
    start_hit_s: float = 2.0  # the published start time of a sandbox whose image is cached
    episode_s_median: float = 600.0
    episode_s_sigma: float = 0.5
    use_resample_s: float = 60.0  # how often a sandbox's CPU and memory use change
    seed: int = 0


@dataclass(frozen=True)
class SandboxRequest:
    id: int
    task: int
    image_bytes: int
    vcpus: int
    memory_bytes: int
    duration_s: float
    arrival_s: float


@dataclass
class Node:
    name: str
    vcpus: float
    memory_bytes: float
    cache_bytes: float
    requested_cpu: float = 0.0
    requested_memory: float = 0.0
    images: OrderedDict = field(default_factory=OrderedDict)  # task -> bytes, LRU order
    running: dict = field(default_factory=dict)  # request id -> (request, cpu_req, mem_req)

    def has_image(self, task: int) -> bool:
        return task in self.images

    def touch_image(self, task: int, size: int) -> None:
        if task in self.images:
            self.images.move_to_end(task)
            return
        self.images[task] = size
        in_use = {r.task for r, _, _ in self.running.values()}
        while sum(self.images.values()) > self.cache_bytes:
            victim = next((t for t in self.images if t not in in_use and t != task), None)
            if victim is None:
                break
            del self.images[victim]


class Policy(Protocol):
    name: str
    lookahead: int

    def requests(self, req: SandboxRequest) -> tuple[float, float]: ...

    def choose(self, req: SandboxRequest, nodes: list[Node], require_image: bool = False) -> Node | None: ...


def _fits(node: Node, cpu: float, mem: float) -> bool:
    return node.requested_cpu + cpu <= node.vcpus + 1e-9 and node.requested_memory + mem <= node.memory_bytes + 1e-9


@dataclass
class ImageAwarePolicy:
    """Image locality first, then the fullest node that fits (requests at fractions of the limits)."""

    cpu_request_fraction: float = 0.25
    memory_request_fraction: float = 0.40
    # how far down the queue a freed node looks for a sandbox whose image it already holds
    lookahead: int = 64
    name: str = "posttrain (image-aware, overcommit)"

    def requests(self, req: SandboxRequest) -> tuple[float, float]:
        return req.vcpus * self.cpu_request_fraction, req.memory_bytes * self.memory_request_fraction

    def rank(self, req: SandboxRequest, nodes: list[Node], k: int = 3) -> list[str]:
        """The names of the ``k`` best nodes that fit, best first: the ``preferred_nodes`` of
        :func:`sandboxes.k8s.pod_spec` (the cluster scheduler still checks the real fit)."""
        cpu, mem = self.requests(req)

        def key(node):
            packed = max((node.requested_cpu + cpu) / node.vcpus, (node.requested_memory + mem) / node.memory_bytes)
            return (node.has_image(req.task), packed)

        return [n.name for n in sorted((n for n in nodes if _fits(n, cpu, mem)), key=key, reverse=True)[:k]]

    def choose(self, req: SandboxRequest, nodes: list[Node], require_image: bool = False) -> Node | None:
        cpu, mem = self.requests(req)
        best, best_key = None, None
        for node in nodes:
            if not _fits(node, cpu, mem) or (require_image and not node.has_image(req.task)):
                continue
            packed = max((node.requested_cpu + cpu) / node.vcpus, (node.requested_memory + mem) / node.memory_bytes)
            key = (node.has_image(req.task), packed)
            if best_key is None or key > best_key:
                best, best_key = node, key
        return best


@dataclass
class KubernetesDefaultPolicy:
    """Requests equal limits; LeastAllocated + BalancedAllocation + ImageLocality, weight 1 each."""

    name: str = "kubernetes defaults"
    lookahead: int = 0  # the default queue is FIFO by priority; nothing is reordered for images
    min_threshold_bytes: int = 23 * 1024**2
    max_threshold_bytes: int = 1000 * 1024**2

    def requests(self, req: SandboxRequest) -> tuple[float, float]:
        return float(req.vcpus), float(req.memory_bytes)

    def choose(self, req: SandboxRequest, nodes: list[Node], require_image: bool = False) -> Node | None:
        cpu, mem = self.requests(req)
        holders = sum(1 for n in nodes if n.has_image(req.task))
        best, best_score = None, None
        for node in nodes:
            if not _fits(node, cpu, mem):
                continue
            cpu_frac = (node.requested_cpu + cpu) / node.vcpus
            mem_frac = (node.requested_memory + mem) / node.memory_bytes
            least_allocated = 100 * ((1 - cpu_frac) + (1 - mem_frac)) / 2
            balanced = 100 * (1 - abs(cpu_frac - mem_frac) / 2)
            image = 0.0
            if node.has_image(req.task):
                scaled = req.image_bytes * holders / len(nodes)
                clamped = min(max(scaled, self.min_threshold_bytes), self.max_threshold_bytes)
                image = 100 * (clamped - self.min_threshold_bytes) / (self.max_threshold_bytes - self.min_threshold_bytes)
            score = least_allocated + balanced + image
            if best_score is None or score > best_score:
                best, best_score = node, score
        return best


# ---------------------------------------------------------------------------------------------
# the published distributions


def truncated_geometric(lo: int, hi: int, mean: float) -> np.ndarray:
    """Probabilities on lo..hi, decaying geometrically, with the given mean (fitted by bisection)."""
    ks = np.arange(lo, hi + 1)
    if not lo < mean < (lo + hi) / 2:
        raise ValueError(f"mean {mean} must lie between {lo} and {(lo + hi) / 2}")
    a, b = 1e-6, 1.0
    for _ in range(100):
        r = (a + b) / 2
        p = r ** (ks - lo)
        m = float((ks * p).sum() / p.sum())
        a, b = (r, b) if m < mean else (a, r)
    p = r ** (ks - lo)
    return p / p.sum()


def clipped_lognormal(mean: float, p99: float, rng: np.random.Generator, n: int = 200_000) -> tuple[float, float]:
    """(mu, sigma) of a lognormal that, clipped at 1, has the given mean and 99th percentile."""
    z = rng.standard_normal(n)
    z99 = 2.3263478740408408  # the standard normal's 99th percentile
    lo, hi = 0.01, 5.0
    for _ in range(60):
        sigma = (lo + hi) / 2
        mu = math.log(min(p99, 0.999999)) - z99 * sigma
        m = float(np.minimum(np.exp(mu + sigma * z), 1.0).mean())
        lo, hi = (lo, sigma) if m < mean else (sigma, hi)  # a wider spread lowers the median, so the mean
    return mu, sigma


def make_trace(cfg: TraceConfig) -> list[SandboxRequest]:
    """Episodes in GRPO groups; tasks uniform over the dataset; arrival rate that keeps the cluster busy."""
    rng = np.random.default_rng(cfg.seed)
    vcpu_p = truncated_geometric(cfg.vcpu_min, cfg.vcpu_max, cfg.vcpu_mean)
    task_vcpus = rng.choice(np.arange(cfg.vcpu_min, cfg.vcpu_max + 1), size=cfg.tasks, p=vcpu_p)
    task_image = np.exp(rng.normal(math.log(cfg.image_gib_median), cfg.image_gib_sigma, cfg.tasks)) * GIB
    groups = math.ceil(cfg.episodes / cfg.group_size)
    # offered load: about twice what requests-at-limits could hold, so every policy runs full
    capacity_episodes = cfg.nodes * cfg.node_vcpus / cfg.vcpu_mean * 4
    rate = capacity_episodes / cfg.episode_s_median
    t, out = 0.0, []
    for g in range(groups):
        t += rng.exponential(cfg.group_size / rate)
        task = int(rng.integers(cfg.tasks))
        for _ in range(cfg.group_size):
            if len(out) == cfg.episodes:
                break
            dur = float(np.exp(rng.normal(math.log(cfg.episode_s_median), cfg.episode_s_sigma)))
            out.append(SandboxRequest(id=len(out), task=task, image_bytes=int(task_image[task]),
                                      vcpus=int(task_vcpus[task]),
                                      memory_bytes=int(task_vcpus[task] * cfg.memory_gib_per_vcpu * GIB),
                                      duration_s=dur, arrival_s=t))
    return out


@dataclass(frozen=True)
class SimResult:
    policy: str
    sandboxes_per_node: float  # running sandboxes per node, sampled every use_resample_s while a backlog waits
    evictions: int
    cache_hit_rate: float
    start_latency_mean_s: float
    start_latency_p50_s: float
    start_latency_p99_s: float
    queue_wait_mean_s: float
    completed: int
    cpu_use_of_capacity: float  # mean used vCPUs / node vCPUs, while saturated

    def row(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def simulate(policy: Policy, cfg: TraceConfig = TraceConfig(), trace: list[SandboxRequest] | None = None) -> SimResult:
    rng = np.random.default_rng(cfg.seed + 1)
    trace = trace if trace is not None else make_trace(cfg)
    cpu_mu, cpu_sigma = clipped_lognormal(cfg.cpu_use_mean, cfg.cpu_use_p99, rng)
    mem_mu, mem_sigma = clipped_lognormal(cfg.memory_use_mean, cfg.memory_use_p99, rng)
    nodes = [Node(f"node-{i:03d}", cfg.node_vcpus, cfg.node_memory_gib * GIB, cfg.node_image_cache_gib * GIB)
             for i in range(cfg.nodes)]
    events: list = []  # (time, kind order, seq, payload)
    seq = 0
    for req in trace:
        heapq.heappush(events, (req.arrival_s, 1, seq, ("arrive", req)))
        seq += 1
    heapq.heappush(events, (0.0, 2, seq, ("sample", None)))
    pending: list[SandboxRequest] = []
    placed_at: dict[int, Node] = {}
    use: dict[int, tuple[float, float]] = {}
    hits = misses = evictions = completed = 0
    latencies, waits = [], []

    def place(req: SandboxRequest, node: Node, now: float) -> None:
        nonlocal hits, misses, seq
        cpu_req, mem_req = policy.requests(req)
        hit = node.has_image(req.task)
        hits += hit
        misses += not hit
        node.touch_image(req.task, req.image_bytes)
        node.running[req.id] = (req, cpu_req, mem_req)
        node.requested_cpu += cpu_req
        node.requested_memory += mem_req
        placed_at[req.id] = node
        use[req.id] = _sample_use(rng, cpu_mu, cpu_sigma, mem_mu, mem_sigma)
        start = cfg.start_hit_s + (0.0 if hit else req.image_bytes / (cfg.pull_mib_per_s * 1024**2))
        latencies.append(start)
        waits.append(now - req.arrival_s)
        heapq.heappush(events, (now + start + req.duration_s, 0, seq, ("finish", req)))
        seq += 1

    def try_place(now: float) -> None:
        if policy.lookahead:  # first, sandboxes whose image a node with room already holds
            for req in list(pending[: policy.lookahead]):
                node = policy.choose(req, nodes, require_image=True)
                if node is not None:
                    place(req, node, now)
                    pending.remove(req)
        i = failures = 0
        while i < len(pending) and failures < 8:  # then in order; stop once the cluster is full
            node = policy.choose(pending[i], nodes)
            if node is None:
                failures += 1
                i += 1
            else:
                place(pending.pop(i), node, now)

    def remove(req: SandboxRequest) -> None:
        node = placed_at.pop(req.id)
        _, cpu_req, mem_req = node.running.pop(req.id)
        node.requested_cpu -= cpu_req
        node.requested_memory -= mem_req
        use.pop(req.id, None)

    arrivals_left = len(trace)
    samples = density = cpu_density = 0.0
    while events:
        now, _, _, (kind, req) = heapq.heappop(events)
        if kind == "arrive":
            pending.append(req)
            arrivals_left -= 1
        elif kind == "finish":
            if req.id in placed_at:
                remove(req)
                completed += 1
        elif kind == "sample":
            for rid in use:
                use[rid] = _sample_use(rng, cpu_mu, cpu_sigma, mem_mu, mem_sigma)
            if pending:  # saturated: the cluster is the bottleneck, so this is its density
                samples += 1
                density += sum(len(n.running) for n in nodes) / len(nodes)
                cpu_density += sum(use[i][0] * r.vcpus for n in nodes for i, (r, _, _) in n.running.items()) / (
                    len(nodes) * cfg.node_vcpus)
            for node in nodes:
                used = sum(use[i][1] * r.memory_bytes for i, (r, _, _) in node.running.items())
                if used > node.memory_bytes:
                    # the kubelet evicts the pods furthest over their memory request first
                    order = sorted(node.running.items(), key=lambda kv: -(use[kv[0]][1] * kv[1][0].memory_bytes - kv[1][2]))
                    for rid, (r, _, _) in order:
                        if used <= node.memory_bytes:
                            break
                        used -= use[rid][1] * r.memory_bytes
                        remove(r)
                        evictions += 1
            if placed_at or pending or arrivals_left:
                heapq.heappush(events, (now + cfg.use_resample_s, 2, seq, ("sample", None)))
                seq += 1
        if pending and kind != "sample":
            try_place(now)
    lat = np.array(latencies) if latencies else np.zeros(1)
    return SimResult(
        policy=policy.name,
        sandboxes_per_node=density / samples if samples else 0.0,
        evictions=evictions,
        cache_hit_rate=hits / max(1, hits + misses),
        start_latency_mean_s=float(lat.mean()),
        start_latency_p50_s=float(np.percentile(lat, 50)),
        start_latency_p99_s=float(np.percentile(lat, 99)),
        queue_wait_mean_s=float(np.mean(waits)) if waits else 0.0,
        completed=completed,
        cpu_use_of_capacity=cpu_density / samples if samples else 0.0,
    )


def _sample_use(rng, cpu_mu, cpu_sigma, mem_mu, mem_sigma) -> tuple[float, float]:
    cpu = min(1.0, math.exp(cpu_mu + cpu_sigma * rng.standard_normal()))
    mem = min(1.0, math.exp(mem_mu + mem_sigma * rng.standard_normal()))
    return cpu, mem


def compare(cfg: TraceConfig = TraceConfig()) -> list[SimResult]:
    """Both policies on the same trace."""
    trace = make_trace(cfg)
    return [simulate(ImageAwarePolicy(), cfg, trace), simulate(KubernetesDefaultPolicy(), cfg, trace)]
