"""Pods that run: the sandbox pool and plain pods on a real node of the kube-local plane.

Needs ``bash scripts/kube-local.sh start-node`` (root: a kubelet, kube-scheduler and
kube-controller-manager built from Debian's kubernetes source, containerd and runc from Debian,
gVisor's runsc as RuntimeClass ``gvisor``, images built from this machine's files); skipped, saying
so, when the plane has no Ready node; with ``POSTTRAIN_KUBE_NODE=1`` (``POSTTRAIN_KUBE_NODE=1 bash
scripts/test.sh``) the module starts the node itself and stops it afterwards.

Then the workload image (scripts/build-image.sh, ./Containerfile) in a pod locked down as the run's
manifests lock every workload container (uid 1000, read-only root, every capability dropped, /tmp an
emptyDir): the project installed in the image's venv, not editable, every entry point the manifests
run importable, vLLM's CPU build and torch included.

The last test is the run as pods: ``rl_run`` materialized in Dagster with the Kubernetes launcher
for ``examples/embedded-k8s.toml`` (its two images built here when missing, with
``POSTTRAIN_KUBE_NODE=1``: about 10 minutes the first time): the trainer Job's pod against the
run's router (one vLLM CPU engine pod) and sandbox pool (gVisor pods, the task's repository copied
in), Pipes messages as ``rl_run`` observations, two steps, a checkpoint on the run volume, then the
checkpoint's ``deepswe_eval`` in an eval pod of the run on the same engine and pool. Slow.

The pool acts with its own service account's token (the run's Role), creates the episode's pod from
``sandboxes.k8s.pod_spec`` under gVisor, attaches to pxd over the API server's websocket (through
the kubelet), and the trainer's side reaches it through the pool's HTTP API, as an episode does.
With PodSecurityPolicy admission on (scripts/kube-local.sh), the controllers create the run's own
pods under ``posttrain-workload``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from sandboxes import k8s as sandbox_k8s
from sandboxes.pool import PoolClient, PoolConfig, SandboxPool, make_server
from tests.kube.conftest import plane_lock, token_client
from tests.kube.test_apply import example_in
from training.planner import k8s, resolve, runner

NODE = "posttrain-node"
_SANDBOXES = Path(__file__).resolve().parents[2] / "sandboxes"
# scripts/kube-local.sh IMAGES_REV: the images' revision and the pxd the python image carries
IMAGES_REV = "4-" + hashlib.sha256(b"".join((_SANDBOXES / name).read_bytes()
                                            for name in ("pxd.py", "standalone.py"))).hexdigest()[:12]
IMAGE = f"posttrain.local/python:{IMAGES_REV}"


def _node_ready(admin) -> bool | None:
    """True when the plane's node is Ready, False when it is there but not Ready, None when absent."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        found = client.CoreV1Api(admin).read_node(NODE)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return {c.type: c.status for c in found.status.conditions or []}.get("Ready") == "True"


