"""The sandbox pool: on Kubernetes, one pod per episode, created, connected to and deleted here.

Run it in the pool's pod (``posttrain run --target k8s`` creates that Deployment)::

    python -m sandboxes.pool --namespace posttrain --run demo --port 30200 \\
        --max-sandboxes 512 --cpus 2 --memory-gib 4 --warm registry.example.com/tasks/calc:1=4

and from the trainer's pod (or anywhere that can reach the pool's Service)::

    with PoolClient("http://demo-sandbox-pool.posttrain.svc:30200").start(
            "registry.example.com/tasks/calc:1", task_id="calc", episode="step_000004-g3-a2") as box:
        box.write_file("notes.txt", b"hi"); print(box.exec("cat notes.txt").output)

**How the harness reaches the pool: an HTTP API.** Only the pool's service account may create,
attach to, exec into and delete pods; the trainer's account holds no Kubernetes rights at all (its
token is not even mounted). The trainer asks the pool for a sandbox (``POST /v1/sandboxes``), then
sends the same pxd requests it would send to a local sandbox (``POST /v1/sandboxes/ID/exec``,
``/file/read``, ``/file/write``, ``/git/...``); the pool forwards each one to the pod's pxd and
returns its answer. :class:`PoolSandbox` (the client's object) and :class:`PodSandbox` (the pool's)
both offer ``exec``, ``read_file``, ``write_file``, ``close`` and the context manager of
:class:`sandboxes.runtimes.Sandbox`, and raise the same :class:`~sandboxes.client.PxdError` /
:class:`~sandboxes.client.PxdConnectionError`, so ``evals.sandbox.PlatformSandbox`` wraps either.
The pool's port admits only the run's trainer pods (its NetworkPolicy); sandbox pods reach nothing.

**Who may call it.** Every route but ``GET /health`` (the kubelet's readiness probe, which sends no
credential) needs the run's credential, ``Authorization: Bearer <credential>``, else ``403``
before any of the body is read: the trainer credential (:mod:`sandboxes.httpserver.auth`: the same
variables, ``$POSTTRAIN_TRAINER_CREDENTIAL`` or the file named by
``$POSTTRAIN_TRAINER_CREDENTIAL_FILE``; on Kubernetes both the trainer's and the pool's pods take it
from the run's Secret). A NetworkPolicy is only as good as the cluster's CNI; the credential holds
on any network. :class:`PoolClient` sends it. The API is served by the project's one HTTP layer
(:mod:`sandboxes.httpserver`, as the engines and the router are), with the same bounds: a request's
line and headers must arrive within ``request_timeout_s`` (60 s; else a plain close), its body within
as long again (``408``), a kept-alive connection idle that long is closed, a body is at most
``MAX_BODY_BYTES`` (``413``, unread), and at most ``max_connections`` are open at once (more are
answered ``503``). The server listens on loopback unless told otherwise (``--host 0.0.0.0`` in the
pool's pod).
A request may ask for a writable root (``"writable_root": true``, a task whose verifier installs
into the image's environment): its pod's sandbox container gets ``readOnlyRootFilesystem: false``
and is otherwise as locked down (:func:`sandboxes.k8s.pod_spec`); absent means false.

**How the pool reaches pxd: attach, not exec.** A sandbox pod's only container runs
``pxd --stdio`` with ``stdin: true, stdinOnce: true``. The pool attaches to that process's
stdin/stdout over the API server's websocket (``kubernetes.stream.stream`` on
``connect_get_namespaced_pod_attach``): the same byte stream the local runtimes get from a pipe, so
the same :class:`~sandboxes.client.PxdClient` speaks to it, including its first line (the
``PXD-KEY`` that keys the HMAC on every answer; pxd prints ``PXD-READY`` only after it, so nothing
the pool needs is written before it attached). Exec would start a second process per connection
next to a pxd that nobody talks to, and a pod whose stream closed would live on; with attach and
``stdinOnce`` the pod ends when the pool's stream ends, as a local sandbox ends when its pipe closes.
The websocket is bridged to one end of a socket pair (:class:`AttachBridge`) because the client
speaks to file descriptors.

**Cleanup.** A sandbox pod is deleted when its episode closes it, when its client has been idle for
``--client-idle-s``, and when its wall time runs out (``activeDeadlineSeconds``). If the pool
itself dies: each pod has an owner reference to the pool's pod (``POD_NAME``/``POD_UID`` from the
downward API), so deleting the pool's pod deletes its sandboxes; and each pod names the pool
process that made it (label ``posttrain.dev/owner``), whose ``coordination.k8s.io`` Lease the pool
renews. :meth:`SandboxPool.reap` deletes the run's sandbox pods whose owner's Lease has expired or
is gone (a pool process that crashed and restarted in the same pod, or a pool deleted without the
garbage collector). It runs when the pool starts and every ``lease_s / 3``.

**Warm pools.** ``--warm IMAGE=N`` (or ``POST /v1/warm``) keeps N started, connected pods of an
image; a request for that image takes one (a cache hit: its labels and deadline become the
episode's) and a replacement starts behind it. Warm pods have a read-only root: a writable-root
request always starts a pod of its own. Each pod still serves one episode only; a warm pod
that waited longer than half its wall time is replaced. When the pool is full, an episode's request
evicts the least recently used idle warm pod (counted as an eviction). New pods prefer the nodes
where this pool already ran their image (:class:`sandboxes.placement.ImageAwarePolicy` over the
pool's own pods: it needs no right to read nodes).

**Metrics.** ``GET /metrics`` is Prometheus text: pods (busy, warm, starting), starts, start
failures, warm cache hits and misses, pods placed where their image was (node image cache hits),
evictions (warm pods evicted for room, and pods the kubelet evicted), reaped pods, start seconds.

Tests run this against the real ``kubernetes`` client, whose HTTP and websocket calls go over
loopback to a small in-process fake of the API server and kubelet (``tests/sandboxes/test_pool.py``).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from sandboxes.httpserver import Bearer, Endpoint, HttpError, HttpLimits, HttpServer, Reply, Request, Text
from sandboxes.httpserver.auth import CREDENTIAL_ENV, CREDENTIAL_FILE_ENV, MIN_CREDENTIAL_CHARS, Credential, process_credential

from sandboxes import k8s, placement
from sandboxes.client import ANSWER_MARGIN_S, ExecResult, PxdClient, PxdConnectionError, PxdError
from sandboxes.errors import SandboxError
from sandboxes.runtimes import Limits

DEFAULT_PORT = 30200
MAX_BODY_BYTES = 64 * 1024 * 1024  # pxd's own request limit
REQUEST_TIMEOUT_S = 60.0  # request line, headers and body of one request; also each answer's write
# The run's credential: the trainer credential (sandboxes.httpserver.auth, shared with serving).
OWNER_LABEL = f"{k8s.LABEL_PREFIX}/owner"
# pxd routes the pool forwards; anything else is refused (404) before it reaches a pod
PXD_ROUTES = ("/health", "/exec", "/file/read", "/file/write", "/git/status", "/git/diff", "/git/commit",
              "/session/open", "/session/exec", "/session/close")
# container states that will not get better by waiting: the pod is given up at once
_HOPELESS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
             "CreateContainerError", "RunContainerError")


class PoolFull(SandboxError):
    """Every sandbox slot is busy (and no idle warm pod can be evicted)."""


class _TooLarge(ValueError):
    """A request body above the server's limit (answered 413 without reading it)."""


