"""The run as pods: ``rl_run`` materialized in Dagster with the Kubernetes launcher, on the kube-local
node, for ``examples/embedded-k8s.toml``.

The trainer Job's pod runs ``python -m training`` against the run's router and sandbox pool (one
vLLM CPU engine pod behind the router; each episode's and each grading's sandbox a gVisor pod of
the pool, the task's repository copied in), Pipes messages become ``rl_run`` observations, two
steps, a checkpoint on the run volume; then the checkpoint's ``deepswe_eval`` runs in an eval pod
of the run, on the same engine and pool. Nothing is stood in for: real kube-apiserver, scheduler,
controller-manager, kubelet, containerd, gVisor; the images of ``scripts/build-image.sh`` and
``scripts/build-task-image.sh`` (built here when missing, with ``POSTTRAIN_KUBE_NODE=1``: about 10
minutes the first time).

Needs the node (``tests/kube/test_node.py``'s ``node`` fixture: ``POSTTRAIN_KUBE_NODE=1`` starts
it); about 15 minutes on 2 cores. Marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.kube.test_node import node  # noqa: F401  (the module's node: started here, stopped after)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "embedded-k8s.toml"
IMAGES = {"posttrain.local/posttrain:local": "build-image.sh", "posttrain.local/task-base:local": "build-task-image.sh"}


def node_images(state: Path) -> set[str]:
    sock = state / "node" / "containerd.sock"
    done = subprocess.run(["ctr", "-a", str(sock), "-n", "k8s.io", "images", "ls", "-q"],
                          capture_output=True, text=True, timeout=120)
    return set(done.stdout.split()) if done.returncode == 0 else set()


@pytest.fixture(scope="module")
def images(node, kubeconfig):  # noqa: F811
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
        # the trainer's steps reached Dagster as observations while it ran, and its files are on the volume
        observations = [e for e in result.get_asset_observation_events()]
        assert len(observations) >= 2, observations
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
