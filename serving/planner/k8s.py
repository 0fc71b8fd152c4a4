"""Kubernetes manifests of a planned run, validated offline against the Kubernetes schemas.

One run is: the shared volume (PVC), the resolved plan (ConfigMap), the trainer (Job), the engine
fleet (SGLang servers, each pod with the capture sidecar on localhost), the router (Deployment +
Service), and the sandbox pool (a controller Deployment with the RBAC to create sandbox pods, and a
NetworkPolicy that cuts sandbox pods off the network).

The engines are a StatefulSet behind a headless Service rather than a Deployment: the router is
given each replica's address (``--worker URL@POOL:GPUS``), and a StatefulSet's pods have stable
names (``RUN-engine-0.RUN-engine.NAMESPACE.svc``) that survive restarts.

Every container runs a module's ``__main__`` (``WORKLOAD_MODULES``), the same entry points that run
locally. ``posttrain run --target k8s --dry-run`` prints these manifests; without ``--dry-run`` they
are created through the Kubernetes API.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving import sglang
from serving.planner.resolve import Plan
from serving.planner.runner import TRAINER_MODULE, trainer_args

# The entry point of each workload, run as ``python -m MODULE``.
WORKLOAD_MODULES = {
    "trainer": TRAINER_MODULE,
    "capture": "serving.capture",  # the engine pods' sidecar, from serving.sglang's launch spec
    "router": "serving.router",
    "sandbox_pool": "sandboxes.pool",
}

SGLANG_PORT = sglang.SGLANG_PORT
CAPTURE_PORT = sglang.CAPTURE_PORT
ROUTER_PORT = 30100
DATA_MOUNT = "/run-data"  # where serving.sglang's engine pods mount the run volume; the same everywhere
PLAN_MOUNT = "/etc/posttrain"
PLAN_FILE = "resolved-plan.json"


def k8s_name(name: str) -> str:
    """A DNS-1123 label made from a run name (lowercase alphanumerics and '-', at most 40 chars)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    return label or "run"


def _meta(plan: Plan, name: str, component: str) -> dict[str, Any]:
    return {
        "name": f"{k8s_name(plan.run_name)}-{name}",
        "namespace": plan.run_file.kubernetes.namespace,
        "labels": _labels(plan, component),
    }


def _labels(plan: Plan, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "posttrain",
        "app.kubernetes.io/component": component,
        "posttrain.dev/run": k8s_name(plan.run_name),
    }


def _volumes(plan: Plan) -> list[dict[str, Any]]:
    base = k8s_name(plan.run_name)
    return [
        {"name": "data", "persistentVolumeClaim": {"claimName": f"{base}-data"}},
        {"name": "plan", "configMap": {"name": f"{base}-plan"}},
    ]