# ---------------------------------------------------------------------------------------------
# the pod's pxd stream


class AttachBridge:
    """A pod's attached stdin/stdout as one end of a socket pair: ``fd`` for :class:`PxdClient`.

    Two threads move bytes: websocket stdout frames to the socket, socket bytes to stdin frames.
    When either side ends, both do (the client then sees end of stream: ``PxdConnectionError``).
    ``ws`` is a ``kubernetes.stream.ws_client.WSClient`` opened with ``binary=True``.
    """

    def __init__(self, ws, name: str):
        self.ws = ws
        self.name = name
        self.error = ""  # what the API server said on the error channel, if anything
        self._local, self._remote = socket.socketpair()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._from_pod, daemon=True, name=f"{name}-out"),
                         threading.Thread(target=self._to_pod, daemon=True, name=f"{name}-in")]
        for t in self._threads:
            t.start()

    @property
    def fd(self) -> int:
        return self._local.fileno()

    def _from_pod(self) -> None:
        try:
            while not self._closed.is_set() and self.ws.is_open():
                self.ws.update(timeout=1.0)
                data = self.ws.read_channel(1)
                if data:
                    self._remote.sendall(data)
                err = self.ws.read_channel(3)
                if err:
                    self.error = err.decode(errors="replace")[:500] if isinstance(err, bytes) else str(err)[:500]
        except Exception:  # the websocket broke (server gone, closed under us): end the stream
            pass
        self._end()

    def _to_pod(self) -> None:
        try:
            while not self._closed.is_set():
                data = self._remote.recv(1 << 16)
                if not data:
                    break
                self.ws.write_stdin(data)
        except Exception:
            pass
        self._end()

    def _end(self) -> None:
        first = not self._closed.is_set()
        self._closed.set()
        if first:
            try:
                self._remote.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close pxd's stdin (so it exits and the pod ends), then the websocket and the sockets."""
        try:
            self.ws.close_channel(0)  # v5 protocol: stdin closed; v4 ends it with the websocket
        except Exception:
            pass
        self._end()
        # no close handshake to wait for (the pod is deleted next): shutting the TCP socket down
        # also wakes the reading thread out of its poll at once
        ws_sock = getattr(self.ws, "sock", None)
        try:
            if ws_sock is not None and ws_sock.sock is not None:
                ws_sock.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.ws.close()
        except Exception:
            pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._local.close()
        self._remote.close()


# ---------------------------------------------------------------------------------------------
# one pod


@dataclass(frozen=True)
class PodRuntime:
    """The RuntimeClass a sandbox pod runs under (``gvisor`` or ``kata``); read as ``box.runtime.name``
    like a local sandbox's runtime."""

    name: str


class PodSandbox:
    """A running sandbox pod, as the pool holds it: pxd over attach. Same surface as a local Sandbox."""

    def __init__(self, pool: "SandboxPool", name: str, image: str, limits: Limits, warm: bool,
                 writable_root: bool = False):
        self.pool = pool
        self.runtime = PodRuntime(pool.config.settings.runtime_class)
        self.id = name
        self.pod_name = name
        self.image = image
        self.limits = limits
        self.warm = warm
        self.writable_root = writable_root
        self.node: str | None = None
        self.cache_hit = False
        self.start_s = 0.0
        self.last_used = time.monotonic()
        self.started_at = self.claimed_at = time.monotonic()
        self.closed = False
        self.bridge: AttachBridge | None = None
        self.pxd: PxdClient | None = None
        self._lock = threading.Lock()

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def exec(self, command: str | list[str], *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
             cwd: str | None = None, env: dict[str, str] | None = None, results_fd: int | None = None,
             kill_others: bool = False) -> ExecResult:
        """As :meth:`sandboxes.runtimes.Sandbox.exec` (pxd is PID 1 of the pod's container)."""
        self.touch()
        return self.pxd.run(command, timeout_s=timeout_s, output_cap_bytes=output_cap_bytes, cwd=cwd, env=env,
                            results_fd=results_fd, kill_others=kill_others)

    def read_file(self, path: str) -> bytes:
        self.touch()
        return self.pxd.read_file(path)

    def write_file(self, path: str, data: bytes | str) -> None:
        self.touch()
        self.pxd.write_file(path, data)

    def why_gone(self) -> str:
        return self.pool.why_gone(self)

    def close(self) -> None:
        self.pool.release(self)

    def __enter__(self) -> "PodSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def limits_key(image: str, limits: Limits) -> tuple:
    return (image, *asdict(limits).values())


@dataclass
class PoolMetrics:
    starts: int = 0
    start_failures: int = 0
    warm_hits: int = 0
    warm_misses: int = 0
    evictions: int = 0
    reaped: int = 0
    image_local: int = 0  # pods that landed on a node where this pool had run their image
    start_seconds_sum: float = 0.0


@dataclass(frozen=True)
class PoolConfig:
    """What one pool serves. ``run`` is the run's Kubernetes name (the manifests' ``k8s_name``)."""

    run: str
    settings: k8s.PodSettings = k8s.PodSettings()
    max_sandboxes: int = 64
    default_limits: Limits = Limits()
    start_timeout_s: float = 300.0
    lease_s: float = 60.0
    client_idle_s: float | None = 900.0
    command_timeout_s: float = 120.0  # an exec request's timeout when it gives none
    owner_pod: str | None = None  # the pool's own pod (owner reference target)
    owner_uid: str | None = None
    instance: str = field(default_factory=lambda: f"pool-{uuid.uuid4().hex[:10]}")
    poll_s: float = 0.5  # first interval between pod status reads (doubles up to 2 s)
    node_vcpus: int = 16  # node size assumed by the image-aware node preference
    node_memory_gib: float = 64.0


