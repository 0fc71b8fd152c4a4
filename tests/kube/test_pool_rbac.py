"""The sandbox pool against a real kube-apiserver, acting with its own service account's token.

The pool's ServiceAccount, Role and RoleBinding come from the run's manifests; the pool's API calls
carry a token of that account from the TokenRequest API (what its pod would mount), so every call is
authorized by the server's RBAC exactly as in a cluster. There is no scheduler or kubelet: a
sandbox pod is created and stays Pending, so the pool gives it up at its start deadline and deletes
it; attaching (pxd's stream) needs a kubelet and is covered by tests/sandboxes/test_pool.py's
stand-in node. What the account may do is asked of the server's authorizer itself
(SelfSubjectAccessReview), for what the pool needs and for what it must not have.

What the pool's token may create is the server's admission's to say: with it, pods that would take
the run's credential Secret as a volume, mount a service-account token, or reach the host
(privileged, host PID/network/IPC, hostPath ``/``, root, privilege escalation, added capabilities,
an unconfined seccomp profile) are refused, by a server-side dry run and by a real create alike; a
pod that names no RuntimeClass runs under gVisor all the same; and a pod of
``sandboxes.k8s.pod_spec`` is admitted (PodSecurityPolicy ``posttrain-sandbox``, which the pool's
Role may ``use``, and no other: scripts/kube-local.sh).
"""

from __future__ import annotations

import base64
import copy
import json
import threading
import time

import pytest

from sandboxes import k8s as sandbox_k8s
from sandboxes.errors import SandboxError
from sandboxes.pool import OWNER_LABEL, PoolConfig, SandboxPool
from tests.kube.conftest import token_client
from tests.kube.test_apply import example_in
from training.planner import k8s, resolve, runner

IMAGE = "registry.local/tasks/calc:1"
RUN = "rbac"


@pytest.fixture
def accounts(admin, namespace):
    """The run's accounts, its credential Secret and the pool's Role and RoleBinding, applied from
    the manifests."""
    manifests = k8s.build_manifests(resolve(example_in(namespace, RUN)))
    runner.apply_k8s([m for m in manifests if m["kind"] in ("ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding")],
                     api_client=admin)
    return {"pool": f"{RUN}-sandbox-pool", "trainer": f"{RUN}-trainer", "credential": f"{RUN}-credential"}


def may(api, namespace: str, verb: str, resource: str, subresource: str = "", group: str = "") -> bool:
    from kubernetes import client

    attrs = {"namespace": namespace, "verb": verb, "resource": resource, "group": group}
    if subresource:
        attrs["subresource"] = subresource
    review = client.AuthorizationV1Api(api).create_self_subject_access_review({"spec": {"resourceAttributes": attrs}})
    return bool(review.status.allowed)


def test_the_pools_token_may_do_what_the_pool_needs_and_no_more(admin, namespace, accounts):
    pool_api = token_client(admin, namespace, accounts["pool"])
    needed = [("create", "pods", ""), ("get", "pods", ""), ("list", "pods", ""), ("patch", "pods", ""),
              ("delete", "pods", ""), ("create", "pods", "attach"), ("get", "pods", "attach"),
              ("create", "pods", "exec"), ("create", "leases", ""), ("get", "leases", ""),
              ("patch", "leases", ""), ("delete", "leases", "")]
    for verb, resource, sub in needed:
        group = "coordination.k8s.io" if resource == "leases" else ""
        assert may(pool_api, namespace, verb, resource, sub, group), (verb, resource, sub)
    refused = [("list", "secrets", "", ""), ("get", "secrets", "", ""), ("create", "configmaps", "", ""),
               ("update", "pods", "", ""), ("create", "pods", "portforward", ""), ("get", "pods", "log", ""),
               ("create", "serviceaccounts", "token", ""), ("list", "leases", "", "coordination.k8s.io"),
               ("create", "deployments", "", "apps"), ("delete", "jobs", "", "batch"),
               ("create", "rolebindings", "", "rbac.authorization.k8s.io"),
               ("patch", "roles", "", "rbac.authorization.k8s.io")]
    for verb, resource, sub, group in refused:
        assert not may(pool_api, namespace, verb, resource, sub, group), (verb, resource, sub, group)
    assert not may(pool_api, "default", "create", "pods")  # its rights end at the run's namespace
    assert not may(pool_api, "", "list", "nodes")

    trainer_api = token_client(admin, namespace, accounts["trainer"])
    for verb, resource, sub in needed:
        group = "coordination.k8s.io" if resource == "leases" else ""
        assert not may(trainer_api, namespace, verb, resource, sub, group), ("trainer", verb, resource, sub)

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as refused_call:  # and a real call, not only the review
        client.CoreV1Api(pool_api).list_namespaced_secret(namespace)
    assert refused_call.value.status == 403


