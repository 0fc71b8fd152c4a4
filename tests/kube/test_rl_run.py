"""``rl_run`` with ``launcher.target = "k8s"``, materialized in Dagster against a real kube-apiserver.

The launcher applies the plan's manifests, waits for the fleet, runs the trainer Job with the Pipes
context in its environment, and deletes the workloads when the run ends. There is no kubelet or
controller-manager on this plane, so nothing reports readiness or a finished Job by itself: the
test does what they would, through the same status subresources (a StatefulSet's and Deployments'
``readyReplicas``, the Job's ``Complete``/``Failed`` condition). Everything else, from the asset
down to the server's validation, admission and storage, is the real path.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import dagster as dg

from assets.resources import PosttrainStorage, WorkloadLauncher
from assets.training import rl_run
from tests.kube.test_apply import EXAMPLE

RUN = "dagster-k8s"


def run_file(tmp_path, namespace: str, keep_fleet: bool = False) -> str:
    text = EXAMPLE.read_text().replace('namespace = "posttrain"', f'namespace = "{namespace}"')
    text = text.replace('name = "olmo35-b300"', f'name = "{RUN}"')
    if keep_fleet:
        text = text.replace("[kubernetes]\n", "[kubernetes]\nkeep_fleet = true\n")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def objects_of_run(admin, namespace: str) -> dict[str, dict]:
    """``KIND/NAME`` of every object labelled with the run, as the server holds them."""
    from kubernetes import client

    selector = f"posttrain.dev/run={RUN}"
    found = {}
    lists = [
        (client.CoreV1Api(admin), ["persistent_volume_claim", "config_map", "service_account", "service"]),
        (client.AppsV1Api(admin), ["stateful_set", "deployment"]),
        (client.BatchV1Api(admin), ["job"]),
        (client.RbacAuthorizationV1Api(admin), ["role", "role_binding"]),
        (client.NetworkingV1Api(admin), ["network_policy"]),
        (client.PolicyV1beta1Api(admin) if hasattr(client, "PolicyV1beta1Api") else None, ["pod_disruption_budget"]),
    ]
    for api, kinds in lists:
        for kind in kinds:
            if api is None:
                continue
            for item in getattr(api, f"list_namespaced_{kind}")(namespace, label_selector=selector).items:
                found[f"{type(item).__name__.removeprefix('V1').removeprefix('V1beta1')}/{item.metadata.name}"] = \
                    admin.sanitize_for_serialization(item)
    return found


class Controllers:
    """What the controllers and kubelet would report, once the launcher has created the objects:
    the fleet ready, then the trainer Job finished with ``outcome``. Records what it saw."""

    def __init__(self, admin, namespace: str, outcome: str | None, ready_after_s: float = 1.0):
        self.admin, self.namespace, self.outcome, self.ready_after_s = admin, namespace, outcome, ready_after_s
        self.seen_before_ready: dict[str, dict] = {}
        self.job: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _wait(self, what, timeout_s: float = 120.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = what()
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError("the launcher never created what the test waits for")

    def _run(self) -> None:
        try:
            from kubernetes import client

            apps = client.AppsV1Api(self.admin)
            merge = {"_content_type": "application/merge-patch+json"}
            workloads = self._wait(lambda: [w for w in (apps.list_namespaced_stateful_set(self.namespace).items
                                                        + apps.list_namespaced_deployment(self.namespace).items)]
                                   if len(apps.list_namespaced_deployment(self.namespace).items) == 2 else None)
            time.sleep(self.ready_after_s)  # the launcher waits meanwhile: no Job yet
            self.seen_before_ready = objects_of_run(self.admin, self.namespace)
            if self.outcome is None:
                return
            for w in workloads:
                status = {"status": {"replicas": w.spec.replicas, "readyReplicas": w.spec.replicas,
                                     "availableReplicas": w.spec.replicas}}
                if w.kind == "StatefulSet" or isinstance(w, client.V1StatefulSet):
                    apps.patch_namespaced_stateful_set_status(w.metadata.name, self.namespace, status, **merge)
                else:
                    apps.patch_namespaced_deployment_status(w.metadata.name, self.namespace, status, **merge)
            batch = client.BatchV1Api(self.admin)
            job = self._wait(lambda: batch.list_namespaced_job(self.namespace).items)[0]
            self.job = self.admin.sanitize_for_serialization(job)
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            condition = {"type": "Complete" if self.outcome == "succeeded" else "Failed", "status": "True",
                         "lastProbeTime": now, "lastTransitionTime": now}
            batch.patch_namespaced_job_status(job.metadata.name, self.namespace, {"status": {
                "conditions": [condition], "startTime": now,
                **({"succeeded": 1, "completionTime": now} if self.outcome == "succeeded" else {"failed": 1})}}, **merge)
        except BaseException as exc:  # reported by the test
            self.error = exc


def materialize(tmp_path, kubeconfig: str, path: str, **launcher: float):
    launcher_resource = WorkloadLauncher(target="k8s", kubeconfig_file=kubeconfig, poll_interval_s=0.3, **launcher)
    with dg.instance_for_test() as instance:
        result = dg.materialize([rl_run], instance=instance, raise_on_error=False, run_config={
            "ops": {"rl_run": {"config": {"run_file": path}}}},
            resources={"storage": PosttrainStorage(root=str(tmp_path / "home")), "launcher": launcher_resource})
        return result, [entry.user_message for entry in instance.all_logs(result.run_id)]


WORKLOADS = {"StatefulSet/dagster-k8s-engine", "Deployment/dagster-k8s-router", "Deployment/dagster-k8s-sandbox-pool",
             "Service/dagster-k8s-router", "Service/dagster-k8s-sandbox-pool", "Service/dagster-k8s-engine",
             "Role/dagster-k8s-sandbox-pool", "RoleBinding/dagster-k8s-sandbox-pool"}


def test_rl_run_applies_the_plan_waits_for_the_fleet_runs_the_trainer_job_and_deletes_the_workloads(
        kubeconfig, admin, namespace, tmp_path, no_controllers):
    controllers = Controllers(admin, namespace, "succeeded")
    result, logs = materialize(tmp_path, kubeconfig, run_file(tmp_path, namespace))
    controllers.thread.join(timeout=60)
    assert controllers.error is None, controllers.error
    assert result.success, [e.message for e in result.all_events if e.is_failure]

    before = controllers.seen_before_ready
    assert WORKLOADS | {"PersistentVolumeClaim/dagster-k8s-data", "ConfigMap/dagster-k8s-plan"} <= set(before)
    assert not any(name.startswith("Job/") for name in before)  # the trainer waits for the fleet
    job = controllers.job
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"} <= set(env)
    assert env["POSTTRAIN_ROUTER_URL"] == f"http://{RUN}-router.{namespace}.svc:30100"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["command"][:3] == ["python", "-m", "training"] or "training" in " ".join(container["command"])
    assert job["metadata"]["ownerReferences"][0]["name"] == f"{RUN}-plan"

    assert any("k8s: waiting for StatefulSet/dagster-k8s-engine 0/8 ready" in m for m in logs), logs
    assert any(m.startswith("k8s: deleted Job/dagster-k8s-trainer") for m in logs), logs
    after = objects_of_run(admin, namespace)
    assert sorted(after) == ["ConfigMap/dagster-k8s-plan", "PersistentVolumeClaim/dagster-k8s-data"]


def test_a_fleet_that_never_gets_ready_fails_the_run_and_its_workloads_are_deleted(kubeconfig, admin, namespace, tmp_path, no_controllers):
    controllers = Controllers(admin, namespace, None, ready_after_s=0.5)
    result, logs = materialize(tmp_path, kubeconfig, run_file(tmp_path, namespace), fleet_ready_timeout_s=4.0)
    controllers.thread.join(timeout=60)
    assert controllers.error is None, controllers.error
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "the fleet was not ready within 4 s (launcher fleet_ready_timeout_s)" in str(failure.event_specific_data.error)
    assert WORKLOADS <= set(controllers.seen_before_ready)
    assert sorted(objects_of_run(admin, namespace)) == ["ConfigMap/dagster-k8s-plan", "PersistentVolumeClaim/dagster-k8s-data"]


def test_a_failed_trainer_job_fails_the_run_and_keep_fleet_leaves_the_fleet(kubeconfig, admin, namespace, tmp_path, no_controllers):
    controllers = Controllers(admin, namespace, "failed")
    result, logs = materialize(tmp_path, kubeconfig, run_file(tmp_path, namespace, keep_fleet=True))
    controllers.thread.join(timeout=60)
    assert controllers.error is None, controllers.error
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert f"trainer Job {namespace}/{RUN}-trainer failed" in str(failure.event_specific_data.error)
    after = set(objects_of_run(admin, namespace))
    assert WORKLOADS <= after and not any(name.startswith("Job/") for name in after)
