"""The run's manifests against a real kube-apiserver: every one is accepted, a second apply
changes nothing, and the launch's own objects (owner references, cleanup) behave on the server.

The server is Kubernetes 1.20 (Debian bookworm's source package): older than the schemas the
offline validation uses, so it is the strictest reader the manifests meet (ports without
``protocol``, numeric quantities and ``policy/v1`` PodDisruptionBudgets were refused by it).
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from training.planner import k8s, resolve, runner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "olmo35-b300.toml"


def example_in(namespace: str, name: str = "olmo35-b300") -> dict:
    data = tomllib.loads(EXAMPLE.read_text())
    data["kubernetes"]["namespace"] = namespace
    data["run"]["name"] = name
    return data


def stored(admin, manifests) -> dict[str, dict]:
    served = runner.for_server(manifests, admin)
    return {runner.object_path(m): runner.read_object(admin, m) for m in served}


def test_every_manifest_applies_and_a_second_apply_changes_nothing(admin, namespace):
    manifests = k8s.build_manifests(resolve(example_in(namespace)))
    first = runner.apply_k8s(manifests, api_client=admin)
    assert [a.action for a in first] == ["created"] * len(manifests) == ["created"] * 20, [str(a) for a in first]
    objects = stored(admin, manifests)
    assert all(objects.values())

    second = runner.apply_k8s(manifests, api_client=admin)
    print("second apply:", ", ".join(str(a) for a in second))
    assert [a.action for a in second] == ["unchanged"] * len(manifests), [str(a) for a in second if a.action != "unchanged"]
    # The 1.20 server writes a new PersistentVolumeClaim's defaulted status.phase on its first update
    # (its resourceVersion moves once, nothing in it changes); every other object is not written
    # again, and from then on none is.
    versions = {path: obj["metadata"]["resourceVersion"] for path, obj in stored(admin, manifests).items()}
    moved = [path for path, obj in objects.items() if obj["metadata"]["resourceVersion"] != versions[path]]
    assert [p.split("/")[-2] for p in moved] == ["persistentvolumeclaims"], moved
    third = runner.apply_k8s(manifests, api_client=admin)
    assert [a.action for a in third] == ["unchanged"] * len(manifests)
    assert {path: obj["metadata"]["resourceVersion"] for path, obj in stored(admin, manifests).items()} == versions

    # what the server made of them: GPU quantities, the PDB version this server serves, the owner
    pdbs = [m for m in runner.for_server(manifests, admin) if m["kind"] == "PodDisruptionBudget"]
    assert {m["apiVersion"] for m in pdbs} == {"policy/v1beta1"}  # 1.20 has no policy/v1
    job = objects[runner.object_path(manifests[-1])]
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"
    plan = next(obj for obj in objects.values() if obj["kind"] == "ConfigMap")
    for path, obj in objects.items():
        refs = obj["metadata"].get("ownerReferences")
        if obj["kind"] in runner.UNOWNED_KINDS:
            assert not refs, path
        else:
            assert refs == [{"apiVersion": "v1", "kind": "ConfigMap", "name": plan["metadata"]["name"],
                             "uid": plan["metadata"]["uid"], "blockOwnerDeletion": False}], path

    # the trainer credential: made by the first apply, kept by the others, never in the manifests
    secret_manifest = next(m for m in manifests if m["kind"] == "Secret")
    assert "data" not in secret_manifest and "stringData" not in secret_manifest
    secret = objects[runner.object_path(secret_manifest)]
    value = base64.b64decode(secret["data"]["credential"]).decode()
    assert len(value) == 64 and value == base64.b64decode(stored(admin, manifests)[runner.object_path(secret_manifest)]
                                                          ["data"]["credential"]).decode()
    uses = {(obj["kind"], c["name"]) for obj in objects.values() for c in
            (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [])
            if {"name": "POSTTRAIN_TRAINER_CREDENTIAL", "valueFrom": {"secretKeyRef": {
                "name": secret["metadata"]["name"], "key": "credential"}}} in c.get("env", [])}
    assert uses == {("Job", "trainer"), ("Deployment", "router"), ("StatefulSet", "capture"),
                    ("Deployment", "sandbox-pool")}, uses

    deleted = runner.delete_k8s(manifests, api_client=admin)
    assert len(deleted) == len(manifests) - 2
    left = {path: obj for path, obj in stored(admin, manifests).items() if obj is not None}
    assert sorted(obj["kind"] for obj in left.values()) == ["ConfigMap", "PersistentVolumeClaim"]


def test_a_server_side_dry_run_changes_nothing_and_names_what_would_change(admin, namespace):
    manifests = k8s.build_manifests(resolve(example_in(namespace)))
    preview = runner.apply_k8s(manifests, api_client=admin, dry_run=True)
    assert {a.action for a in preview} == {"created"}
    assert all(obj is None for obj in stored(admin, manifests).values())
    runner.apply_k8s(manifests, api_client=admin)
    changed = example_in(namespace)
    changed["inference"]["engines"] = 4  # the engines and the router's workers change; the Job does not
    preview = runner.apply_k8s(k8s.build_manifests(resolve(changed)), api_client=admin, dry_run=True)
    would = {f"{a.kind}/{a.name}": a.changed for a in preview if a.action == "configured"}
    assert "spec.replicas" in would["StatefulSet/olmo35-b300-engine"], [str(a) for a in preview]
    assert "Deployment/olmo35-b300-router" in would and "Job/olmo35-b300-trainer" not in would
    assert runner.read_object(admin, k8s.build_manifests(resolve(changed))[0]) is not None
    engine = next(m for m in runner.for_server(k8s.build_manifests(resolve(example_in(namespace))), admin)
                  if m["kind"] == "StatefulSet")
    assert runner.read_object(admin, engine)["spec"]["replicas"] == 8  # the dry run kept nothing

    # a changed trainer image touches the Job's pod template, which the real server refuses to change
    changed["kubernetes"]["image"] = "registry.example.com/posttrain:v2"
    with pytest.raises(runner.RunStartError, match=r"applying Job/olmo35-b300-trainer failed: HTTP 422 .*field is "
                                                   r"immutable; a Job's pod template cannot change: delete it"):
        runner.apply_k8s(k8s.build_manifests(resolve(changed)), api_client=admin, dry_run=True)


def test_posttrain_run_applies_every_manifest_and_again_changes_nothing(kubeconfig, admin, namespace, tmp_path):
    """The acceptance command, as a user types it (the run file's namespace made this test's own)."""
    run_file = tmp_path / "olmo35-b300.toml"
    text = EXAMPLE.read_text()
    assert text.count('namespace = "posttrain"') == 1
    run_file.write_text(text.replace('namespace = "posttrain"', f'namespace = "{namespace}"'))
    # --no-wait: the trainer Job at once (this plane has no kubelet: the fleet never gets ready)
    command = [sys.executable, "-m", "dagster_project.cli", "run", str(run_file), "--target", "k8s",
               "--kubeconfig", kubeconfig, "--home", str(tmp_path / "home"), "--no-wait"]
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    print(second.stdout)
    lines = [line for line in second.stdout.splitlines() if line.startswith(tuple(k for k in (
        "PersistentVolumeClaim/", "ConfigMap/", "ServiceAccount/", "Role/", "RoleBinding/", "NetworkPolicy/",
        "Service/", "StatefulSet/", "PodDisruptionBudget/", "Deployment/", "Job/", "Secret/")))]
    assert len(lines) == 20 and all(line.endswith(" unchanged") for line in lines), second.stdout
    assert sum(line.endswith(" created") for line in first.stdout.splitlines()) == 20, first.stdout


def test_posttrain_run_starts_the_trainer_only_once_the_fleet_is_ready(kubeconfig, admin, namespace, tmp_path):
    """Without --no-wait the trainer Job waits for the engines, router and pool (its first episodes
    would otherwise meet "no healthy replica"); on this plane they never get ready: the command
    says what it waited for and exits 3, and no Job was made."""
    from kubernetes import client

    run_file = tmp_path / "olmo35-b300.toml"
    run_file.write_text(EXAMPLE.read_text().replace('namespace = "posttrain"', f'namespace = "{namespace}"'))
    done = subprocess.run([sys.executable, "-m", "dagster_project.cli", "run", str(run_file), "--target", "k8s",
                           "--kubeconfig", kubeconfig, "--home", str(tmp_path / "home"), "--fleet-timeout", "3"],
                          capture_output=True, text=True, env={**os.environ, "KUBECONFIG": kubeconfig}, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "waiting for StatefulSet/" in done.stderr and "the fleet was not ready within 3 s (--fleet-timeout)" in done.stderr
    assert client.BatchV1Api(admin).list_namespaced_job(namespace).items == []