def test_the_pool_creates_labelled_pods_keeps_its_lease_and_reaps_a_dead_owners_pods(admin, namespace, accounts,
                                                                                     no_controllers):
    from kubernetes import client

    pool_api = token_client(admin, namespace, accounts["pool"])
    core = client.CoreV1Api(admin)
    cfg = PoolConfig(run=RUN, settings=sandbox_k8s.PodSettings(namespace=namespace), start_timeout_s=3.0,
                     lease_s=30.0, poll_s=0.2)
    pool = SandboxPool(cfg, pool_api)

    pool.renew_lease()
    pool.renew_lease()  # the second one renews (merge patch)
    lease = client.CoordinationV1Api(admin).read_namespaced_lease(pool.lease_name, namespace)
    assert lease.spec.holder_identity == cfg.instance and lease.spec.lease_duration_seconds == 30
    assert lease.metadata.labels[f"{sandbox_k8s.LABEL_PREFIX}/role"] == "sandbox-owner"

    selector = ",".join(f"{k}={v}" for k, v in sandbox_k8s.sandbox_selector(RUN).items())
    seen: list = []

    def watch() -> None:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            seen.extend(core.list_namespaced_pod(namespace, label_selector=selector).items)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(SandboxError, match=r"did not start within 3 s .*last seen: phase Pending"):
        pool.acquire(IMAGE, task_id="calc/add", episode="step_000001-g0-a0")
    watcher.join()
    assert len(seen) == 1, "the pool's pod never reached the server"
    pod = seen[0]
    labels = pod.metadata.labels
    assert labels[OWNER_LABEL] == cfg.instance
    assert labels[f"{sandbox_k8s.LABEL_PREFIX}/task"] == sandbox_k8s.label_value("calc/add")
    assert labels[f"{sandbox_k8s.LABEL_PREFIX}/role"] == "sandbox"
    spec = pod.spec
    assert spec.runtime_class_name == "gvisor" and spec.automount_service_account_token is False
    assert spec.restart_policy == "Never" and not spec.host_network
    sandbox = spec.containers[0]
    assert sandbox.stdin and sandbox.stdin_once and sandbox.command[-1] == "--stdio"
    assert sandbox.security_context.read_only_root_filesystem and sandbox.security_context.capabilities.drop == ["ALL"]
    assert sandbox.resources.limits["cpu"] and spec.init_containers[0].name == "workspace"
    # given up at the deadline: deleted, not left Pending
    assert core.list_namespaced_pod(namespace, label_selector=selector).items == []
    assert pool.metrics.start_failures == 1

    # a pod of a pool process that died (its Lease expired long ago) is reaped, with the Lease
    dead = "pool-deadbeef00"
    orphan = sandbox_k8s.pod_spec(run=RUN, task_id="t", episode="orphan", image=IMAGE, settings=cfg.settings)
    orphan["metadata"]["labels"][OWNER_LABEL] = dead
    core.create_namespaced_pod(namespace, orphan)
    client.CoordinationV1Api(admin).create_namespaced_lease(namespace, {
        "metadata": {"name": f"sandbox-owner-{dead}"},
        "spec": {"holderIdentity": dead, "leaseDurationSeconds": 30, "renewTime": "2026-01-01T00:00:00.000000Z"}})
    assert pool.reap() == [orphan["metadata"]["name"]]
    assert core.list_namespaced_pod(namespace, label_selector=selector).items == []
    leases = client.CoordinationV1Api(admin).list_namespaced_lease(namespace).items
    assert [item.metadata.name for item in leases] == [pool.lease_name]


