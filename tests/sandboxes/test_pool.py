"""The sandbox pool against the real ``kubernetes`` client and a fake API server on loopback.

No Kubernetes API server can run here. :class:`FakeKube` stands in for it: a threaded HTTP server
on 127.0.0.1 that serves the REST paths the client calls (pods: create, read, list, delete;
coordination Leases: create, read, merge-patch, delete) and the pod ``attach`` websocket (RFC 6455
framing, the ``v5.channel.k8s.io`` channel protocol). Its "kubelet" turns a created pod Pending on
the first read and Running on the next, and runs the pod's container command, pxd, as a plain
process on a folder seeded with the image's files (no gVisor here: the fake replaces the node, not
the sandbox). Everything from ``kubernetes.client`` and ``kubernetes.stream`` down to the socket
is the real client code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evals.sandbox import InfraError, PlatformSandbox
from sandboxes import k8s, pool
from sandboxes.client import PxdConnectionError
from sandboxes.runtimes import Limits, compiled_pxd

PXD = Path(pool.__file__).with_name("pxd.py")
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455
IMAGE = "registry.local/tasks/calc:1"


def _now_rfc3339(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def _merge(dst: dict, patch: dict) -> None:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif v is None:
            dst.pop(k, None)
        else:
            dst[k] = v


class FakeKube:
    """A fake API server + kubelet for the paths the pool uses. ``images`` maps an image reference to
    the files of its workspace; an image that is not there fails to pull (``ErrImagePull``)."""

    def __init__(self, images: dict[str, dict[str, str]]):
        self.images = images
        self.pods: dict[tuple[str, str], dict] = {}
        self.leases: dict[tuple[str, str], dict] = {}
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.reads: dict[tuple[str, str], int] = {}
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.rv = 0
        self.tmp = Path(tempfile.mkdtemp(prefix="fake-kubelet-"))
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def _reply(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else {}

            def _route(self, method: str) -> None:
                url = urllib.parse.urlparse(self.path)
                fake.log.append((method, url.path))
                query = dict(urllib.parse.parse_qsl(url.query))
                parts = url.path.strip("/").split("/")
                try:
                    if self.headers.get("Upgrade", "").lower() == "websocket" and parts[-1] == "attach":
                        return fake.attach(self, parts[3], parts[5])
                    status, obj = fake.handle(method, parts, query, self._body() if method in ("POST", "PATCH") else {})
                except KeyError as exc:
                    status, obj = 404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                        "message": f"{exc.args[0]} not found", "code": 404}
                self._reply(status, obj)

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PATCH(self):
                self._route("PATCH")

            def do_DELETE(self):
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def api_client(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for key in list(self.procs):
            self._kill(key)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- REST ---------------------------------------------------------------------------------

    def _stamp(self, obj: dict) -> dict:
        self.rv += 1
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", hashlib.sha256(f"{meta.get('name')}/{self.rv}".encode()).hexdigest()[:32])
        meta.setdefault("creationTimestamp", _now_rfc3339())
        meta["resourceVersion"] = str(self.rv)
        return obj

    def handle(self, method: str, parts: list[str], query: dict, body: dict) -> tuple[int, dict]:
        # /api/v1/namespaces/NS/pods[/NAME]  or  /apis/coordination.k8s.io/v1/namespaces/NS/leases[/NAME]
        if parts[:2] == ["api", "v1"]:
            ns, kind, rest = parts[3], parts[4], parts[5:]
        else:
            ns, kind, rest = parts[4], parts[5], parts[6:]
        store = {"pods": self.pods, "leases": self.leases}[kind]
        with self.lock:
            if not rest and method == "POST":
                key = (ns, body["metadata"]["name"])
                if key in store:
                    return 409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists", "code": 409,
                                 "message": f"{kind} {key[1]!r} already exists"}
                body["metadata"]["namespace"] = ns
                if kind == "pods":
                    body["status"] = {"phase": "Pending"}
                store[key] = self._stamp(body)
                return 201, store[key]
            if not rest and method == "GET":
                want = dict(kv.split("=", 1) for kv in query.get("labelSelector", "").split(",") if kv)
                items = [o for (n, _), o in store.items() if n == ns
                         and all(o["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
                return 200, {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self.rv)},
                             "items": items}
            key = (ns, rest[0])
            if key not in store:
                raise KeyError(f"{kind} {rest[0]}")
            if method == "GET":
                if kind == "pods":
                    self._kubelet(key)
                return 200, store[key]
            if method == "PATCH":
                _merge(store[key], body)
                return 200, self._stamp(store[key])
            if method == "DELETE":
                obj = store.pop(key)
                if kind == "pods":
                    self._kill(key)
                return 200, obj
        return 405, {"kind": "Status", "message": "method not allowed", "code": 405}

    # -- the kubelet ----------------------------------------------------------------------------

    def _kubelet(self, key) -> None:
        """Pending on the first read; then Running with pxd started (or stuck pulling the image)."""
        pod = self.pods[key]
        self.reads[key] = self.reads.get(key, 0) + 1
        if pod["status"]["phase"] != "Pending" or self.reads[key] < 2:
            return
        container = pod["spec"]["containers"][0]
        image = container["image"]
        if image not in self.images:
            pod["status"]["containerStatuses"] = [{
                "name": "sandbox", "image": image, "imageID": "", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull", "message": f"pull access denied for {image}"}}}]
            return
        workspace = self.tmp / key[1]
        workspace.mkdir()
        for name, text in self.images[image].items():
            (workspace / name).write_text(text)
        argv = container["command"]
        assert argv[:3] == [k8s.PodSettings().pxd_python, "-I", "-S"] and argv[3] == k8s.PodSettings().pxd_path
        # the node's python and the repository's pxd stand in for the image's
        argv = [sys.executable, "-I", "-S", str(compiled_pxd(sys.executable)), "--workspace", str(workspace), *argv[6:]]
        self.procs[key] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, cwd=workspace)
        pod["spec"]["nodeName"] = "node-1"
        pod["status"] = {"phase": "Running", "containerStatuses": [{
            "name": "sandbox", "image": image, "imageID": image, "ready": True, "restartCount": 0,
            "state": {"running": {"startedAt": _now_rfc3339()}}}]}

    def _kill(self, key) -> None:
        proc = self.procs.pop(key, None)
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    # -- attach (RFC 6455 server side, v5.channel.k8s.io) ---------------------------------------

    def attach(self, handler: BaseHTTPRequestHandler, ns: str, name: str) -> None:
        proc = self.procs.get((ns, name))
        if proc is None:
            return handler._reply(400, {"kind": "Status", "code": 400, "message": f"pod {name} is not running"})
        accept = base64.b64encode(hashlib.sha1((handler.headers["Sec-WebSocket-Key"] + GUID).encode()).digest())
        handler.send_response(101)
        handler.send_header("Upgrade", "websocket")
        handler.send_header("Connection", "Upgrade")
        handler.send_header("Sec-WebSocket-Accept", accept.decode())
        handler.send_header("Sec-WebSocket-Protocol", "v5.channel.k8s.io")
        handler.end_headers()
        handler.close_connection = True
        rfile, wfile = handler.rfile, handler.wfile
        send_lock = threading.Lock()

        def send(opcode: int, payload: bytes) -> None:
            n = len(payload)
            head = bytes([0x80 | opcode]) + (bytes([n]) if n < 126 else
                                             bytes([126]) + struct.pack(">H", n) if n < 65536 else
                                             bytes([127]) + struct.pack(">Q", n))
            with send_lock:
                wfile.write(head + payload)
                wfile.flush()

        def pump_out() -> None:
            fd = proc.stdout.fileno()
            try:
                while True:
                    import os

                    data = os.read(fd, 65536)
                    if not data:
                        break
                    send(2, b"\x01" + data)
                send(8, struct.pack(">H", 1000))
            except (OSError, ValueError):
                pass

        threading.Thread(target=pump_out, daemon=True).start()
        try:
            while True:
                b0, b1 = rfile.read(2)
                n = b1 & 0x7F
                if n == 126:
                    n = struct.unpack(">H", rfile.read(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", rfile.read(8))[0]
                mask = rfile.read(4) if b1 & 0x80 else b"\0\0\0\0"
                data = bytes(c ^ mask[i % 4] for i, c in enumerate(rfile.read(n)))
                opcode = b0 & 0x0F
                if opcode == 8:
                    break
                if opcode in (1, 2) and data[:1] == b"\x00":
                    proc.stdin.write(data[1:])
                    proc.stdin.flush()
                elif opcode == 2 and data[:2] == b"\xff\x00":  # v5: the client closed stdin
                    break
        except (OSError, ValueError):
            pass
        try:  # stdinOnce: the process's stdin closes with the (only) attach session
            proc.stdin.close()
        except OSError:
            pass


@pytest.fixture
def kube():
    fake = FakeKube({IMAGE: {"calc.py": "def add(a, b):\n    return a + b\n"}, "registry.local/tasks/other:1": {}})
    yield fake
    fake.close()


def make_pool(kube: FakeKube, **kw) -> pool.SandboxPool:
    cfg = dict(run="Demo Run", settings=k8s.PodSettings(namespace="rl"), poll_s=0.01, start_timeout_s=60,
               owner_pod="demo-sandbox-pool-7d9f", owner_uid="0f0e0d0c-pool-uid",
               default_limits=Limits(cpus=2, memory_mib=4096, wall_s=900))
    cfg.update(kw)
    return pool.SandboxPool(pool.PoolConfig(**cfg), kube.api_client())


@pytest.fixture
def served(kube):
    p = make_pool(kube)
    p.renew_lease()
    server = pool.make_server(p, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield p, pool.PoolClient(f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()
    p.shutdown()


def test_an_episode_pod_is_created_connected_to_and_deleted(kube, served):
    p, client = served
    with client.start(IMAGE, task_id="bundled/calc", episode="step_000004-g3-a2") as box:
        name = box.pod
        created = kube.pods[("rl", name)]
        # the pod is sandboxes.k8s.pod_spec's, with the pool's owner label and owner reference
        labels = created["metadata"]["labels"]
        assert {k: labels[k] for k in k8s.sandbox_selector("Demo Run")} == k8s.sandbox_selector("Demo Run")
        assert labels[pool.OWNER_LABEL] == p.config.instance
        assert created["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "blockOwnerDeletion": False,
                                                           "name": "demo-sandbox-pool-7d9f", "uid": "0f0e0d0c-pool-uid"}]
        spec = created["spec"]
        assert spec["runtimeClassName"] == "gvisor" and spec["containers"][0]["stdinOnce"] is True
        assert spec["containers"][0]["resources"]["requests"]["cpu"] == "500m"  # 25 % of 2 CPUs
        assert ("GET", f"/api/v1/namespaces/rl/pods/{name}/attach") in kube.log
        # the harness's surface, through pxd inside the pod
        result = box.exec("python3 -c 'import calc; print(calc.add(2, 3))'")
        assert (result.exit_code, result.output) == (0, "5\n")
        box.write_file("notes/a.txt", b"\x00binary\xff")
        assert box.read_file("notes/a.txt") == b"\x00binary\xff"
        assert box.exec("exit 3").exit_code == 3
        assert box.exec("echo 1 passed >&3", results_fd=3).results == b"1 passed\n"
        assert box.runtime.name == "gvisor"
        wrapped = PlatformSandbox(box)
        with pytest.raises(FileNotFoundError):
            wrapped.read_file("missing.txt")
        proc = kube.procs[("rl", name)]
    assert ("rl", name) not in kube.pods  # deleted when the episode ended
    assert proc.wait() is not None
    text = client.metrics()
    assert "posttrain_sandbox_starts_total 1" in text
    assert 'posttrain_sandbox_pods{state="busy"} 0' in text


def test_a_pod_that_disappears_is_an_infrastructure_error(kube, served):
    p, client = served
    box = client.start(IMAGE, task_id="calc", episode="e1")
    del kube.pods[("rl", box.pod)]
    kube._kill(("rl", box.pod))  # evicted or deleted behind the pool's back
    with pytest.raises(InfraError, match=f"sandbox {box.id}"):
        PlatformSandbox(box).exec("true")
    with pytest.raises(PxdConnectionError):
        box.read_file("calc.py")
    assert p.get(box.id) is None


def test_an_image_that_cannot_be_pulled_fails_fast_and_its_pod_is_deleted(kube):
    p = make_pool(kube)
    with pytest.raises(pool.SandboxError, match="cannot start: ErrImagePull: pull access denied for registry.local/nope:1"):
        p.acquire("registry.local/nope:1", task_id="t", episode="e")
    assert not kube.pods and p.metrics.start_failures == 1


def test_pods_left_by_a_dead_owner_are_reaped(kube):
    """A pool process that died (its Lease no longer renewed) leaves its pods; the next pool deletes them."""
    first = make_pool(kube, instance="pool-first")
    first.renew_lease()
    orphan = first.acquire(IMAGE, task_id="calc", episode="e1")
    orphan_proc = kube.procs[("rl", orphan.pod_name)]
    alive_owner = make_pool(kube, instance="pool-alive")
    alive_owner.renew_lease()
    kept = alive_owner.acquire(IMAGE, task_id="calc", episode="e2")
    # the first pool dies without cleaning up: its Lease ran out long ago
    kube.leases[("rl", "sandbox-owner-pool-first")]["spec"]["renewTime"] = "2020-01-01T00:00:00.000000Z"
    # a pod of this run that names no owner at all, and one of another run
    for run, episode in (("Demo Run", "stray"), ("another run", "theirs")):
        stray = k8s.pod_spec(run=run, task_id="calc", episode=episode, image=IMAGE, settings=k8s.PodSettings(namespace="rl"))
        stray["status"] = {"phase": "Running"}
        kube.pods[("rl", stray["metadata"]["name"])] = stray
    stray_name, other_run = k8s.pod_name("Demo Run", "stray"), k8s.pod_name("another run", "theirs")
    second = make_pool(kube, instance="pool-second")
    second.renew_lease()
    # and one that names the second pool but that it does not hold (its start failed half-way)
    debris = k8s.pod_spec(run="Demo Run", task_id="calc", episode="debris", image=IMAGE, settings=k8s.PodSettings(namespace="rl"))
    debris["metadata"]["labels"][pool.OWNER_LABEL] = "pool-second"
    kube.pods[("rl", debris["metadata"]["name"])] = debris
    assert sorted(second.reap()) == sorted([orphan.pod_name, stray_name, debris["metadata"]["name"]])
    assert orphan_proc.wait() is not None  # its pxd is gone with the pod
    assert ("rl", "sandbox-owner-pool-first") not in kube.leases
    assert {n for _, n in kube.pods} == {kept.pod_name, other_run}
    assert kept.exec("echo alive").output == "alive\n"
    assert "posttrain_sandbox_reaped_total 3" in second.metrics_text()
    kept.close()
    first.shutdown()
    alive_owner.shutdown()
    second.shutdown()


def test_warm_pods_are_cache_hits_and_are_evicted_for_room(kube):
    p = make_pool(kube, max_sandboxes=2)
    p.keep_warm(IMAGE, 1)
    assert len(kube.pods) == 1 and p.metrics.starts == 1
    warm_pod = next(iter(kube.pods))[1]
    box = p.acquire(IMAGE, task_id="calc", episode="e1")
    assert box.pod_name == warm_pod and box.cache_hit and p.metrics.warm_hits == 1
    claimed = kube.pods[("rl", warm_pod)]
    assert claimed["metadata"]["labels"]["posttrain.dev/episode"] == "e1"
    assert claimed["spec"]["activeDeadlineSeconds"] <= 900 + 1  # cut back to the episode's wall time
    p.wait_refills()  # a replacement warm pod started behind it
    assert len(kube.pods) == 2 and p.metrics.starts == 2
    refill = next(pod for (_, name), pod in kube.pods.items() if name != warm_pod)
    assert refill["spec"]["activeDeadlineSeconds"] == 900 + 450  # wall time + the longest a warm pod waits
    # placed where the image already is: the node that ran the first pod is preferred
    terms = refill["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["preference"]["matchExpressions"][0]["values"] == ["node-1"]
    assert p.metrics.image_local == 1
    # full (one busy, one warm): a request for another image evicts the idle warm pod
    other = p.acquire("registry.local/tasks/other:1", task_id="other", episode="e2")
    assert p.metrics.evictions == 1 and not other.cache_hit
    with pytest.raises(pool.PoolFull, match="the pool is full: 2 sandboxes"):
        p.acquire(IMAGE, task_id="calc", episode="e3")
    text = p.metrics_text()
    for line in ("posttrain_sandbox_warm_hits_total 1", "posttrain_sandbox_evictions_total 1",
                 'posttrain_sandbox_pods{state="busy"} 2', 'posttrain_sandbox_pods{state="warm"} 0'):
        assert line in text
    p.shutdown()
    assert not kube.pods


def test_the_pool_refuses_bad_requests_with_clear_errors(kube, served):
    p, client = served
    status, answer = client.call("POST", "/v1/sandboxes", {"image": IMAGE, "limits": {"cpu": 1}}, 30)
    assert status == 400 and "limits: unknown key(s) cpu" in answer["error"]
    status, answer = client.call("POST", "/v1/sandboxes", {"image": IMAGE, "limits": {"cpus": 64}}, 30)
    assert status == 400 and "limits.cpus = 64 is above the pool's maximum 2" in answer["error"]
    status, answer = client.call("POST", "/v1/sandboxes", {"image": "two words"}, 30)
    assert status == 400 and "image must be a registry reference" in answer["error"]
    status, answer = client.call("POST", "/v1/sandboxes/nobody/exec", {"shell": "true"}, 30)
    assert status == 404 and answer["gone"]
    assert not kube.pods


def test_the_pool_entry_point_serves_episodes_and_cleans_up_on_sigterm(kube, tmp_path):
    """``python -m sandboxes.pool`` as the Deployment runs it, with a kubeconfig naming the fake."""
    import os
    import signal

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "pool", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "pool"}}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(POD_NAME="demo-sandbox-pool-0", POD_UID="uid-of-the-pool-pod")
    proc = subprocess.Popen([sys.executable, "-m", "sandboxes.pool", "--namespace", "rl", "--run", "demo",
                             "--host", "127.0.0.1", "--port", "0", "--cpus", "1", "--memory-gib", "1",
                             "--kubeconfig", str(kubeconfig)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=Path(pool.__file__).parents[1])
    try:
        line = ""
        while "serving on" not in line:
            line = proc.stdout.readline()
            assert line, "the pool exited before it served"
        port = int(line.split("serving on 127.0.0.1:")[1].split()[0])
        client = pool.PoolClient(f"http://127.0.0.1:{port}")
        box = client.start(IMAGE, task_id="calc", episode="e1")
        assert box.exec("ls").output.split() == ["calc.py"]
        pod = kube.pods[("rl", box.pod)]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-of-the-pool-pod"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1024Mi"
        assert [name for _, name in kube.leases] == [f"sandbox-owner-{pod['metadata']['labels'][pool.OWNER_LABEL]}"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not kube.pods and not kube.leases  # its pods and its Lease went with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_pool_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        pool.parse_args(["--run", "demo", "--warm", "registry.local/calc:1"])
    assert "--warm 'registry.local/calc:1': expected IMAGE=N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pool.parse_args(["--run", "demo", "--max-sandboxes", "0"])
    assert "--max-sandboxes must be >= 1, got 0" in capsys.readouterr().err


def test_a_silent_client_and_an_expired_sandbox_lose_their_pods(kube):
    """A trainer that died sends nothing more: after --client-idle-s its sandboxes are deleted; a
    sandbox past its wall time is deleted even while its client keeps calling."""
    p = make_pool(kube, client_idle_s=600.0)
    silent = p.acquire(IMAGE, task_id="calc", episode="e1")
    busy = p.acquire(IMAGE, task_id="calc", episode="e2")
    silent.last_used -= 601  # as if ten minutes had passed since its last call
    assert p.close_idle() == [silent.id]
    assert ("rl", silent.pod_name) not in kube.pods and ("rl", busy.pod_name) in kube.pods
    with pytest.raises(PxdConnectionError, match="its client sent nothing for 600 s"):
        silent.exec("true")
    busy.claimed_at -= 901  # past its 900 s wall time
    assert p.close_expired() == [busy.id]
    with pytest.raises(PxdConnectionError, match="reached its wall-time limit of 900 s"):
        busy.read_file("calc.py")
    assert not kube.pods


def test_the_harness_sandbox_factory_runs_a_task_in_a_pool_pod(kube, served, monkeypatch):
    """``platform_sandbox_factory("k8s")``, what the trainer uses with ``sandbox_runtime = "k8s"``:
    the harness gets a :class:`PlatformSandbox` over a pool pod, results channel included."""
    from evals.sandbox import POOL_URL_VARIABLE, platform_sandbox_factory
    from evals.tasks import ResourceLimits, Task

    p, client = served
    task = Task(id="bundled/calc", source="bundled", language="python", instruction="fix add",
                target_tests=("tests.test_calc.test_add",), existing_tests=(), test_command="true",
                report_format="junit", report_paths=(".pytest-report.xml",), image=IMAGE,
                limits=ResourceLimits(agent_timeout_s=600.0, test_timeout_s=120.0))  # within the pool's 900 s
    monkeypatch.delenv(POOL_URL_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=POOL_URL_VARIABLE):
        platform_sandbox_factory("k8s")
    monkeypatch.setenv(POOL_URL_VARIABLE, client.url)
    with platform_sandbox_factory("k8s")(task) as sandbox:
        assert isinstance(sandbox, PlatformSandbox) and sandbox.supports_results
        assert len(kube.pods) == 1
        result = sandbox.exec("cat calc.py; echo graded >&3", results_fd=3)
        assert "return a + b" in result.output and result.results == b"graded\n"
        sandbox.write_file("notes.txt", b"from the harness")
        assert sandbox.read_file("notes.txt") == b"from the harness"
    assert not kube.pods  # the episode's pod went with the sandbox
    no_image = Task(**{**task.__dict__, "image": None, "repo_path": "/nowhere"})
    with pytest.raises(InfraError, match="names no image"):
        with platform_sandbox_factory("k8s")(no_image):
            pass


def test_a_full_pool_makes_the_client_wait_for_a_slot_not_fail(kube):
    """More episodes in flight than the pool has slots (the 2-core node's run: 8 episode workers, 4
    sandboxes): the pool answers 429 and the client waits until a slot frees, within its timeout."""
    p = make_pool(kube, max_sandboxes=1)
    p.renew_lease()
    server = pool.make_server(p, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = pool.PoolClient(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        first = client.start(IMAGE, task_id="bundled/calc", episode="a")
        with pytest.raises(pool.SandboxError, match="HTTP 429: the pool is full: 1 sandboxes"):
            client.start(IMAGE, task_id="bundled/calc", episode="b", start_timeout_s=1.0)
        threading.Timer(1.0, first.close).start()  # the slot frees while the second waits
        with client.start(IMAGE, task_id="bundled/calc", episode="c", start_timeout_s=60.0) as second:
            assert second.exec("python3 -c 'import calc; print(calc.add(1, 1))'").output == "2\n"
        assert first.closed
    finally:
        server.shutdown()
        server.server_close()
        p.shutdown()
