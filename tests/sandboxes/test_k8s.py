"""Kubernetes manifests of sandboxes, validated offline against the Kubernetes OpenAPI schemas.

No API server runs here: the manifests are checked with ``kubernetes-validate`` (strict), which
is as far as a test can go without a cluster."""

from __future__ import annotations

import copy

import pytest

import sandboxes
from sandboxes import k8s


def pod(**kw):
    args = dict(run="demo", task_id="bundled/calc 1", episode="step_000004-g3-a2",
                image="registry.local/tasks/calc@sha256:" + "a" * 64,
                limits=sandboxes.Limits(cpus=2, memory_mib=4096, disk_mib=2048, wall_s=900))
    args.update(kw)
    return k8s.pod_spec(**args)


def test_pod_spec_is_valid_and_locked_down():
    p = pod(preferred_nodes=["node-3", "node-7"])
    k8s.validate(p)
    spec, box = p["spec"], p["spec"]["containers"][0]
    assert spec["runtimeClassName"] == "gvisor" and spec["automountServiceAccountToken"] is False
    assert spec["activeDeadlineSeconds"] == 900
    assert box["resources"]["limits"] == {"cpu": "2000m", "memory": "4096Mi", "ephemeral-storage": "2304Mi"}
    assert box["resources"]["requests"]["cpu"] == "500m"  # 25 % of the limit
    assert box["resources"]["requests"]["memory"] == "1638Mi"  # 40 %
    assert box["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert box["securityContext"]["readOnlyRootFilesystem"] and not box["securityContext"]["allowPrivilegeEscalation"]
    labels = p["metadata"]["labels"]
    assert labels["posttrain.dev/run"] == "demo" and labels["posttrain.dev/episode"] == "step_000004-g3-a2"
    assert labels["posttrain.dev/task"].startswith("bundled-calc-1-")  # '/' and ' ' are not label characters
    terms = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["preference"]["matchExpressions"][0]["values"] == ["node-3", "node-7"]


def test_request_fractions_and_runtime_class_are_settings():
    p = pod(settings=k8s.PodSettings(runtime_class="kata", cpu_request_fraction=0.5, memory_request_fraction=1.0),
            required_nodes=["node-1"])
    k8s.validate(p)
    assert p["spec"]["runtimeClassName"] == "kata"
    assert p["spec"]["containers"][0]["resources"]["requests"]["memory"] == "4096Mi"
    with pytest.raises(k8s.ManifestError, match="sandbox.runtime_class must be one of gvisor, kata"):
        k8s.PodSettings(runtime_class="runc")
    with pytest.raises(k8s.ManifestError, match=r"sandbox.cpu_request_fraction must be in \(0, 1\]"):
        k8s.PodSettings(cpu_request_fraction=0)


def test_network_policy_denies_everything():
    np_ = k8s.network_policy(run="demo")
    k8s.validate(np_)
    assert np_["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert np_["spec"]["ingress"] == [] and np_["spec"]["egress"] == []
    # it selects exactly the run's sandbox pods
    selector = np_["spec"]["podSelector"]["matchLabels"]
    assert all(pod()["metadata"]["labels"][k] == v for k, v in selector.items())


def test_validation_catches_schema_errors():
    bad = copy.deepcopy(pod())
    bad["spec"]["containers"][0]["resources"]["limits"]["cpu"] = {"much": True}
    with pytest.raises(k8s.ManifestError, match="spec/containers/0/resources/limits/cpu"):
        k8s.validate(bad)
    bad = copy.deepcopy(pod())
    bad["spec"]["containers"][0]["stdinn"] = True
    with pytest.raises(k8s.ManifestError, match="'stdinn' was unexpected"):
        k8s.validate(bad)


@pytest.mark.parametrize("run", ["demo", "Hybrid B300", "olmo35-b300", "x" * 80])
def test_every_sandbox_pod_carries_the_selector_of_its_runs_network_policy(run):
    """The default-deny policy covers a pod only if the pod has every label its selector names."""
    selector = k8s.network_policy(run=run)["spec"]["podSelector"]["matchLabels"]
    assert selector == k8s.sandbox_selector(run)
    labels = pod(run=run)["metadata"]["labels"]
    assert {k: labels.get(k) for k in selector} == selector
    assert labels["app.kubernetes.io/component"] == "sandbox"