def sandbox_pod(namespace: str, episode: str) -> dict:
    return sandbox_k8s.pod_spec(run=RUN, task_id="calc/add", episode=episode, image=IMAGE,
                                settings=sandbox_k8s.PodSettings(namespace=namespace))


def escalations(namespace: str, credential_secret: str) -> dict[str, dict]:
    """Pods a stolen pool token would create to leave the sandbox: each a sandbox pod with one change."""
    def variant(name, change):
        pod = copy.deepcopy(sandbox_pod(namespace, name))
        pod["metadata"]["name"] = f"escape-{name}"
        change(pod["spec"], pod["spec"]["containers"][0])
        return pod

    def secret_volume(spec, c):  # the attempt: the run's credential, mounted, then read
        spec["volumes"].append({"name": "stolen", "secret": {"secretName": credential_secret}})
        c["volumeMounts"].append({"name": "stolen", "mountPath": "/stolen", "readOnly": True})

    def token_volume(spec, c):  # a token of the pool's own account (or any other), projected
        spec["volumes"].append({"name": "token", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "audience": "https://kubernetes.default.svc"}}]}})
        c["volumeMounts"].append({"name": "token", "mountPath": "/token"})

    def as_trainer(spec, c):  # another account of the namespace does not bring a broader policy
        spec["serviceAccountName"] = f"{RUN}-trainer"
        secret_volume(spec, c)

    def host_everything(spec, c):  # the second attempt: host root, as one pod
        spec.update(hostPID=True, hostNetwork=True, hostIPC=True)
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
        c["volumeMounts"].append({"name": "host", "mountPath": "/host"})
        c["securityContext"].update(privileged=True, allowPrivilegeEscalation=True, runAsNonRoot=False, runAsUser=0)
        c["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}

    def set_sc(**kw):
        return lambda spec, c: c["securityContext"].update(**kw)

    def host_path(spec, c):
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
        c["volumeMounts"].append({"name": "host", "mountPath": "/host"})

    def add_capability(spec, c):
        c["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}

    def host_port(spec, c):
        c["ports"] = [{"containerPort": 8080, "hostPort": 8080, "protocol": "TCP"}]

    def unconfined(spec, c):
        spec["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
        c["securityContext"]["seccompProfile"] = {"type": "Unconfined"}

    return {name: variant(name, change) for name, change in {
        "secret-volume": secret_volume, "token-volume": token_volume, "as-trainer": as_trainer,
        "host-everything": host_everything,
        "privileged": set_sc(privileged=True, allowPrivilegeEscalation=True),
        "host-pid": lambda spec, c: spec.update(hostPID=True), "host-network": lambda spec, c: spec.update(hostNetwork=True),
        "host-ipc": lambda spec, c: spec.update(hostIPC=True), "host-path": host_path, "host-port": host_port,
        "root": set_sc(runAsNonRoot=False, runAsUser=0), "escalation": set_sc(allowPrivilegeEscalation=True),
        "capability": add_capability, "unconfined": unconfined,
    }.items()}


def test_the_pools_token_creates_sandbox_pods_and_nothing_that_leaves_the_sandbox(admin, namespace, accounts):
    """The issue's attempts with the pool's token (found on 1ec7686: the Secret-mounting pod was
    created and read the credential; the privileged host pod passed a dry run): each refused by the
    real server's admission, in a dry run and for real; a sandbox pod is admitted, both ways."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    pool_core = client.CoreV1Api(token_client(admin, namespace, accounts["pool"]))
    admin_core = client.CoreV1Api(admin)
    secret = admin_core.read_namespaced_secret(accounts["credential"], namespace)
    assert len(base64.b64decode(secret.data["credential"])) == 64  # there is a credential to steal

    refused = {}
    for name, pod in escalations(namespace, accounts["credential"]).items():
        for dry_run in ("All", None):
            with pytest.raises(ApiException) as caught:
                admitted = pool_core.create_namespaced_pod(namespace, pod, dry_run=dry_run)
                pytest.fail(f"{name} ({'dry run' if dry_run else 'created'}) was admitted: "
                            f"{admitted.metadata.annotations}")
            assert caught.value.status == 403, (name, dry_run, caught.value.status, caught.value.body)
            refused[name] = caught.value.body
    refused = {name: json.loads(body)["message"] for name, body in refused.items()}
    print("\n".join(f"{name}: {message}" for name, message in refused.items()))
    # each refused by the policy, for what it asked (the server names the field)
    reasons = {"secret-volume": '"secret": secret volumes are not allowed', "as-trainer": '"secret": secret volumes',
               "token-volume": '"projected": projected volumes are not allowed', "host-path": '"hostPath": hostPath volumes',
               "host-pid": "hostPID: Invalid value: true", "host-network": "hostNetwork: Invalid value: true",
               "host-ipc": "hostIPC: Invalid value: true", "host-port": "Host port 8080 is not allowed",
               "privileged": "Privileged containers are not allowed", "root": "runAsNonRoot: Invalid value: false",
               "escalation": "Allowing privilege escalation for containers is not allowed",
               "capability": '"SYS_ADMIN": capability may not be added', "unconfined": "unconfined is not an allowed seccomp profile"}
    reasons["host-everything"] = reasons["host-network"]
    assert set(reasons) == set(refused)
    for name, message in refused.items():
        assert "PodSecurityPolicy: unable to admit pod" in message and reasons[name] in message, (name, message)
    assert admin_core.list_namespaced_pod(namespace).items == []  # not one of them exists

    # what a sandbox pod is: admitted under the sandbox policy, unchanged by it
    wanted = sandbox_pod(namespace, "step_000001-g0-a0")
    dry = pool_core.create_namespaced_pod(namespace, wanted, dry_run="All")
    assert dry.metadata.annotations["kubernetes.io/psp"] == sandbox_k8s.SANDBOX_POD_SECURITY_POLICY
    assert admin_core.list_namespaced_pod(namespace).items == []
    made = pool_core.create_namespaced_pod(namespace, wanted)
    assert made.metadata.annotations["kubernetes.io/psp"] == sandbox_k8s.SANDBOX_POD_SECURITY_POLICY
    assert made.spec.runtime_class_name == "gvisor" and made.spec.volumes[0].empty_dir is not None
    assert [v.name for v in made.spec.volumes] == ["workspace", "tmp", "home"]  # no token was added
    # a pod that names no RuntimeClass (runc, the node's own kernel) gets gVisor
    runc = sandbox_pod(namespace, "no-runtime-class")
    del runc["spec"]["runtimeClassName"]
    assert pool_core.create_namespaced_pod(namespace, runc).spec.runtime_class_name == "gvisor"
    writable = sandbox_k8s.pod_spec(run=RUN, task_id="harbor/bandit", episode="e-writable", image=IMAGE,
                                    settings=sandbox_k8s.PodSettings(namespace=namespace), writable_root=True)
    pool_core.create_namespaced_pod(namespace, writable)  # a writable-root sandbox is a sandbox too


def test_the_pool_may_use_its_policy_and_no_account_of_the_run_may_use_another(admin, namespace, accounts):
    """The policies, as the authorizer sees them: the pool's token may ``use`` the sandbox policy
    only; the trainer's and the namespace's default account none (a pod naming one of them would
    otherwise be admitted under that account's policy)."""
    from kubernetes import client

    listed = admin.call_api("/apis/policy/v1beta1/podsecuritypolicies", "GET", response_types_map={200: "object"},
                            auth_settings=["BearerToken"], _return_http_data_only=True)
    policies = {p["metadata"]["name"] for p in listed["items"]}
    assert {sandbox_k8s.SANDBOX_POD_SECURITY_POLICY, "posttrain-workload", "posttrain-privileged"} <= policies

    def may_use(account: str, policy: str) -> bool:
        review = client.AuthorizationV1Api(admin).create_subject_access_review({"spec": {
            "user": f"system:serviceaccount:{namespace}:{account}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
            "resourceAttributes": {"namespace": namespace, "verb": "use", "group": "policy",
                                   "resource": "podsecuritypolicies", "name": policy}}})
        return bool(review.status.allowed)

    for policy in sorted(policies):
        assert may_use(accounts["pool"], policy) == (policy == sandbox_k8s.SANDBOX_POD_SECURITY_POLICY), policy
        for account in (accounts["trainer"], "default"):
            assert not may_use(account, policy), (account, policy)