_MOUNTS = [
    {"name": "data", "mountPath": DATA_MOUNT},
    {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
]


def _env(plan: Plan) -> list[dict[str, str]]:
    return [
        {"name": "POSTTRAIN_HOME", "value": DATA_MOUNT},
        {"name": "POSTTRAIN_RUN_DIR", "value": run_dir_in_pod(plan)},
        {"name": "POSTTRAIN_PLAN", "value": f"{PLAN_MOUNT}/{PLAN_FILE}"},
    ]


def run_dir_in_pod(plan: Plan) -> str:
    return f"{DATA_MOUNT}/runs/{plan.run_name}"


def _pod_spec(plan: Plan, containers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers, "volumes": _volumes(plan), **extra}
    if plan.run_file.kubernetes.service_account and "serviceAccountName" not in spec:
        spec["serviceAccountName"] = plan.run_file.kubernetes.service_account
    return spec


def _gpu_resources(gpus: int, cpu: str, memory: str) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = gpus
    return resources


def build_manifests(plan: Plan) -> list[dict[str, Any]]:
    """Every object of the run, in the order they should be created."""
    rf = plan.run_file
    kube = rf.kubernetes
    base = k8s_name(plan.run_name)
    image = kube.image
    engine_service_name = f"{base}-engine"
    workers = [
        f"http://{engine_service_name}-{i}.{engine_service_name}.{kube.namespace}.svc:{CAPTURE_PORT}"
        f"@reserved:{rf.inference.gpus_per_engine}"
        for i in range(rf.inference.engines)
    ]
    router_url = f"http://{base}-router.{kube.namespace}.svc:{ROUTER_PORT}"
    pool_name = f"{base}-sandbox-pool"  # its service account may create sandbox pods (pool and trainer)

    volume: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(plan, "data", "volume"),
        "spec": {
            # Trainer, engines and sandbox pool mount it at once: adapters for late joiners, the store.
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": f"{kube.volume_gib}Gi"}},
        },
    }
    if kube.storage_class:
        volume["spec"]["storageClassName"] = kube.storage_class

    plan_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, "plan", "plan"),
        "data": {PLAN_FILE: plan.to_json_text()},
    }

    trainer = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(plan, "trainer", "trainer"),
        "spec": {
            # The trainer resumes from its last checkpoint and the durable rollout store after a crash.
            "backoffLimit": 3,
            "template": {
                "metadata": {"labels": _labels(plan, "trainer")},
                "spec": _pod_spec(plan, [{
                    "name": "trainer",
                    "image": image,
                    "command": ["python", "-m", WORKLOAD_MODULES["trainer"],
                                *trainer_args(f"{PLAN_MOUNT}/{PLAN_FILE}", run_dir_in_pod(plan))],
                    "env": [*_env(plan), {"name": "POSTTRAIN_ROUTER_URL", "value": router_url}],
                    "volumeMounts": _MOUNTS,
                    "resources": _gpu_resources(rf.trainer.gpus, "4", "32Gi"),
                }], restartPolicy="Never", serviceAccountName=pool_name),
            },
        },
    }  # fmt: skip

    # One engine pod is serving's launch spec (SGLang on localhost, the capture sidecar in front of it,
    # the run volume mounted for adapters); here it becomes a StatefulSet so each replica has a name.
    engines = sglang.sglang_launch_spec(
        plan.sglang_knobs(), name=engine_service_name, image=rf.inference.sglang_image, sidecar_image=image,
        replicas=rf.inference.engines, namespace=kube.namespace, gpus=rf.inference.gpus_per_engine,
        adapters_volume_claim=f"{base}-data", pool="reserved",
    )
    engines["kind"] = "StatefulSet"
    engines["metadata"]["labels"].update(_labels(plan, "engine"))
    engines["spec"]["selector"] = {"matchLabels": _labels(plan, "engine")}
    engines["spec"]["template"]["metadata"]["labels"].update(_labels(plan, "engine"))
    engines["spec"]["serviceName"] = engine_service_name
    engines["spec"]["podManagementPolicy"] = "Parallel"  # replicas start together, not one by one
    engine_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, "engine", "engine"),
        "spec": {
            "clusterIP": "None",  # headless: the router addresses each replica, sessions are sticky
            "selector": _labels(plan, "engine"),
            "ports": [{"name": "capture", "port": CAPTURE_PORT, "targetPort": CAPTURE_PORT}],
        },
    }
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, "router", "router"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _labels(plan, "router")},
            "template": {
                "metadata": {"labels": _labels(plan, "router")},
                "spec": _pod_spec(plan, [{
                    "name": "router",
                    "image": image,
                    "command": ["python", "-m", WORKLOAD_MODULES["router"], "--host", "0.0.0.0",
                                "--port", str(ROUTER_PORT), "--policy", "kv_headroom",
                                *[arg for w in workers for arg in ("--worker", w)],
                                "--adapters-volume", f"{run_dir_in_pod(plan)}/adapters"],
                    "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": ROUTER_PORT}},
                    "env": _env(plan),
                    "volumeMounts": _MOUNTS,
                    "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
                }]),
            },
        },
    }  # fmt: skip
    router_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, "router", "router"),
        "spec": {"selector": _labels(plan, "router"),
                 "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": ROUTER_PORT}]},
    }  # fmt: skip

    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, "sandbox-pool", "sandbox-pool")}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(plan, "sandbox-pool", "sandbox-pool"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(plan, "sandbox-pool", "sandbox-pool"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": pool_name},
        "subjects": [{"kind": "ServiceAccount", "name": pool_name, "namespace": kube.namespace}],
    }
    sbx = rf.sandbox
    max_sandboxes = sbx.max_sandboxes or plan.producer_budget_samples
    pool = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, "sandbox-pool", "sandbox-pool"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _labels(plan, "sandbox-pool")},
            "template": {
                "metadata": {"labels": _labels(plan, "sandbox-pool")},
                "spec": _pod_spec(plan, [{
                    "name": "sandbox-pool",
                    "image": image,
                    "command": ["python", "-m", WORKLOAD_MODULES["sandbox_pool"],
                                "--namespace", kube.namespace, "--max-sandboxes", str(max_sandboxes),
                                "--cpus", f"{sbx.cpus:g}", "--memory-gib", f"{sbx.memory_gib:g}",
                                "--command-timeout-s", f"{sbx.command_timeout_s:g}",
                                "--sandbox-label", f"posttrain.dev/sandbox-of={base}"],
                    "env": _env(plan),
                    "volumeMounts": _MOUNTS,
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                }], serviceAccountName=pool_name),
            },
        },
    }  # fmt: skip
    no_network = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(plan, "sandboxes-no-network", "sandbox"),
        "spec": {
            # Sandboxes have no network: no egress at all; ingress only from this run's own pods
            # (the harness talks to the pxd daemon inside).
            "podSelector": {"matchLabels": {"posttrain.dev/sandbox-of": base}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"posttrain.dev/run": base}}}]}],
            "egress": [],
        },
    }
    manifests = [volume, plan_map, account, role, binding, no_network, engine_service, engines,
                 router_service, router, pool, trainer]  # fmt: skip
    # Plain, unshared data: printed YAML then has no anchors, and a caller may edit one object safely.
    return json.loads(json.dumps(manifests))


def missing_entry_points() -> list[str]:
    """Workload modules the manifests run that this checkout does not have (yet)."""
    import importlib.util

    missing = []
    for module in WORKLOAD_MODULES.values():
        name = module if module.count(".") else f"{module}.__main__"
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return missing


def validate_manifests(manifests: list[dict[str, Any]], kubernetes_version: str | None = None) -> list[str]:
    """Validate against the Kubernetes JSON schemas (strict: unknown fields fail); return problems."""
    import kubernetes_validate

    version = kubernetes_version or kubernetes_validate.latest_version()
    problems = []
    for manifest in manifests:
        what = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            # It is a jsonschema ValidationError: the path into the manifest and a one-line message.
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            problems.append(f"{what}: {where}: {exc.message.splitlines()[0]}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
            problems.append(f"{what}: {getattr(exc, 'message', exc)}")
    return problems


def kubernetes_schema_version(kubernetes_version: str | None = None) -> str:
    import kubernetes_validate

    return kubernetes_version or kubernetes_validate.latest_version()