@pytest.fixture(scope="module")
def node(admin, kubeconfig):
    """The plane's node: one already there, or with ``POSTTRAIN_KUBE_NODE=1`` one this module starts
    (``kube-local.sh start-node``: root) and stops afterwards, Node object included, so later tests
    see a plane without one. The first time on a machine it builds the node's binaries (``kube-local.sh
    build node``, 2-9 minutes) before it takes the plane from the tests that stand in for the controllers."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "kube-local.sh")
    start = _node_ready(admin) is None and os.environ.get("POSTTRAIN_KUBE_NODE") == "1"
    if start:  # the node's binaries built (the first time on a machine) before the plane is taken
        done = subprocess.run(["bash", script, "build", "node"], capture_output=True, text=True, timeout=45 * 60)
        if done.returncode != 0:
            pytest.fail(f"kube-local.sh build node failed: {done.stderr[-2000:]}")
    # no test that stands in for the controllers (conftest.no_controllers) runs while this module's node is up
    with plane_lock(kubeconfig, exclusive=True):
        started = False
        if start and _node_ready(admin) is None:
            done = subprocess.run(["bash", script, "start-node"], capture_output=True, text=True, timeout=45 * 60)
            if done.returncode != 0:
                pytest.fail(f"kube-local.sh start-node failed: {done.stderr[-2000:]}")
            started = True
        try:
            ready = _node_ready(admin)
            if ready is None:
                pytest.skip("no node on this plane: `bash scripts/kube-local.sh start-node` (root), or "
                            "POSTTRAIN_KUBE_NODE=1 for scripts/test.sh")
            if not ready:
                pytest.skip(f"node {NODE} is not Ready")
            yield NODE
        finally:
            if started:
                subprocess.run(["bash", script, "stop-node"], capture_output=True, text=True, timeout=300)


def wait_phase(core, namespace: str, name: str, phases: tuple[str, ...], timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase in phases:
            return pod
        time.sleep(0.5)
    raise AssertionError(f"pod {name} not {phases} within {timeout_s} s: {pod.status}")


def test_a_gvisor_pod_runs_and_exec_goes_through_the_kubelet(admin, namespace, node):
    from kubernetes import client
    from kubernetes.stream import stream

    core = client.CoreV1Api(admin)
    for name, runtime in (("under-runc", None), ("under-gvisor", "gvisor")):
        spec = {"automountServiceAccountToken": False, "restartPolicy": "Never", "containers": [{
            "name": "main", "image": IMAGE, "imagePullPolicy": "Never",
            "command": ["/usr/bin/python3", "-c", "import os, time; print(os.uname().release, flush=True); time.sleep(600)"]}]}
        if runtime:
            spec["runtimeClassName"] = runtime
        core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": spec})
    kernels = {}
    for name in ("under-runc", "under-gvisor"):
        pod = wait_phase(core, namespace, name, ("Running",))
        assert pod.spec.node_name == node
        kernels[name] = stream(core.connect_get_namespaced_pod_exec, name, namespace, command=[
            "/usr/bin/python3", "-c", "import os; print(os.uname().release)"], stdout=True, stderr=True, stdin=False,
            tty=False).strip()
    print("kernels seen by exec:", kernels)
    assert kernels["under-gvisor"] == "4.4.0"  # gVisor's own kernel
    assert kernels["under-runc"] != "4.4.0"  # the machine's

    # a container under gVisor that exits is seen to end
    core.create_namespaced_pod(namespace, {"metadata": {"name": "short"}, "spec": {
        "runtimeClassName": "gvisor", "restartPolicy": "Never", "automountServiceAccountToken": False,
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                        "command": ["/usr/bin/python3", "-c", "print('done')"]}]}})
    assert wait_phase(core, namespace, "short", ("Succeeded", "Failed")).status.phase == "Succeeded"
    for name in ("under-runc", "under-gvisor", "short"):
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def test_an_episode_gets_a_gvisor_sandbox_pod_through_the_pool_and_its_api(admin, namespace, node):
    """The pool with its own token, its HTTP API, and the trainer's client: an episode's sandbox."""
    import threading

    from kubernetes import client

    manifests = k8s.build_manifests(resolve(example_in(namespace, "nodetest")))
    runner.apply_k8s([m for m in manifests if m["kind"] in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding")],
                     api_client=admin)
    pool = SandboxPool(PoolConfig(run="nodetest", settings=sandbox_k8s.PodSettings(namespace=namespace),
                                  start_timeout_s=120.0), token_client(admin, namespace, "nodetest-sandbox-pool"))
    server = make_server(pool, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    selector = ",".join(f"{k}={v}" for k, v in sandbox_k8s.sandbox_selector("nodetest").items())
    core = client.CoreV1Api(admin)
    try:
        started = time.monotonic()
        with PoolClient(f"http://127.0.0.1:{server.server_address[1]}").start(
                IMAGE, task_id="calc/add", episode="step_000001-g0-a0") as box:
            start_s = time.monotonic() - started
            result = box.exec("python3 calc.py; uname -r; id -u")
            box.write_file("notes.txt", b"hi")
            assert box.read_file("notes.txt") == b"hi"
            [pod] = core.list_namespaced_pod(namespace, label_selector=selector).items
        print(f"sandbox pod {pod.metadata.name} on {pod.spec.node_name} in {start_s:.1f} s: {result.output!r}")
        assert result.exit_code == 0 and result.output.split() == ["4", "4.4.0", "1000"]
        assert pod.spec.runtime_class_name == "gvisor" and pod.spec.node_name == node
        deadline = time.monotonic() + 30
        while core.list_namespaced_pod(namespace, label_selector=selector).items and time.monotonic() < deadline:
            time.sleep(0.5)
        assert core.list_namespaced_pod(namespace, label_selector=selector).items == []  # deleted at close
    finally:
        server.shutdown()
        pool.shutdown()


def test_the_controllers_create_the_runs_pods_under_the_workload_policy(admin, namespace, node):
    """With PodSecurityPolicy admission on, the run's pods are created by the controllers (ReplicaSet,
    StatefulSet, Job), which may use ``posttrain-workload``; no account of the run may. Each
    workload gets its pod admitted under that policy (they stay Pending here: the example asks for
    GPUs and a ReadWriteMany volume), and the pool's pod gets its token."""
    from kubernetes import client

    manifests = k8s.build_manifests(resolve(example_in(namespace, "podsec")))
    runner.apply_k8s(manifests, api_client=admin)
    core = client.CoreV1Api(admin)
    wanted = {"trainer", "engine", "router", "sandbox-pool"}
    deadline = time.monotonic() + 120
    seen: dict[str, object] = {}
    while time.monotonic() < deadline and set(seen) != wanted:
        for pod in core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/instance=podsec").items:
            seen.setdefault(pod.metadata.labels["app.kubernetes.io/component"], pod)
        time.sleep(0.5)
    events = [f"{e.involved_object.kind}/{e.involved_object.name}: {e.reason}: {e.message}"
              for e in core.list_namespaced_event(namespace).items if e.reason == "FailedCreate"]
    assert set(seen) == wanted, events
    for component, pod in seen.items():
        assert pod.metadata.annotations["kubernetes.io/psp"] == "posttrain-workload", component
    pool_volumes = [v for v in seen["sandbox-pool"].spec.volumes if v.secret or v.projected]
    assert pool_volumes, "the pool's pod has no service-account token"
    runner.delete_k8s(manifests, api_client=admin)