class SandboxPool:
    """Creates, connects to, hands out and deletes the run's sandbox pods.

    ``api_client`` is a ``kubernetes.client.ApiClient``. Attaches run on a second ``ApiClient`` of
    the same configuration: ``kubernetes.stream`` swaps the client's request function while it opens
    a websocket, which would send another thread's plain requests over a websocket too.
    """

    def __init__(self, config: PoolConfig, api_client):
        from kubernetes import client

        self.config = config
        self.core = client.CoreV1Api(api_client)
        self.leases = client.CoordinationV1Api(api_client)
        self._attach_core = client.CoreV1Api(client.ApiClient(api_client.configuration))
        self._attach_lock = threading.Lock()
        self.metrics = PoolMetrics()
        self._lock = threading.Lock()
        self._busy: dict[str, PodSandbox] = {}
        self._warm: dict[tuple, list[PodSandbox]] = {}
        self._warm_targets: dict[tuple, tuple[str, Limits, int]] = {}
        self._starting = 0
        self._starting_pods: set[str] = set()  # names created (or being created) but not yet handed over
        self._pending_warm: dict[tuple, int] = {}  # warm pods starting, per key
        self._refills: list[threading.Thread] = []
        self._serial = 0
        self._nodes: dict[str, placement.Node] = {}
        self._image_ids: dict[str, int] = {}
        self._gone: dict[str, str] = {}  # pod name -> why the pool removed it
        self._stop = threading.Event()

    # -- owner lease --------------------------------------------------------------------------

    @property
    def lease_name(self) -> str:
        return f"sandbox-owner-{self.config.instance}"

    def renew_lease(self) -> None:
        """Create or renew this pool process's Lease (``holderIdentity`` = its instance)."""
        from kubernetes.client.exceptions import ApiException

        now = _micro_time(time.time())
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.lease_name, "namespace": self.config.settings.namespace,
                             "labels": {**k8s.sandbox_selector(self.config.run), f"{k8s.LABEL_PREFIX}/role": "sandbox-owner"},
                             **self._owner_references()},
                "spec": {"holderIdentity": self.config.instance, "leaseDurationSeconds": max(1, int(self.config.lease_s)),
                         "renewTime": now}}
        try:
            self.leases.patch_namespaced_lease(self.lease_name, self.config.settings.namespace,
                                               {"spec": {"renewTime": now}}, _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise
            body["spec"]["acquireTime"] = now
            self.leases.create_namespaced_lease(self.config.settings.namespace, body)

    def _owner_references(self) -> dict:
        if not (self.config.owner_pod and self.config.owner_uid):
            return {}
        return {"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": self.config.owner_pod,
                                     "uid": self.config.owner_uid, "blockOwnerDeletion": False}]}

    def _owner_alive(self, owner: str, cache: dict[str, bool]) -> bool:
        from kubernetes.client.exceptions import ApiException

        if owner == self.config.instance:
            return True
        if owner not in cache:
            try:
                lease = self.leases.read_namespaced_lease(f"sandbox-owner-{owner}", self.config.settings.namespace)
                renewed = lease.spec.renew_time
                duration = lease.spec.lease_duration_seconds or 0
                cache[owner] = renewed is not None and renewed.timestamp() + duration > time.time()
            except ApiException as exc:
                if exc.status != 404:
                    raise
                cache[owner] = False
        return cache[owner]

    def reap(self) -> list[str]:
        """Delete the run's sandbox pods whose owner is dead (Lease expired or gone), and the dead
        owners' Leases; note pods of this pool that the kubelet evicted. Returns the pods deleted."""
        from kubernetes.client.exceptions import ApiException

        ns = self.config.settings.namespace
        selector = ",".join(f"{k}={v}" for k, v in k8s.sandbox_selector(self.config.run).items())
        pods = self.core.list_namespaced_pod(ns, label_selector=selector).items
        alive: dict[str, bool] = {}
        reaped = []
        for pod in pods:
            owner = (pod.metadata.labels or {}).get(OWNER_LABEL, "")
            name = pod.metadata.name
            if owner == self.config.instance:
                if pod.status is not None and pod.status.reason == "Evicted":
                    self._evicted_by_cluster(name)
                    continue
                with self._lock:
                    known = (name in self._busy or name in self._starting_pods
                             or any(b.id == name for boxes in self._warm.values() for b in boxes))
                if known:
                    continue  # else a pod of ours that nobody holds (its start failed half-way): debris
            elif owner and self._owner_alive(owner, alive):
                continue
            try:
                self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
                reaped.append(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for owner, ok in alive.items():
            if not ok:
                try:
                    self.leases.delete_namespaced_lease(f"sandbox-owner-{owner}", ns)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        with self._lock:
            self.metrics.reaped += len(reaped)
        return reaped

    def _evicted_by_cluster(self, name: str) -> None:
        with self._lock:
            box = self._busy.get(name) or next((b for boxes in self._warm.values() for b in boxes if b.id == name), None)
            if box is None or name in self._gone:
                return
            self.metrics.evictions += 1
            self._gone[name] = "the kubelet evicted the sandbox's pod (its node ran short of memory or disk)"
        self.release(box)

    # -- starting pods ------------------------------------------------------------------------

    def _preferred_nodes(self, image: str, limits: Limits) -> list[str]:
        with self._lock:
            task = self._image_ids.setdefault(image, len(self._image_ids))
            nodes = list(self._nodes.values())
        if not nodes:
            return []
        req = placement.SandboxRequest(id=0, task=task, image_bytes=0, vcpus=max(1, round(limits.cpus)),
                                       memory_bytes=int(limits.memory_mib * 1024**2), duration_s=0, arrival_s=0)
        policy = placement.ImageAwarePolicy(self.config.settings.cpu_request_fraction,
                                            self.config.settings.memory_request_fraction)
        return policy.rank(req, nodes)

    def _placed(self, box: PodSandbox, add: bool) -> None:
        if not box.node:
            return
        cpu = box.limits.cpus * self.config.settings.cpu_request_fraction
        mem = box.limits.memory_mib * 1024**2 * self.config.settings.memory_request_fraction
        with self._lock:
            node = self._nodes.get(box.node)
            if node is None:
                node = self._nodes[box.node] = placement.Node(box.node, self.config.node_vcpus,
                                                               self.config.node_memory_gib * placement.GIB, float("inf"))
            sign = 1 if add else -1
            node.requested_cpu += sign * cpu
            node.requested_memory += sign * mem
            if add:
                task = self._image_ids.setdefault(box.image, len(self._image_ids))
                self.metrics.image_local += node.has_image(task)
                node.touch_image(task, 0)

    def _reserve(self, for_warm: bool) -> None:
        """Take a slot. When the pool is full, an episode's request evicts the least recently used
        idle warm pod (a warm pod never evicts another); with none to evict it is ``PoolFull``."""
        victim = None
        with self._lock:
            total = len(self._busy) + sum(len(b) for b in self._warm.values()) + self._starting
            if total >= self.config.max_sandboxes:
                idle = [b for boxes in self._warm.values() for b in boxes]
                if for_warm or not idle:
                    raise PoolFull(f"the pool is full: {self.config.max_sandboxes} sandboxes "
                                   f"(--max-sandboxes) are busy or starting")
                victim = min(idle, key=lambda b: b.last_used)
                self._warm[limits_key(victim.image, victim.limits)].remove(victim)
                self.metrics.evictions += 1
                self._gone[victim.id] = "evicted from the warm pool to make room"
            self._starting += 1
        if victim is not None:
            self.release(victim)

    def _start_pod(self, image: str, limits: Limits, *, task_id: str, episode: str, warm: bool,
                   writable_root: bool = False) -> PodSandbox:
        """Create the pod, wait until its container runs (deadline), attach, and wait for pxd."""
        from kubernetes.client.exceptions import ApiException

        started = time.monotonic()
        cfg = self.config
        preferred = self._preferred_nodes(image, limits)
        manifest = k8s.pod_spec(run=cfg.run, task_id=task_id, episode=episode, image=image, limits=limits,
                                settings=cfg.settings, preferred_nodes=preferred or None, writable_root=writable_root)
        # a retried episode must not collide with its previous pod, which may still be terminating
        manifest["metadata"]["name"] = k8s.pod_name(cfg.run, f"{episode}-{uuid.uuid4().hex[:8]}")
        if warm:  # the deadline counts from the pod's start: room for waiting, cut back when claimed
            manifest["spec"]["activeDeadlineSeconds"] = int(limits.wall_s + self.warm_max_age_s(limits))
        manifest["metadata"]["labels"][OWNER_LABEL] = cfg.instance
        manifest["metadata"].update(self._owner_references())
        name = manifest["metadata"]["name"]
        box = PodSandbox(self, name, image, limits, warm, writable_root)
        with self._lock:
            self._starting_pods.add(name)
        try:
            try:
                self.core.create_namespaced_pod(cfg.settings.namespace, manifest)
            except ApiException as exc:
                raise SandboxError(f"creating sandbox pod {name} for image {image} failed: "
                                   f"HTTP {exc.status} {exc.reason}: {_api_message(exc)}") from None
            box.node = self._wait_running(name, image, started + cfg.start_timeout_s)
            try:
                with self._attach_lock:
                    ws = _attach(self._attach_core, name, cfg.settings.namespace)
            except Exception as exc:  # the client wraps websocket failures in ApiException (or worse)
                raise SandboxError(f"attaching to sandbox pod {name} failed: {type(exc).__name__}: "
                                   f"{getattr(exc, 'reason', None) or exc}") from None
            box.bridge = AttachBridge(ws, name)
            box.pxd = PxdClient.over_fds(box.bridge.fd, box.bridge.fd, name=f"pxd[{name}]")
            box.pxd.explain_loss = box.why_gone
            remaining = started + cfg.start_timeout_s - time.monotonic()
            try:
                box.pxd.wait_ready(max(1.0, remaining))
            except PxdConnectionError as exc:
                raise SandboxError(f"sandbox pod {name} (image {image}) runs but its pxd did not answer: {exc}"
                                   + (f"; the API server said: {box.bridge.error}" if box.bridge.error else "")) from None
        except BaseException:
            with self._lock:
                self.metrics.start_failures += 1
                self._starting_pods.discard(name)
            self._delete(box)
            raise
        # the caller hands it over (busy or warm) and only then takes it off _starting_pods
        self._placed(box, True)
        box.start_s = time.monotonic() - started
        box.started_at = box.claimed_at = time.monotonic()
        with self._lock:
            self.metrics.starts += 1
            self.metrics.start_seconds_sum += box.start_s
        return box

    def _wait_running(self, name: str, image: str, deadline: float) -> str:
        """Poll the pod until its sandbox container runs; return its node. Fails fast on a pod that
        failed or an image that cannot be pulled, and at the deadline."""
        from kubernetes.client.exceptions import ApiException

        interval = self.config.poll_s
        last = "not yet scheduled"
        while True:
            try:
                pod = self.core.read_namespaced_pod(name, self.config.settings.namespace)
            except ApiException as exc:
                raise SandboxError(f"sandbox pod {name} vanished while starting (HTTP {exc.status})") from None
            status = pod.status
            phase = status.phase if status else None
            state = None
            for cs in (status.container_statuses or []) if status else []:
                if cs.name == "sandbox":
                    state = cs.state
            if phase == "Running" and state is not None and state.running is not None:
                return pod.spec.node_name or ""
            if phase in ("Failed", "Succeeded"):
                raise SandboxError(f"sandbox pod {name} (image {image}) ended before it was connected: phase {phase}"
                                   f"{', ' + status.reason if status.reason else ''}{': ' + status.message if status.message else ''}")
            waiting = state.waiting if state is not None else None
            if waiting is not None and waiting.reason in _HOPELESS:
                raise SandboxError(f"sandbox pod {name} cannot start: {waiting.reason}: {waiting.message or image}")
            last = f"phase {phase}" + (f", {waiting.reason}" if waiting is not None and waiting.reason else "")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(f"sandbox pod {name} (image {image}) did not start within "
                                   f"{self.config.start_timeout_s:g} s (--start-timeout-s); last seen: {last}")
            if self._stop.wait(min(interval, remaining)):
                raise SandboxError(f"sandbox pod {name}: the pool is shutting down")
            interval = min(2.0, interval * 2)

    # -- handing out and taking back ------------------------------------------------------------

    def acquire(self, image: str, *, task_id: str, episode: str, limits: Limits | None = None,
                writable_root: bool = False) -> PodSandbox:
        """A connected sandbox of ``image`` for one episode: a warm pod if one waits, else a new pod.
        ``writable_root``: the pod's root is writable (:func:`sandboxes.k8s.pod_spec`); warm pods
        have a read-only root, so such a request always starts a new pod."""
        _check_image(image)
        limits = limits or self.config.default_limits
        self._check_limits(limits)
        key = limits_key(image, limits)
        box = None
        with self._lock:
            if writable_root:  # no warm pod fits: theirs is read-only
                pass
            elif self._warm.get(key):
                box = self._warm[key].pop(0)
                self.metrics.warm_hits += 1
            elif key in self._warm_targets:
                self.metrics.warm_misses += 1
        if box is not None:
            box.warm = False
            box.cache_hit = True
            box.touch()
            box.claimed_at = time.monotonic()
            with self._lock:
                self._busy[box.id] = box
            self._claim(box, task_id, episode)
            self._refill_later(key)
            return box
        self._reserve(for_warm=False)
        try:
            box = self._start_pod(image, limits, task_id=task_id, episode=episode, warm=False,
                                  writable_root=writable_root)
        finally:
            with self._lock:
                self._starting -= 1
        with self._lock:
            self._busy[box.id] = box
            self._starting_pods.discard(box.id)
        return box

    def warm_max_age_s(self, limits: Limits) -> float:
        """How long a warm pod may wait for an episode before it is replaced (its deadline allows it)."""
        return max(60.0, limits.wall_s / 2)

    def _claim(self, box: PodSandbox, task_id: str, episode: str) -> None:
        """A warm pod becomes an episode's: its labels name the episode, its deadline the episode's wall time."""
        from kubernetes.client.exceptions import ApiException

        age_s = time.monotonic() - box.started_at
        patch = {"metadata": {"labels": {f"{k8s.LABEL_PREFIX}/task": k8s.label_value(task_id),
                                         f"{k8s.LABEL_PREFIX}/episode": k8s.label_value(episode)}},
                 "spec": {"activeDeadlineSeconds": max(1, int(age_s + box.limits.wall_s))}}
        try:
            self.core.patch_namespaced_pod(box.pod_name, self.config.settings.namespace, patch,
                                           _content_type="application/merge-patch+json")
        except ApiException as exc:  # the pod still has its longer deadline; the pool's own clock ends it
            print(f"sandbox pool: relabelling {box.pod_name} failed: HTTP {exc.status}", file=sys.stderr)

    def _check_limits(self, limits: Limits) -> None:
        top = self.config.default_limits
        for name in ("cpus", "memory_mib", "disk_mib", "tmp_mib", "wall_s", "pids"):
            if getattr(limits, name) > getattr(top, name):
                raise SandboxError(f"limits.{name} = {getattr(limits, name)!r} is above the pool's maximum "
                                   f"{getattr(top, name)!r} (the pool's --cpus/--memory-gib/... flags)")

    def release(self, box: PodSandbox) -> None:
        """End a sandbox: close its stream (pxd exits) and delete its pod. Safe to call twice."""
        with self._lock:
            if box.closed:
                return
            box.closed = True
            self._busy.pop(box.id, None)
            for boxes in self._warm.values():
                if box in boxes:
                    boxes.remove(box)
            self._gone.setdefault(box.id, "the sandbox was closed")
        self._placed(box, False)
        self._delete(box)

    def _delete(self, box: PodSandbox) -> None:
        from kubernetes.client.exceptions import ApiException

        box.closed = True
        if box.pxd is not None:
            box.pxd.close()
        if box.bridge is not None:
            box.bridge.close()
        try:
            self.core.delete_namespaced_pod(box.pod_name, self.config.settings.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
        except Exception:  # the API server is unreachable: the reaper of the next pool deletes it
            pass

    def why_gone(self, box: PodSandbox) -> str:
        with self._lock:
            why = self._gone.get(box.id, "")
        if box.bridge is not None and box.bridge.error:
            why = f"{why}; the API server said: {box.bridge.error}" if why else f"the API server said: {box.bridge.error}"
        return why or "the pod's attach stream ended (the pod was deleted, evicted or hit its wall time)"

    def get(self, sandbox_id: str) -> PodSandbox | None:
        with self._lock:
            return self._busy.get(sandbox_id)

    # -- warm pools ---------------------------------------------------------------------------

    def keep_warm(self, image: str, count: int, limits: Limits | None = None, *, fill: bool = True) -> None:
        """Keep ``count`` connected pods of ``image`` ready (0 stops and removes them)."""
        _check_image(image)
        if count < 0:
            raise SandboxError(f"warm count must be >= 0, got {count}")
        limits = limits or self.config.default_limits
        self._check_limits(limits)
        key = limits_key(image, limits)
        extra = []
        with self._lock:
            if count:
                self._warm_targets[key] = (image, limits, count)
            else:
                self._warm_targets.pop(key, None)
            boxes = self._warm.setdefault(key, [])
            while len(boxes) > count:
                extra.append(boxes.pop())
        for box in extra:
            self.release(box)
        if fill:
            self.fill_warm(key)

    def fill_warm(self, key: tuple | None = None) -> int:
        """Start warm pods until each image has its target; returns how many were started."""
        started = 0
        for k, (image, limits, count) in list(self._warm_targets.items()):
            if key is not None and k != key:
                continue
            while True:
                with self._lock:
                    have = len(self._warm.get(k, [])) + self._pending_warm.get(k, 0)
                    if have >= count or k not in self._warm_targets:
                        break
                    self._pending_warm[k] = self._pending_warm.get(k, 0) + 1
                try:
                    self._reserve(for_warm=True)
                except PoolFull:
                    with self._lock:
                        self._pending_warm[k] -= 1
                    return started
                try:
                    with self._lock:
                        self._serial += 1
                        serial = self._serial
                    box = self._start_pod(image, limits, task_id="warm", episode=f"warm-{self.config.instance}-{serial}",
                                          warm=True)
                except SandboxError:
                    return started
                finally:
                    with self._lock:
                        self._starting -= 1
                        self._pending_warm[k] -= 1
                with self._lock:
                    wanted = k in self._warm_targets
                    if wanted:
                        self._warm.setdefault(k, []).append(box)
                    self._starting_pods.discard(box.id)
                if not wanted:  # the target went away while the pod started
                    self.release(box)
                    return started
                started += 1
        return started

    def _refill_later(self, key: tuple | None) -> None:
        t = threading.Thread(target=self._safe_fill, args=(key,), daemon=True, name="warm-refill")
        with self._lock:
            self._refills = [r for r in self._refills if r.is_alive()] + [t]
        t.start()

    def wait_refills(self) -> None:
        """Wait for the warm pods started behind taken ones (tests, and shutdown)."""
        with self._lock:
            refills = list(self._refills)
        for t in refills:
            t.join()

    def _safe_fill(self, key: tuple | None) -> None:
        try:
            self.fill_warm(key)
        except Exception as exc:  # the API server is away; the next maintenance pass tries again
            print(f"sandbox pool: refilling the warm pool failed: {exc}", file=sys.stderr)

    # -- maintenance --------------------------------------------------------------------------

    def close_idle(self) -> list[str]:
        """Close busy sandboxes whose client has not called for ``client_idle_s`` (a dead trainer)."""
        if not self.config.client_idle_s:
            return []
        now = time.monotonic()
        with self._lock:
            idle = [b for b in self._busy.values() if now - b.last_used > self.config.client_idle_s]
            for b in idle:
                self._gone[b.id] = f"its client sent nothing for {self.config.client_idle_s:g} s (--client-idle-s)"
        for b in idle:
            self.release(b)
        return [b.id for b in idle]

    def close_expired(self) -> list[str]:
        """Close sandboxes past their wall time since claimed (the pod's deadline ends it too), and
        replace warm pods that waited longer than :meth:`warm_max_age_s`."""
        now = time.monotonic()
        with self._lock:
            done = [b for b in self._busy.values() if now - b.claimed_at > b.limits.wall_s]
            for b in done:
                self._gone[b.id] = f"the sandbox reached its wall-time limit of {b.limits.wall_s:g} s and was removed"
            stale = [b for boxes in self._warm.values() for b in boxes if now - b.started_at > self.warm_max_age_s(b.limits)]
            for b in stale:
                self._gone[b.id] = "a warm pod that waited too long was replaced"
        for b in done + stale:
            self.release(b)
        return [b.id for b in done + stale]

    def maintain_once(self) -> None:
        self.renew_lease()
        self.reap()
        self.close_idle()
        self.close_expired()
        with self._lock:
            filling = any(t.is_alive() for t in self._refills)
        if not filling:
            self._refill_later(None)

    def start_background(self) -> None:
        """Renew the lease, reap, close idle sandboxes and refill warm pools every ``lease_s / 3``."""
        self.renew_lease()

        def loop():
            while not self._stop.wait(max(0.5, self.config.lease_s / 3)):
                try:
                    self.maintain_once()
                except Exception as exc:  # keep going: the API server may be back on the next pass
                    print(f"sandbox pool: maintenance pass failed: {exc}", file=sys.stderr)

        threading.Thread(target=loop, daemon=True, name="pool-maintenance").start()

    def shutdown(self) -> None:
        """Delete every pod of this pool and its Lease."""
        from kubernetes.client.exceptions import ApiException

        self._stop.set()
        with self._lock:
            self._warm_targets.clear()
        self.wait_refills()
        with self._lock:
            boxes = list(self._busy.values()) + [b for bs in self._warm.values() for b in bs]
            self._warm_targets.clear()
        for b in boxes:
            self.release(b)
        try:
            self.leases.delete_namespaced_lease(self.lease_name, self.config.settings.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
        except Exception:
            pass

    def metrics_text(self) -> str:
        """Prometheus text exposition of the pool's gauges and counters."""
        with self._lock:
            m = self.metrics
            busy = len(self._busy)
            warm = sum(len(b) for b in self._warm.values())
            starting = self._starting
        rows = [
            ("posttrain_sandbox_pods", "gauge", "sandbox pods of this pool by state", None),
            ('posttrain_sandbox_pods{state="busy"}', None, None, busy),
            ('posttrain_sandbox_pods{state="warm"}', None, None, warm),
            ('posttrain_sandbox_pods{state="starting"}', None, None, starting),
            ("posttrain_sandbox_starts_total", "counter", "sandbox pods created and connected", m.starts),
            ("posttrain_sandbox_start_failures_total", "counter", "sandbox pods that did not start", m.start_failures),
            ("posttrain_sandbox_warm_hits_total", "counter", "requests served by a warm pod", m.warm_hits),
            ("posttrain_sandbox_warm_misses_total", "counter", "requests for a warm image that found none ready",
             m.warm_misses),
            ("posttrain_sandbox_evictions_total", "counter", "warm pods evicted for room and pods the kubelet evicted",
             m.evictions),
            ("posttrain_sandbox_reaped_total", "counter", "pods of dead owners deleted", m.reaped),
            ("posttrain_sandbox_image_local_total", "counter",
             "pods placed on a node where this pool had run their image (node image cache hits)", m.image_local),
            ("posttrain_sandbox_start_seconds_sum", "counter", "seconds from create to pxd ready, summed",
             round(m.start_seconds_sum, 6)),
            ("posttrain_sandbox_start_seconds_count", "counter", "starts counted in the sum", m.starts),
        ]
        out = []
        for name, kind, doc, value in rows:
            if kind:
                base = name.split("{")[0]
                out += [f"# HELP {base} {doc}", f"# TYPE {base} {kind}"]
            if value is not None:
                out.append(f"{name} {value}")
        return "\n".join(out) + "\n"


def _check_image(image: Any) -> None:
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise SandboxError(f"image must be a registry reference without spaces, got {image!r}")


def _attach(core, name: str, namespace: str):
    from kubernetes.stream import stream

    return stream(core.connect_get_namespaced_pod_attach, name, namespace, container="sandbox",
                  stdin=True, stdout=True, stderr=False, tty=False, _preload_content=False, binary=True)


def _api_message(exc) -> str:
    try:
        return json.loads(exc.body).get("message", "")[:300]
    except (TypeError, ValueError, AttributeError):
        return str(exc.body)[:300] if exc.body else ""


def _micro_time(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------------------------
# the pool's HTTP API


def _limits_from(body: dict, default: Limits) -> Limits:
    raw = body.get("limits") or {}
    if not isinstance(raw, dict):
        raise SandboxError(f"limits must be an object of {', '.join(asdict(default))}, got {type(raw).__name__}")
    unknown = set(raw) - set(asdict(default))
    if unknown:
        raise SandboxError(f"limits: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(asdict(default))}")
    try:
        return Limits(**{**asdict(default), **raw})
    except (TypeError, ValueError) as exc:
        raise SandboxError(f"limits: {exc}") from None


def _writable_root_from(body: dict) -> bool:
    """The request's ``writable_root``: absent (an older client) or null is false; else a boolean."""
    value = body.get("writable_root")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SandboxError(f"writable_root must be true or false, got {value!r}")
    return value


def run_credential() -> str:
    """The run's credential: this process's trainer credential (:func:`sandboxes.httpserver.auth.process_credential`)."""
    return process_credential().value


def _json_object(req: Request) -> dict:
    """The request's body as a JSON object (``{}`` for none); anything else is a 400."""
    try:
        body = json.loads(req.body or b"{}")
    except ValueError as exc:
        raise HttpError(400, f"bad JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "bad JSON body: the body must be a JSON object")
    return body


class PoolServer(HttpServer):
    """The pool's HTTP API on the project's HTTP layer (:mod:`sandboxes.httpserver`); ``serve_forever``,
    ``server_address`` and ``server_close`` are the names its callers (``main``, the tests) use."""

    @property
    def server_address(self) -> tuple[str, int]:
        return self.host, self.port

    def serve_forever(self) -> None:
        self.serve_until_stopped()

    def server_close(self) -> None:
        self.shutdown()


def make_server(pool: SandboxPool, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                credential: Credential | str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                max_body_bytes: int = MAX_BODY_BYTES, max_connections: int | None = None) -> PoolServer:
    """The pool's HTTP API (JSON bodies):

    - ``POST /v1/sandboxes`` ``{image, task_id, episode, limits?, writable_root?}`` ->
      ``{id, pod, node, runtime, warm_hit, start_s, writable_root}`` (``writable_root``: a boolean,
      default false; anything else is refused with 400)
    - ``POST /v1/sandboxes/ID/<pxd route>`` (``exec``, ``file/read``, ``file/write``, ``git/...``,
      ``session/...``, ``health``): the body goes to the pod's pxd, its answer comes back; pxd's
      refusals keep their status; a pod that is gone answers 502 ``{"error", "gone": true}``
    - ``DELETE /v1/sandboxes/ID``: end the episode's sandbox (its pod is deleted)
    - ``POST /v1/warm`` ``{image, count, limits?}``; ``GET /metrics`` (Prometheus text); ``GET /health``

    Every route but ``GET /health`` needs ``credential`` (default: this process's, :func:`run_credential`)
    as ``Authorization: Bearer``, declared with the route and checked by the HTTP layer before any of
    the body is read; the module docstring says how each connection is bounded (``request_timeout_s``
    is the layer's header, idle and body timeout). ``max_connections`` defaults to two per sandbox the
    pool may hold, and 16 more. Call ``start()`` (or ``serve_forever()``) to serve.
    """
    credential = process_credential() if credential is None else credential
    try:
        credential = credential if isinstance(credential, Credential) else Credential(credential, "make_server")
    except ValueError:
        raise ValueError(f"make_server: the credential must be at least {MIN_CREDENTIAL_CHARS} characters") from None
    if request_timeout_s <= 0:
        raise ValueError(f"make_server: request_timeout_s must be > 0, got {request_timeout_s!r}")
    connections = max_connections if max_connections is not None else 2 * pool.config.max_sandboxes + 16
    limits = HttpLimits(header_timeout_s=request_timeout_s, idle_timeout_s=request_timeout_s,
                        body_timeout_s=request_timeout_s, max_connections=connections, max_body_bytes=max_body_bytes,
                        answer_header_timeout=False)
    access = Bearer(credential, lambda req: f"{req.method} {req.path.split('?')[0][:200]} needs the run's credential "
                                            f"(Authorization: Bearer; ${CREDENTIAL_ENV} in the trainer's and the pool's pods)")

    def failed(exc: SandboxError) -> Reply:
        return Reply({"error": str(exc)}, status=429 if isinstance(exc, PoolFull) else
                     503 if "did not start" in str(exc) or "cannot start" in str(exc) else 400)

    def start(req: Request) -> Any:
        body = _json_object(req)
        try:
            writable_root = _writable_root_from(body)
            box = pool.acquire(body.get("image"), task_id=str(body.get("task_id") or "task"),
                               episode=str(body.get("episode") or uuid.uuid4().hex[:8]),
                               limits=_limits_from(body, pool.config.default_limits), writable_root=writable_root)
        except SandboxError as exc:
            return failed(exc)
        return {"id": box.id, "pod": box.pod_name, "node": box.node, "runtime": box.runtime.name,
                "warm_hit": box.cache_hit, "start_s": box.start_s, "writable_root": box.writable_root}

    def warm(req: Request) -> Any:
        body = _json_object(req)
        count = body.get("count")
        if isinstance(count, bool) or not isinstance(count, int):
            raise HttpError(400, f"count must be an integer, got {count!r}")
        try:
            pool.keep_warm(body.get("image"), count, _limits_from(body, pool.config.default_limits))
        except SandboxError as exc:
            return failed(exc)
        return {"image": body.get("image"), "count": count}

    def delete(req: Request) -> Any:
        if len(req.params) != 1:
            raise HttpError(404, f"no route DELETE {req.path}")
        box = pool.get(req.params[0])
        if box is None:
            raise HttpError(404, f"no sandbox {req.params[0]}")
        pool.release(box)
        return {"deleted": box.id}

    def forward(req: Request) -> Any:
        if len(req.params) < 2:
            raise HttpError(404, f"no route POST {req.path}")
        sandbox_id, route = req.params[0], "/" + "/".join(req.params[1:])
        body = _json_object(req)
        if route not in PXD_ROUTES:
            raise HttpError(404, f"no pxd route {route}; routes: {', '.join(PXD_ROUTES)}")
        box = pool.get(sandbox_id)
        if box is None:
            return Reply({"error": f"no sandbox {sandbox_id} (closed, idle too long, or never made)", "gone": True},
                         status=404)
        box.touch()
        if route in ("/exec", "/session/exec") and "timeout_s" not in body:
            body["timeout_s"] = pool.config.command_timeout_s
        timeout = body.get("timeout_s", 0)
        wait_s = (timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else 0) + ANSWER_MARGIN_S
        try:
            answer = box.pxd.request("GET" if route == "/health" else "POST", route, body, wait_s=wait_s)
        except PxdError as exc:
            raise HttpError(exc.status, exc.message) from None
        except PxdConnectionError as exc:
            pool.release(box)
            return Reply({"error": str(exc), "gone": True}, status=502)
        box.touch()
        return answer

    routes = {
        ("GET", "/health"): lambda req: {"ok": True, "instance": pool.config.instance},
        ("GET", "/metrics"): Endpoint(lambda req: Text(pool.metrics_text()), access),
        ("POST", "/v1/sandboxes"): Endpoint(start, access),
        ("POST", "/v1/warm"): Endpoint(warm, access),
        ("POST", "/v1/sandboxes/"): Endpoint(forward, access),
        ("DELETE", "/v1/sandboxes/"): Endpoint(delete, access),
    }
    return PoolServer(routes, host, port, limits)


# ---------------------------------------------------------------------------------------------
# the harness's side


class PoolSandbox:
    """A sandbox pod seen from the trainer: the surface of :class:`sandboxes.runtimes.Sandbox`
    (``exec``, ``read_file``, ``write_file``, ``close``, context manager) over the pool's HTTP API."""

    def __init__(self, client: "PoolClient", info: dict):
        self.client = client
        self.id = info["id"]
        self.pod = info["pod"]
        self.node = info.get("node")
        self.runtime = PodRuntime(info.get("runtime") or "gvisor")
        self.cache_hit = bool(info.get("warm_hit"))
        self.start_s = float(info.get("start_s") or 0.0)
        self.writable_root = bool(info.get("writable_root"))
        self.closed = False

    def request(self, route: str, body: dict, wait_s: float) -> dict:
        if self.closed:
            raise PxdConnectionError(f"pool sandbox {self.id}: the connection is closed: the sandbox was closed")
        status, answer = self.client.call("POST", f"/v1/sandboxes/{self.id}{route}", body, wait_s)
        if status == 200:
            return answer
        if answer.get("gone") or status in (502, 503):
            self.closed = True
            raise PxdConnectionError(f"pool sandbox {self.id}: {answer.get('error', f'HTTP {status}')}")
        raise PxdError(status, answer.get("error", "unknown error"), route)

    def exec(self, command: str | list[str], *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
             cwd: str | None = None, env: dict[str, str] | None = None, results_fd: int | None = None,
             kill_others: bool = False) -> ExecResult:
        head = output_cap_bytes // 2
        body = {"timeout_s": timeout_s, "head_bytes": head, "tail_bytes": output_cap_bytes - head, "merge_stderr": True,
                "cwd": cwd, "env": env, "results_fd": results_fd, "kill_others": kill_others or None}
        body["shell" if isinstance(command, str) else "argv"] = command if isinstance(command, str) else list(command)
        answer = self.request("/exec", {k: v for k, v in body.items() if v is not None}, timeout_s + 2 * ANSWER_MARGIN_S)
        try:
            return ExecResult.from_answer(answer)
        except Exception as exc:  # a missing or mistyped field (the client's own parse errors included)
            raise PxdConnectionError(f"pool sandbox {self.id}: malformed answer to /exec: {type(exc).__name__}: {exc}") from None

    def read_file(self, path: str) -> bytes:
        a = self.request("/file/read", {"path": path}, 2 * ANSWER_MARGIN_S)
        return a["content"].encode() if a["encoding"] == "utf-8" else base64.b64decode(a["content"])

    def write_file(self, path: str, data: bytes | str) -> None:
        if isinstance(data, str):
            body = {"path": path, "content": data, "encoding": "utf-8"}
        else:
            body = {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"}
        self.request("/file/write", {**body, "mode": 0o644, "make_dirs": True}, 2 * ANSWER_MARGIN_S)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.client.call("DELETE", f"/v1/sandboxes/{self.id}", None, 2 * ANSWER_MARGIN_S)
        except PxdConnectionError:
            pass  # the pool is away; its idle timeout or the reaper deletes the pod

    def __enter__(self) -> "PoolSandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PoolClient:
    """The trainer's handle on the sandbox pool (``url`` = the pool's Service); every call carries
    the run's credential (``credential``, default :func:`run_credential`)."""

    def __init__(self, url: str, credential: str | None = None):
        self.url = url.rstrip("/")
        self._authorization = f"Bearer {credential if credential is not None else run_credential()}"

    def call(self, method: str, path: str, body: dict | None, wait_s: float) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Authorization": self._authorization})
        try:
            with urllib.request.urlopen(req, timeout=wait_s) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"{}")
            except ValueError:
                return exc.code, {"error": f"HTTP {exc.code} {exc.reason}"}
        except (urllib.error.URLError, OSError) as exc:
            raise PxdConnectionError(f"sandbox pool {self.url}: {method} {path}: {exc}") from None

    def start(self, image: str, *, task_id: str, episode: str, limits: Limits | None = None,
              start_timeout_s: float = 600.0, writable_root: bool = False) -> PoolSandbox:
        """A sandbox pod of ``image`` for one episode. ``writable_root``: its root is writable (a
        task whose verifier installs into the image's environment; :func:`sandboxes.k8s.pod_spec`)."""
        body: dict[str, Any] = {"image": image, "task_id": task_id, "episode": episode}
        if limits is not None:
            body["limits"] = asdict(limits)
        if writable_root:  # sent only when asked: a default request is the same as before the field
            body["writable_root"] = True
        # A full pool (429: every slot busy or starting) is back-pressure, not a failure: the run has
        # more episodes in flight than the node has sandboxes, and a slot frees when an episode or a
        # grading ends. Wait for one (backing off to 5 s between asks) within start_timeout_s.
        deadline = time.monotonic() + start_timeout_s
        pause = 0.25
        while True:
            status, answer = self.call("POST", "/v1/sandboxes", body, max(1.0, deadline - time.monotonic()))
            if status != 429 or time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
            pause = min(5.0, pause * 2)
        if status != 200:
            raise SandboxError(f"sandbox pool {self.url}: no sandbox for {task_id} ({image}): "
                               f"HTTP {status}: {answer.get('error', '')}")
        box = PoolSandbox(self, answer)
        if writable_root and not box.writable_root:  # a pool older than the field ignores it
            box.close()
            raise SandboxError(f"sandbox pool {self.url}: no sandbox for {task_id} ({image}): the pool gave a "
                               "read-only root where a writable root was asked for (a pool older than writable_root)")
        return box

    def keep_warm(self, image: str, count: int, limits: Limits | None = None, *, fill: bool = True) -> None:
        body: dict[str, Any] = {"image": image, "count": count}
        if limits is not None:
            body["limits"] = asdict(limits)
        status, answer = self.call("POST", "/v1/warm", body, 600.0)
        if status != 200:
            raise SandboxError(f"sandbox pool {self.url}: warm {image}: HTTP {status}: {answer.get('error', '')}")

    def metrics(self) -> str:
        req = urllib.request.Request(self.url + "/metrics", headers={"Authorization": self._authorization})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read().decode()


# ---------------------------------------------------------------------------------------------
# the entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sandboxes.pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "posttrain"))
    p.add_argument("--run", required=True, help="the run's Kubernetes name (label posttrain.dev/run of its pods)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in the pool's pod (its Service reaches the pod IP)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-sandboxes", type=int, default=64, help="pods at once, warm ones included")
    p.add_argument("--cpus", type=float, default=1.0, help="default and maximum CPUs per sandbox")
    p.add_argument("--memory-gib", type=float, default=2.0, help="default and maximum memory per sandbox")
    p.add_argument("--wall-s", type=float, default=Limits.wall_s, help="default and maximum wall time per sandbox")
    p.add_argument("--command-timeout-s", type=float, default=120.0, help="an exec's timeout when the request gives none")
    p.add_argument("--runtime-class", default="gvisor", choices=k8s.RUNTIME_CLASSES)
    p.add_argument("--cpu-request-fraction", type=float, default=k8s.PodSettings.cpu_request_fraction)
    p.add_argument("--memory-request-fraction", type=float, default=k8s.PodSettings.memory_request_fraction)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--lease-s", type=float, default=60.0)
    p.add_argument("--client-idle-s", type=float, default=900.0, help="0: never close an idle sandbox")
    p.add_argument("--warm", action="append", default=[], metavar="IMAGE=N", help="keep N ready pods of IMAGE")
    p.add_argument("--kubeconfig", help="default: in-cluster, else ~/.kube/config")
    p.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S,
                   help="a request's line, headers and body must arrive within this; also each answer's write")
    args = p.parse_args(argv)
    for spec in args.warm:
        image, sep, count = spec.rpartition("=")
        if not sep or not image or not count.isdigit():
            p.error(f"--warm {spec!r}: expected IMAGE=N (a registry reference, '=', a count)")
    if args.max_sandboxes < 1:
        p.error(f"--max-sandboxes must be >= 1, got {args.max_sandboxes}")
    if args.request_timeout_s <= 0:
        p.error(f"--request-timeout-s must be > 0, got {args.request_timeout_s:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    from kubernetes import client, config

    args = parse_args(argv)
    try:
        credential = process_credential()
    except ValueError as exc:
        print(f"sandbox pool: {exc}", file=sys.stderr)
        return 2
    if credential.source == "generated":
        print(f"sandbox pool: neither ${CREDENTIAL_ENV} nor ${CREDENTIAL_FILE_ENV} is set: no client can call it; "
              "give it the run's credential (the trainer's)", file=sys.stderr, flush=True)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=args.kubeconfig)
    settings = k8s.PodSettings(namespace=args.namespace, runtime_class=args.runtime_class,
                               cpu_request_fraction=args.cpu_request_fraction,
                               memory_request_fraction=args.memory_request_fraction)
    limits = Limits(cpus=args.cpus, memory_mib=int(args.memory_gib * 1024), wall_s=args.wall_s)
    cfg = PoolConfig(run=args.run, settings=settings, max_sandboxes=args.max_sandboxes, default_limits=limits,
                     start_timeout_s=args.start_timeout_s, lease_s=args.lease_s,
                     client_idle_s=args.client_idle_s or None, command_timeout_s=args.command_timeout_s,
                     owner_pod=os.environ.get("POD_NAME"), owner_uid=os.environ.get("POD_UID"))
    pool = SandboxPool(cfg, client.ApiClient())
    pool.start_background()
    print(f"sandbox pool {cfg.instance}: reaped {len(pool.reap())} pods of dead owners", flush=True)
    for spec in args.warm:
        image, _, count = spec.rpartition("=")
        pool.keep_warm(image, int(count), fill=False)
    threading.Thread(target=pool._safe_fill, args=(None,), daemon=True).start()
    server = make_server(pool, args.host, args.port, credential=credential, request_timeout_s=args.request_timeout_s)
    print(f"sandbox pool {cfg.instance}: serving on {args.host}:{server.server_address[1]} (namespace {args.namespace}, "
          f"run {args.run}, at most {args.max_sandboxes} sandboxes)", flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        pool.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
