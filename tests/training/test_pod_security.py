"""What the manifests ask of a cluster's admission, read offline: Pod Security's ``restricted`` level
for every pod of a run and every sandbox pod (the level scripts/kube-local.sh and the test
namespaces label for, enforced by servers >= 1.23), the pool's one PodSecurityPolicy, its API
behind the run's credential, the router's NetworkPolicy, and the ValidatingAdmissionPolicy for
current clusters (validated against the 1.37 schemas; the test plane is 1.20, where
tests/kube/test_pool_rbac.py shows PodSecurityPolicy refusing the same escalations for real).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxes import k8s as sandbox_k8s
from tests.training.test_manifests_policy import by_kind, pod_templates, traffic_allowed
from training.planner import k8s, resolve

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "olmo35-b300.toml"
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


@pytest.fixture(scope="module")
def manifests():
    return k8s.build_manifests(resolve(EXAMPLE))


def restricted_violations(spec: dict) -> list[str]:
    """Where a pod spec breaks Pod Security's ``restricted`` level (Kubernetes' pod security
    standards: the baseline controls and the restricted ones)."""
    bad = []
    pod_sc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(key)
    for v in spec.get("volumes") or []:
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {kind}")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for c in (spec.get("initContainers") or []) + spec["containers"]:
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        if sc.get("privileged"):
            bad.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{where}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{where}: runAsUser 0")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{where}: seccomp not RuntimeDefault or Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}: capabilities {caps}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(f"{where}: hostPort")
    return bad


def test_every_pod_of_a_run_and_every_sandbox_pod_meets_the_restricted_level(manifests):
    pods = [(name, spec) for name, spec, _ in pod_templates(manifests)]
    for writable_root in (False, True):
        pods.append((f"sandbox (writable_root={writable_root})", sandbox_k8s.pod_spec(
            run="olmo35-b300", task_id="t", episode="e", image="r/t:1", writable_root=writable_root)["spec"]))
    assert len(pods) == 6
    for name, spec in pods:
        assert restricted_violations(spec) == [], name
    # the checker sees what it must (a pod the restricted level refuses is refused here too)
    escaped = sandbox_k8s.pod_spec(run="r", task_id="t", episode="e", image="r/t:1")["spec"]
    escaped.update(hostPID=True, volumes=[*escaped["volumes"], {"name": "host", "hostPath": {"path": "/"}}])
    escaped["containers"][0]["securityContext"].update(privileged=True, allowPrivilegeEscalation=True)
    assert restricted_violations(escaped) == ["hostPID", "volume host: hostPath", "container sandbox: privileged",
                                              "container sandbox: allowPrivilegeEscalation not false"]


def test_the_pool_may_use_the_sandbox_policy_only_and_its_api_takes_the_run_credential(manifests):
    [role] = by_kind(manifests, "Role")
    uses = [r for r in role["rules"] if "use" in r["verbs"]]
    assert uses == [{"apiGroups": ["policy"], "resources": ["podsecuritypolicies"], "verbs": ["use"],
                     "resourceNames": [sandbox_k8s.SANDBOX_POD_SECURITY_POLICY]}]
    assert not any("secrets" in r["resources"] for r in role["rules"])
    pool = next(m for m in by_kind(manifests, "Deployment") if m["metadata"]["name"].endswith("-sandbox-pool"))
    [container] = pool["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"  # the pool's own default is loopback
    secret = next(m for m in manifests if m["kind"] == "Secret")
    assert {"name": "POSTTRAIN_TRAINER_CREDENTIAL", "valueFrom": {"secretKeyRef": {
        "name": secret["metadata"]["name"], "key": "credential"}}} in container["env"]


def test_only_the_trainer_eval_pods_and_engines_reach_the_router(manifests):
    labels = {name.split("/")[1].removeprefix("olmo35-b300-"): lab for name, _, lab in pod_templates(manifests)}
    trainer, pool, router, engine = labels["trainer"], labels["sandbox-pool"], labels["router"], labels["engine"]
    evaluation = {**trainer, "app.kubernetes.io/component": "eval"}
    sandbox = sandbox_k8s.pod_spec(run="olmo35-b300", task_id="t", episode="e", image="r/t:1")["metadata"]["labels"]
    stranger = {"app.kubernetes.io/name": "something-else"}
    other_run = {**trainer, "app.kubernetes.io/instance": "another-run"}
    [policy] = [m for m in by_kind(manifests, "NetworkPolicy") if m["metadata"]["name"] == "olmo35-b300-router-ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for src in (trainer, evaluation, engine):
        assert traffic_allowed(manifests, src, router, k8s.ROUTER_PORT), src
        assert not traffic_allowed(manifests, src, router, 22), src
    for src in (pool, sandbox, stranger, other_run):
        assert not traffic_allowed(manifests, src, router, k8s.ROUTER_PORT), src


def test_the_admission_policy_for_current_clusters_validates_and_says_what_a_pool_may_create():
    policy, binding = k8s.sandbox_pool_admission_policy()
    assert k8s.validate_manifests([policy, binding], "1.37.0") == []
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [condition] = spec["matchConditions"]
    assert "endswith('-sandbox-pool')" in condition["expression"].lower()
    rules = {(tuple(r["operations"]), tuple(r["resources"])) for r in spec["matchConstraints"]["resourceRules"]}
    assert rules == {(("CREATE", "UPDATE", "DELETE"), ("pods",)), (("CONNECT",), ("pods/exec", "pods/attach"))}
    said = " ".join(v["message"] for v in spec["validations"])
    for what in ("emptyDir volumes only", "no host namespace", "default service account, without its token",
                 "no environment from Secrets", "gvisor or kata", "its own run's sandbox pods"):
        assert what in said, what