CLIENT = r"""
import json, socket, ssl, sys, time, urllib.request
ns = sys.argv[1]
deadline = time.monotonic() + 90
def retry(what):
    while True:
        try:
            return what()
        except OSError as exc:
            if time.monotonic() > deadline:
                raise
            print("retry:", exc, file=sys.stderr, flush=True)
            time.sleep(1)
out = {}
out["service_ip"] = retry(lambda: socket.gethostbyname(f"web.{ns}.svc"))
out["served"] = retry(lambda: urllib.request.urlopen(f"http://web.{ns}.svc/served.txt", timeout=5).read().decode())
out["pod_ip"] = retry(lambda: socket.gethostbyname(f"web-0.web-headless.{ns}.svc"))
out["direct"] = retry(lambda: urllib.request.urlopen(f"http://web-0.web-headless.{ns}.svc:8080/served.txt", timeout=5).read().decode())
insecure = ssl.create_default_context()
insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
out["api"] = json.load(retry(lambda: urllib.request.urlopen("https://kubernetes.default.svc/version", timeout=5, context=insecure)))["gitVersion"]
print(json.dumps(out), flush=True)
"""


def test_a_pod_resolves_service_names_reaches_them_and_the_api_server_and_its_claim_binds(admin, namespace, node):
    """The plane a run needs: a claim binds (a hostPath volume under the plane's state folder), a
    Service name resolves (cluster DNS) to its ClusterIP, which answers (kube-proxy), a headless
    Service's pod by its hostname (as the router reaches each engine of a StatefulSet), and the
    ``kubernetes`` Service reaches the API server (as the pool's in-cluster client does)."""
    import json
    import os

    from kubernetes import client

    core = client.CoreV1Api(admin)
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    serve = ("import http.server, functools; open('/data/served.txt', 'w').write('from the claim'); "
             "http.server.ThreadingHTTPServer(('', 8080), functools.partial(http.server.SimpleHTTPRequestHandler, "
             "directory='/data')).serve_forever()")
    core.create_namespaced_pod(namespace, {"metadata": {"name": "web", "labels": {"app": "web"}}, "spec": {
        "hostname": "web-0", "subdomain": "web-headless", "automountServiceAccountToken": False,
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": ["/usr/bin/python3", "-c", serve],
                        "ports": [{"containerPort": 8080}], "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}})
    service = core.create_namespaced_service(namespace, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    core.create_namespaced_service(namespace, {"metadata": {"name": "web-headless"}, "spec": {
        "clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}})
    web = wait_phase(core, namespace, "web", ("Running",), timeout_s=180)
    claim = core.read_namespaced_persistent_volume_claim(namespace=namespace, name="data")
    assert claim.status.phase == "Bound"
    volume = client.CoreV1Api(admin).read_persistent_volume(claim.spec.volume_name)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "client"}, "spec": {
        "restartPolicy": "Never", "automountServiceAccountToken": False,
        "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                        "command": ["/usr/bin/python3", "-c", CLIENT, namespace]}]}})
    done = wait_phase(core, namespace, "client", ("Succeeded", "Failed"), timeout_s=180)
    log = core.read_namespaced_pod_log("client", namespace, _preload_content=False).data.decode()
    print(log)
    assert done.status.phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen == {"service_ip": service.spec.cluster_ip, "served": "from the claim", "pod_ip": web.status.pod_ip,
                    "direct": "from the claim", "api": "v1.20.2"}
    # the claim's volume is a folder of this machine, and the pod wrote there
    with open(os.path.join(volume.spec.host_path.path, "served.txt")) as f:
        assert f.read() == "from the claim"
    for name in ("web", "client"):
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

# --- the run as pods: rl_run with the Kubernetes launcher, and its checkpoint's eval, on this node ---
# (here, not in a file of its own: the node is one per machine, and this module starts and stops it)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embedded-k8s.toml"
IMAGES = {"posttrain.local/posttrain:local": "build-image.sh", "posttrain.local/task-base:local": "build-task-image.sh"}


def node_images(state: Path) -> set[str]:
    sock = state / "node" / "containerd.sock"
    done = subprocess.run(["ctr", "-a", str(sock), "-n", "k8s.io", "images", "ls", "-q"],
                          capture_output=True, text=True, timeout=120)
    return set(done.stdout.split()) if done.returncode == 0 else set()


@pytest.fixture(scope="module")
def images(node, kubeconfig):
    """The run's two images in the node's containerd: there already, or built (root) when the node
    was started for the tests (``POSTTRAIN_KUBE_NODE=1``)."""
    state = Path(kubeconfig).resolve().parent
    missing = [tag for tag in IMAGES if tag not in node_images(state)]
    if missing and os.environ.get("POSTTRAIN_KUBE_NODE") != "1":
        pytest.skip(f"images {', '.join(missing)} are not on the node: sudo bash scripts/build-image.sh and "
                    "scripts/build-task-image.sh (or POSTTRAIN_KUBE_NODE=1)")
    for tag in missing:
        done = subprocess.run(["bash", str(ROOT / "scripts" / IMAGES[tag])], capture_output=True, text=True,
                              timeout=60 * 60, env={**os.environ, "POSTTRAIN_KUBE_STATE": str(state)})
        assert done.returncode == 0, f"scripts/{IMAGES[tag]} failed: {done.stderr[-3000:]}"
    assert set(IMAGES) <= node_images(state)
    return state


WORKLOAD_IMAGE = "posttrain.local/posttrain:local"  # scripts/build-image.sh

PROBE = r"""
import importlib, json, os, sys
for module in ("training.__main__", "serving.replica", "serving.router", "serving.capture", "sandboxes.pool",
               "serving.engines.vllm_server"):
    importlib.import_module(module)
import torch, vllm, training
try:
    open("/opt/posttrain/written-by-the-pod", "w")
    writable = True
except OSError:
    writable = False
print(json.dumps({"uid": os.getuid(), "python": sys.executable, "training": training.__file__, "torch": torch.__version__,
                  "vllm": vllm.__version__, "root_writable": writable, "cwd": os.getcwd()}))
"""


def test_the_image_runs_every_entry_point_as_uid_1000_from_its_own_venv(admin, namespace, images):
    from kubernetes import client

    core = client.CoreV1Api(admin)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "image"}, "spec": {
        "restartPolicy": "Never", "automountServiceAccountToken": False, "securityContext": dict(k8s.POD_SECURITY),
        "containers": [{"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "Never", "command": ["python", "-c", PROBE],
                        "workingDir": k8s.DATA_MOUNT, "env": [{"name": "HOME", "value": "/tmp/home"}],
                        "securityContext": dict(k8s.CONTAINER_SECURITY), "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
        "volumes": [{"name": "tmp", "emptyDir": {}}]}})
    done = wait_phase(core, namespace, "image", ("Succeeded", "Failed"), timeout_s=600)
    log = core.read_namespaced_pod_log("image", namespace, _preload_content=False).data.decode()
    print(log)
    assert done.status.phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert seen["uid"] == 1000 and seen["cwd"] == k8s.DATA_MOUNT and not seen["root_writable"]
    assert seen["python"] == "/opt/posttrain/bin/python"
    assert seen["training"].startswith("/opt/posttrain/lib/python3.11/site-packages/training/")  # installed, not a checkout
    assert seen["torch"].startswith("2.13.0") and seen["vllm"]
    core.delete_namespaced_pod("image", namespace, grace_period_seconds=0)


@pytest.mark.slow
def test_rl_run_and_its_checkpoints_eval_run_as_pods_on_the_node(images, admin, kubeconfig, namespace, monkeypatch):
    import dagster as dg
    from kubernetes import client

    from assets.evals import deepswe_eval
    from assets.partitions import checkpoints_partitions
    from assets.resources import PosttrainStorage, WorkloadLauncher
    from assets.training import rl_run
    from evals.bundled import ensure_suite
    from evals.tasks import load_bundled
    from training.checkpoint import checkpoint_path, list_checkpoints, metrics_dir
    from training.planner.k8s import k8s_name

    run = "pods-run"
    core = client.CoreV1Api(admin)
    # the shared run volume of the example ([kubernetes] volume_claim), as start-node makes it in its
    # namespace; the plane agent binds it to a folder of this machine, which is Dagster's storage root
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "posttrain-data"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}})
    volume = images / "volumes" / namespace / "posttrain-data"
    deadline = time.monotonic() + 60
    while core.read_namespaced_persistent_volume_claim("posttrain-data", namespace).status.phase != "Bound":
        assert time.monotonic() < deadline, "the plane agent did not bind the run volume's claim"
        time.sleep(1)
    suite = ensure_suite(volume / "datasets" / "bundled", per_level=4, rl_per_level=4, extra_eval_per_level=0)
    held_out = [t.id for t in load_bundled(suite).tasks if t.split == "eval"][:2]
    storage = PosttrainStorage(root=str(volume))
    monkeypatch.setenv("POSTTRAIN_TARGET", "k8s")
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    launcher = WorkloadLauncher.from_env()
    instance = dg.DagsterInstance.ephemeral()
    seen_pods: set[str] = set()
    try:
        started = time.monotonic()
        result = dg.materialize(
            [rl_run], instance=instance, resources={"storage": storage, "launcher": launcher},
            run_config={"ops": {"rl_run": {"config": {"run_file": str(EXAMPLE), "overrides": {
                "run": {"name": run}, "kubernetes": {"namespace": namespace},
                "eval": {"task_ids": held_out, "attempts": 1}}}}}})
        assert result.success
        seen_pods |= {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
        run_dir = storage.run_dir(run)
        # the trainer's steps reached Dagster as observations of rl_run while it ran (Pipes messages from
        # the trainer pod's log), and its files are on the volume
        observed = instance.fetch_observations(dg.AssetKey("rl_run"), limit=10, ascending=True).records
        assert [r.event_log_entry.asset_observation.metadata["step"].value for r in observed] == [1, 2]
        import pandas as pd

        steps = pd.read_parquet(metrics_dir(run_dir) / "steps.parquet")
        assert list(steps["step"]) == [1, 2]
        saved = [c.path.name for c in list_checkpoints(run_dir)]
        assert saved[-1] == "step_000002" and (checkpoint_path(run_dir, 2) / "adapter").is_dir()
        # every episode ran and was graded in sandbox pods (no episode lost to the infrastructure)
        import sqlite3

        with sqlite3.connect(run_dir / "store" / "rollouts.sqlite") as db:
            infos = [json.loads(i) for (i,) in db.execute("select info from rollouts")]
        assert infos and {i["grade_status"] for i in infos} <= {"graded", "agent_fault", "apply_failed"}
        # a commit in a sandbox pod reaches the grader, done as the harness does it (before the task
        # image had the skeleton's git settings, every commit in a pod failed and every patch was empty)
        import base64

        from evals.grading import committed_patch
        from evals.sandbox import PlatformSandbox, copy_workspace
        from training.planner.k8s import POOL_PORT

        task = next(t for t in load_bundled(suite).tasks if t.id == held_out[0])
        pool_ip = core.read_namespaced_service(f"{k8s_name(run)}-sandbox-pool", namespace).spec.cluster_ip
        secret = core.read_namespaced_secret(f"{k8s_name(run)}-credential", namespace)
        pool = PoolClient(f"http://{pool_ip}:{POOL_PORT}", credential=base64.b64decode(secret.data["credential"]).decode())
        with pool.start("posttrain.local/task-base:local", task_id=task.id, episode="commit-check") as box:
            copy_workspace(box, task.repo_path)
            sandbox = PlatformSandbox(box)
            name = next(n for n in sandbox.exec("git ls-files '*.py'").output.split() if "/" not in n)
            sandbox.write_file(name, sandbox.read_file(name) + b"\n# an edit\n")
            committed = sandbox.exec("git add -A && git commit -q -m 'agent commit'")
            assert committed.exit_code == 0, committed.output
            assert "+# an edit" in committed_patch(sandbox, task.base_commit)
        # the fleet stays ([kubernetes] keep_fleet): the checkpoint's eval runs in a pod of the run on it
        key = f"{run}-step_000002"
        instance.add_dynamic_partitions(checkpoints_partitions.name, [key])
        evaluated = dg.materialize([deepswe_eval], instance=instance, partition_key=key, resources={"storage": storage},
                                   run_config={"ops": {"deepswe_eval": {"config": {"task_ids": held_out, "attempts": 1}}}})
        assert evaluated.success
        seen_pods |= {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
        rows = pd.concat(pd.read_parquet(p) for p in (storage.evals_dir() / "deepswe" / key).glob("*.parquet"))
        assert len(rows) == len(held_out) and set(rows["status"]) <= {"graded", "agent_fault", "apply_failed"}
        assert set(rows["adapter_version"]) == {"step_000002"}
        print(f"rl_run and the eval as pods: {time.monotonic() - started:.0f} s; pods seen: {sorted(seen_pods)}")
    finally:
        # the plan ConfigMap owns the fleet (keep_fleet left it): deleting it lets the garbage collector go
        try:
            core.delete_namespaced_config_map(f"{k8s_name(run)}-plan", namespace)
        except client.exceptions.ApiException:
            pass
