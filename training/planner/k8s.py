"""Kubernetes manifests of a planned run, validated offline against the Kubernetes schemas.

One run is: the shared volume (PVC), the resolved plan (ConfigMap), the trainer (Job), the engine
fleet (SGLang servers, each pod with the capture sidecar on localhost), the router (Deployment +
Service), and the sandbox pool (``python -m sandboxes.pool``: a Deployment + Service that creates
one pod per episode through the Kubernetes API).

The engines are a StatefulSet behind a headless Service rather than a Deployment: the router is
given each replica's address (``--worker URL@POOL:GPUS``), and a StatefulSet's pods have stable
names (``RUN-engine-0.RUN-engine.NAMESPACE.svc``) that survive restarts.

Least privilege, as an operator reads it:

- only the sandbox pool's service account has a Role: create, get, list, patch and delete pods,
  attach to and exec into them (``pods/attach``, ``pods/exec``), keep its owner Leases, and
  ``use`` the PodSecurityPolicy ``posttrain-sandbox`` (:data:`sandboxes.k8s.SANDBOX_POD_SECURITY_POLICY`):
  where PodSecurityPolicy admission runs (Kubernetes <= 1.24; the test plane), the pods its token
  creates must be sandbox-shaped (emptyDir volumes only, non-root, no privilege, no host
  namespaces, gVisor or Kata); on current clusters :func:`sandbox_pool_admission_policy` says the
  same; no other account of the run is bound to anything, and no other pod mounts a token;
- the trainer reaches sandboxes through the pool's HTTP API (``POSTTRAIN_SANDBOX_POOL_URL``), which
  needs the run's credential, and the pool's NetworkPolicy admits only the run's trainer pods;
- the router admits only the run's trainer and eval pods and its engines (NetworkPolicy
  ``R-router-ingress``);
- sandbox pods (labels :func:`sandboxes.k8s.sandbox_selector`) get no ingress and no egress;
- engine pods admit only the router (model calls) and the trainer (adapter uploads), on the capture
  sidecar's port (SGLang itself listens on the pod IP for the kubelet's probes, which NetworkPolicy
  does not filter);
- the trainer, the router, the capture sidecars and the sandbox pool share the run's trainer
  credential (:mod:`serving.capture_store`: reading a session and changing adapters need it; the
  pool's API answers only to it) through a Secret
  (``RUN-credential``, key ``credential``) given to them as ``$POSTTRAIN_TRAINER_CREDENTIAL``; the
  manifests carry no value: the first apply makes a random one and every later apply keeps it
  (``training.planner.runner.apply_k8s``), so ``--dry-run`` never prints it;
- every container runs as uid 1000 without privilege escalation, with every capability dropped,
  the RuntimeDefault seccomp profile and a read-only root; ``/tmp`` (and ``HOME`` in it) is a
  writable emptyDir, multi-GPU pods get a memory-backed ``/dev/shm``.

Every container runs a module's ``__main__`` (``WORKLOAD_MODULES``), the same entry points that run
locally. ``posttrain run --target k8s --dry-run`` prints these manifests; without ``--dry-run`` they
are applied server-side (``training.planner.runner.apply_k8s``), so a second run changes nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from typing import Any

from sandboxes.k8s import LABEL_PREFIX, RUNTIME_CLASSES, SANDBOX_POD_SECURITY_POLICY, label_value, sandbox_selector
from serving import sglang
from serving.capture_store import CREDENTIAL_ENV
from serving.engines.vllm import lora_rank_slot
from training.config import TrainConfig
from training.planner.resolve import Plan
from training.planner.runner import CREDENTIAL_COMPONENT, CREDENTIAL_KEY, TRAINER_MODULE, trainer_args, trainer_launcher

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
POOL_PORT = 30200  # sandboxes.pool.DEFAULT_PORT
DATA_MOUNT = "/run-data"  # where serving.sglang's engine pods mount the run volume; the same everywhere
PLAN_MOUNT = "/etc/posttrain"
PLAN_FILE = "resolved-plan.json"
RUN_AS = 1000  # the uid and gid of every workload container (the sandbox user is the same uid)
MANAGED_BY = "posttrain"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# The run's pods that may call the router: the trainer, a checkpoint's eval Job, and the engines
ROUTER_CLIENTS = ("trainer", "eval", "engine")
POOL_CLIENTS = ("trainer", "eval")
ENGINE_CLIENTS = ("router", "trainer")  # the pods that may call the engines (their capture front)
EVAL_MODULE = "training.fleet_eval"  # a checkpoint's deepswe_eval as a pod of the run (eval_pod)

# a vLLM CPU replica's startup probe: 10 s apart, this many failures (30 minutes) before a restart
START_PROBE_FAILURES = 180


def k8s_name(name: str) -> str:
    """A DNS-1123 label made from a run name (lowercase alphanumerics and '-', at most 40 chars)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    return label or "run"


def _version(plan: Plan) -> str:
    """``app.kubernetes.io/version``: the workload image's tag (or digest), else ``unversioned``."""
    image = plan.run_file.kubernetes.image
    ref = image.rsplit("/", 1)[-1]
    version = ref.split("@", 1)[1] if "@" in ref else (ref.split(":", 1)[1] if ":" in ref else "unversioned")
    return label_value(version.replace("sha256:", "sha256-"))


def _selector(plan: Plan, component: str) -> dict[str, str]:
    """The labels a workload's selectors match: stable for the run's life (selectors are immutable)."""
    return {
        "app.kubernetes.io/name": "posttrain",
        "app.kubernetes.io/instance": k8s_name(plan.run_name),
        "app.kubernetes.io/component": component,
    }


def _labels(plan: Plan, component: str) -> dict[str, str]:
    return {
        **_selector(plan, component),
        "app.kubernetes.io/version": _version(plan),
        "app.kubernetes.io/part-of": "posttrain",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "posttrain.dev/run": k8s_name(plan.run_name),
    }


def _meta(plan: Plan, name: str, component: str) -> dict[str, Any]:
    return {
        "name": f"{k8s_name(plan.run_name)}-{name}",
        "namespace": plan.run_file.kubernetes.namespace,
        "labels": _labels(plan, component),
    }


def volume_claim(plan: Plan) -> str:
    """The claim every pod of the run mounts at :data:`DATA_MOUNT`: ``[kubernetes] volume_claim`` (a
    claim already there, which several runs and Dagster's storage root share: each run keeps to
    ``runs/RUN``), else the run's own ``R-data``, which the manifests make."""
    return plan.run_file.kubernetes.volume_claim or f"{k8s_name(plan.run_name)}-data"


def run_dir_in_pod(plan: Plan) -> str:
    return f"{DATA_MOUNT}/runs/{plan.run_name}"


def engine_model_path(plan: Plan) -> str:
    """The model a replica serves, as a pod reads it: an absolute ``[model] path`` as it is, a relative
    one under the run volume's root (every workload container's working directory, as the directory
    posttrain runs in is locally; made absolute because the engine server runs in a folder of its
    own), else ``[model] name``."""
    rf = plan.run_file
    if rf.model.path:
        return rf.model.path if rf.model.path.startswith("/") else f"{DATA_MOUNT}/{rf.model.path}"
    return rf.model.name or "MODEL"


def _env(plan: Plan) -> list[dict[str, str]]:
    return [
        {"name": "POSTTRAIN_HOME", "value": DATA_MOUNT},
        {"name": "POSTTRAIN_RUN_DIR", "value": run_dir_in_pod(plan)},
        {"name": "POSTTRAIN_PLAN", "value": f"{PLAN_MOUNT}/{PLAN_FILE}"},
        # the root is read-only: caches (Hugging Face, Triton, pip, torch) go to the /tmp emptyDir
        {"name": "HOME", "value": "/tmp/home"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
    ]


_MOUNTS = [
    {"name": "data", "mountPath": DATA_MOUNT},
    {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
    {"name": "tmp", "mountPath": "/tmp"},
]

POD_SECURITY = {
    "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
    # a chown of the whole run volume at every start would take minutes on a large volume
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "privileged": False,
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def credential_secret_name(plan: Plan) -> str:
    return f"{k8s_name(plan.run_name)}-{CREDENTIAL_COMPONENT}"


def _fleet_client_env(plan: Plan) -> list[dict[str, Any]]:
    """What a pod that uses the run's fleet is given (the trainer, a checkpoint's eval pod): the
    router's and the sandbox pool's Services, the run's credential, and the sandbox image of tasks
    that are folders, not images (:func:`evals.sandbox.platform_sandbox_factory`)."""
    base, ns, rf = k8s_name(plan.run_name), plan.run_file.kubernetes.namespace, plan.run_file
    return [{"name": "POSTTRAIN_ROUTER_URL", "value": f"http://{base}-router.{ns}.svc:{ROUTER_PORT}"},
            {"name": "POSTTRAIN_SANDBOX_POOL_URL", "value": f"http://{base}-sandbox-pool.{ns}.svc:{POOL_PORT}"},
            _credential_env(plan),
            *([{"name": "POSTTRAIN_SANDBOX_IMAGE", "value": rf.sandbox.image}] if rf.sandbox.image else [])]


def _credential_env(plan: Plan) -> dict[str, Any]:
    """``$POSTTRAIN_TRAINER_CREDENTIAL`` from the run's Secret (never a value in the manifest)."""
    return {"name": CREDENTIAL_ENV,
            "valueFrom": {"secretKeyRef": {"name": credential_secret_name(plan), "key": CREDENTIAL_KEY}}}


def _scheduling(plan: Plan, gpus: int) -> dict[str, Any]:
    """priorityClassName and tolerations: GPU pods tolerate the usual ``nvidia.com/gpu`` taint; the
    run file's ``[kubernetes] priority_class`` / ``tolerations`` apply when the schema has them."""
    kube = plan.run_file.kubernetes
    out: dict[str, Any] = {}
    tolerations = [dict(t) for t in (getattr(kube, "tolerations", None) or [])]
    if gpus and GPU_TOLERATION not in tolerations:
        tolerations.insert(0, dict(GPU_TOLERATION))
    if tolerations:
        out["tolerations"] = tolerations
    if getattr(kube, "priority_class", None):
        out["priorityClassName"] = kube.priority_class
    return out


def _pod_spec(plan: Plan, containers: list[dict[str, Any]], *, gpus: int = 0, service_account: str | None = None,
              token: bool = False, extra_volumes: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """A workload pod: the run volume, the plan, a writable /tmp; locked down; no API token unless
    ``token`` (the sandbox pool alone)."""
    base = k8s_name(plan.run_name)
    volumes = [
        {"name": "data", "persistentVolumeClaim": {"claimName": volume_claim(plan)}},
        {"name": "plan", "configMap": {"name": f"{base}-plan"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},
        *(extra_volumes or []),
    ]
    for c in containers:
        c.setdefault("securityContext", dict(CONTAINER_SECURITY))
        # relative paths of the run file (the model, tasks) are the run volume's, as they are the
        # working directory's locally
        c.setdefault("workingDir", DATA_MOUNT)
    spec: dict[str, Any] = {
        "containers": containers, "volumes": volumes, "securityContext": dict(POD_SECURITY),
        "automountServiceAccountToken": token, "enableServiceLinks": False, **_scheduling(plan, gpus), **extra,
    }
    account = service_account or plan.run_file.kubernetes.service_account
    if account:
        spec["serviceAccountName"] = account
    return spec


def _shm(gib: int | None = None) -> dict[str, Any]:
    """A memory-backed /dev/shm (the container runtime's default is 64 MiB; NCCL needs more)."""
    empty: dict[str, Any] = {"medium": "Memory"}
    if gib:
        empty["sizeLimit"] = f"{gib}Gi"
    return {"name": "dshm", "emptyDir": empty}


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        resources["requests"]["nvidia.com/gpu"] = str(gpus)
        resources["limits"]["nvidia.com/gpu"] = str(gpus)
    return resources


def _pdb(plan: Plan, name: str, component: str, **budget: Any) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(plan, name, component),
        "spec": {"selector": {"matchLabels": _selector(plan, component)}, **budget},
    }


def _http_service(plan: Plan, component: str, port: int) -> dict[str, Any]:
    """A ClusterIP Service named after ``component`` in front of its pods' ``http`` port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, component, component),
        "spec": {"selector": _selector(plan, component), "ports": [{"name": "http", "protocol": "TCP", "port": port, "targetPort": port}]},
    }


def _sglang_engines(plan: Plan, engine_service_name: str, plan_hash: dict[str, str]) -> dict[str, Any]:
    """The SGLang fleet (GPUs): one engine pod is serving's launch spec (SGLang on the pod IP for its
    probes, the capture sidecar in front of it on localhost, the run volume mounted for adapters);
    here it becomes a StatefulSet so each replica has a name."""
    rf, kube, image, ns = plan.run_file, plan.run_file.kubernetes, plan.run_file.kubernetes.image, plan.run_file.kubernetes.namespace
    engine_gpus = rf.inference.gpus_per_engine
    if rf.inference.gpu == "cpu":
        raise ValueError("[inference] engine = \"sglang\" on Kubernetes needs GPUs (SGLang's image); gpu = \"cpu\" "
                         "is served by engine = \"vllm\" (vLLM's CPU build in the project's image)")
    try:
        engine_image = sglang.pinned_image(rf.inference.sglang_image)
    except ValueError as exc:
        raise ValueError(f"[inference] sglang_image: {exc}") from None
    engines = sglang.sglang_launch_spec(
        plan.sglang_knobs(), name=engine_service_name, image=engine_image, sidecar_image=image,
        replicas=rf.inference.engines, namespace=ns, gpus=engine_gpus,
        adapters_volume_claim=volume_claim(plan), pool="reserved",
    )
    engines["kind"] = "StatefulSet"
    engines["metadata"]["labels"].update(_labels(plan, "engine"))
    engines["spec"]["selector"] = {"matchLabels": _selector(plan, "engine")}
    template = engines["spec"]["template"]
    template["metadata"]["labels"].update(_labels(plan, "engine"))
    template["metadata"]["annotations"] = dict(plan_hash)
    engines["spec"]["serviceName"] = engine_service_name
    engines["spec"]["podManagementPolicy"] = "Parallel"  # replicas start together, not one by one
    sglang_c, capture_c = template["spec"]["containers"]
    sglang_c["resources"]["requests"].update(cpu=plan.pods["engine"]["cpu"], memory=plan.pods["engine"]["memory"])
    sglang_c["resources"]["limits"]["memory"] = sglang_c["resources"]["requests"]["memory"]
    capture_c["resources"] = _resources("1", "2Gi")
    tmp_mount = {"name": "tmp", "mountPath": "/tmp"}
    for c in (sglang_c, capture_c):
        c["securityContext"] = dict(CONTAINER_SECURITY)
        c["volumeMounts"].append(tmp_mount)
        c["env"] = [*c.get("env", []), {"name": "HOME", "value": "/tmp/home"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"}]
    capture_c["env"].append(_credential_env(plan))  # SGLang itself gets none: it is reached only through the sidecar
    template["spec"]["volumes"].append({"name": "tmp", "emptyDir": {"sizeLimit": "50Gi"}})
    template["spec"].update(securityContext=dict(POD_SECURITY), automountServiceAccountToken=False,
                            enableServiceLinks=False, **_scheduling(plan, engine_gpus))
    if kube.service_account:
        template["spec"]["serviceAccountName"] = kube.service_account
    return engines


def _vllm_engines(plan: Plan, engine_service_name: str, plan_hash: dict[str, str]) -> dict[str, Any]:
    """The CPU fleet: each pod is one replica as the local path runs it (``python -m serving.replica
    --engine vllm``: vLLM's CPU build on the pod's loopback, the capture front on the pod IP), from the
    run's image, loading the newest adapter of the run volume before it serves. A StatefulSet, as the
    SGLang fleet is, so that each replica has a name the router is given."""
    rf, kube = plan.run_file, plan.run_file.kubernetes
    if rf.inference.gpu != "cpu":
        raise ValueError(f"[inference] engine = \"vllm\" on Kubernetes serves with vLLM's CPU build (the project's image); "
                         f"gpu = {rf.inference.gpu!r} needs engine = \"sglang\"")
    size = plan.pods["engine"]
    labels = _labels(plan, "engine")
    probe = {"httpGet": {"path": "/health", "port": CAPTURE_PORT}, "periodSeconds": 5, "timeoutSeconds": 5}
    command = ["python", "-m", "serving.replica", "--engine", "vllm", "--model", engine_model_path(plan),
               "--host", "0.0.0.0", "--port", str(CAPTURE_PORT), "--adapters-dir", f"{run_dir_in_pod(plan)}/adapters",
               "--max-loras", str(plan.resolved["sglang_max_loras_per_batch"]),
               "--max-lora-rank", str(lora_rank_slot(rf.trainer.lora_rank or TrainConfig().lora_rank)),
               "--kv-cache-gib", str(size["kv_cache_gib"]), "--max-model-len", str(plan.max_context_length),
               "--max-running-requests", str(plan.admission)]
    container = {
        "name": "replica",
        "image": kube.image,
        "command": command,
        "workingDir": DATA_MOUNT,
        "ports": [{"name": "capture", "containerPort": CAPTURE_PORT}],
        # the front answers /health once vLLM does; vLLM's CPU build loads and warms up in minutes
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": START_PROBE_FAILURES},
        "readinessProbe": probe,
        "env": [*_env(plan), _credential_env(plan)],
        "volumeMounts": _MOUNTS,
        "resources": _resources(size["cpu"], size["memory"]),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(plan, "engine", "engine"),
        "spec": {
            "replicas": rf.inference.engines,
            "serviceName": engine_service_name,
            "podManagementPolicy": "Parallel",  # replicas start together, not one by one
            "selector": {"matchLabels": _selector(plan, "engine")},
            "template": {
                "metadata": {"labels": labels, "annotations": dict(plan_hash)},
                "spec": _pod_spec(plan, [container]),
            },
        },
    }


def _engine_service_name(plan: Plan) -> str:
    return f"{k8s_name(plan.run_name)}-engine"


def _ingress_policy(plan: Plan, name: str, component: str, clients: tuple[str, ...], port: int) -> dict[str, Any]:
    """A NetworkPolicy that lets only the pods of ``clients`` (components of the run) reach ``port``
    of ``component``'s pods; the kubelet's probes are not filtered."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(plan, name, component),
        "spec": {
            "podSelector": {"matchLabels": _selector(plan, component)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": _selector(plan, c)}} for c in clients],
                         "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def _network_policies(plan: Plan) -> list[dict[str, Any]]:
    """Who may connect to what: sandboxes to nothing and from nothing, the pool, the engines and the
    router each from their clients only."""
    no_network = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(plan, "sandboxes-no-network", "sandbox"),
        "spec": {
            # Sandboxes have no network at all: the pool reaches pxd through the API server's attach
            # stream (kubelet to container runtime), which is not pod traffic. Both directions are
            # listed and no rule is given: nothing is allowed (an empty list, written out, is stored
            # as none, and every apply would then bump the object's generation).
            "podSelector": {"matchLabels": sandbox_selector(k8s_name(plan.run_name))},
            "policyTypes": ["Ingress", "Egress"],
        },
    }
    return [
        no_network,
        # Only the run's trainer and its checkpoints' eval pods may ask for sandboxes; the pool's own
        # egress (the API server) is open.
        _ingress_policy(plan, "sandbox-pool-ingress", "sandbox-pool", POOL_CLIENTS, POOL_PORT),
        # SGLang listens on the pod IP for the kubelet's probes (which NetworkPolicy does not
        # filter), and its API loads weights and adapters from any path: only the router (model
        # calls) and the trainer (each adapter version's sharded upload) may connect, and only
        # to the capture sidecar, which talks to SGLang on localhost.
        _ingress_policy(plan, "engine-ingress", "engine", ENGINE_CLIENTS, CAPTURE_PORT),
        # The router publishes adapters and carries every model call: only the run's trainer and
        # eval pods and its engines may connect (sandboxes have no network; nothing else of the
        # namespace, nor of the cluster, is let in).
        _ingress_policy(plan, "router-ingress", "router", ROUTER_CLIENTS, ROUTER_PORT),
    ]


def _run_volume(plan: Plan) -> dict[str, Any]:
    kube = plan.run_file.kubernetes
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
    return volume


def _trainer_job(plan: Plan) -> dict[str, Any]:
    rf = plan.run_file
    gpus = rf.trainer.gpus
    return {
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
                    "image": rf.kubernetes.image,
                    # one process per GPU (torchrun) when the pod has several: every GPU trains
                    "command": [*trainer_launcher(gpus), *trainer_args(f"{PLAN_MOUNT}/{PLAN_FILE}", run_dir_in_pod(plan))],
                    "env": [*_env(plan), *_fleet_client_env(plan)],
                    "volumeMounts": [*_MOUNTS, *([{"name": "dshm", "mountPath": "/dev/shm"}] if gpus > 1 else [])],
                    "resources": _resources(plan.pods["trainer"]["cpu"], plan.pods["trainer"]["memory"], gpus),
                }], gpus=gpus, service_account=rf.kubernetes.service_account or f"{k8s_name(plan.run_name)}-trainer",
                    extra_volumes=[_shm(16)] if gpus > 1 else None, restartPolicy="Never"),
            },
        },
    }  # fmt: skip


def _engine_fleet(plan: Plan, plan_hash: dict[str, str]) -> list[dict[str, Any]]:
    """The engines' headless Service, their StatefulSet (vLLM's CPU build or SGLang) and its
    PodDisruptionBudget."""
    engine_service_name = _engine_service_name(plan)
    if plan.engine == "vllm":
        engines = _vllm_engines(plan, engine_service_name, plan_hash)
    else:
        engines = _sglang_engines(plan, engine_service_name, plan_hash)
    engine_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, "engine", "engine"),
        "spec": {
            "clusterIP": "None",  # headless: the router addresses each replica, sessions are sticky
            "selector": _selector(plan, "engine"),
            "ports": [{"name": "capture", "protocol": "TCP", "port": CAPTURE_PORT, "targetPort": CAPTURE_PORT}],
        },
    }
    # one engine at a time may be drained (the router moves its sessions); a lone engine never is
    engine_pdb = _pdb(plan, "engine", "engine", maxUnavailable=1 if plan.run_file.inference.engines > 1 else 0)
    return [engine_service, engines, engine_pdb]


def _one_pod_deployment(plan: Plan, component: str, plan_hash: dict[str, str], pod_spec: dict[str, Any],
                        **spec: Any) -> dict[str, Any]:
    """A Deployment of one pod of ``component`` (``spec``: more of the Deployment's spec, such as its
    strategy), rolled when the plan changes (``plan_hash`` on its template)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(plan, component, component),
        "spec": {
            "replicas": 1,
            **spec,
            "selector": {"matchLabels": _selector(plan, component)},
            "template": {
                "metadata": {"labels": _labels(plan, component), "annotations": dict(plan_hash)},
                "spec": pod_spec,
            },
        },
    }


def _router(plan: Plan, plan_hash: dict[str, str]) -> list[dict[str, Any]]:
    """The router's Service, its Deployment (every engine replica the fleet may be scaled to as a
    worker) and its PodDisruptionBudget."""
    rf = plan.run_file
    engine_service_name, ns = _engine_service_name(plan), rf.kubernetes.namespace
    workers = [
        f"http://{engine_service_name}-{i}.{engine_service_name}.{ns}.svc:{CAPTURE_PORT}"
        f"@reserved:{rf.inference.gpus_per_engine}"
        # every replica the StatefulSet may be scaled to: one not there yet joins when it answers
        for i in range(max(rf.inference.engines, rf.inference.max_engines or 0))
    ]
    router = _one_pod_deployment(plan, "router", plan_hash, _pod_spec(plan, [{
            "name": "router",
            "image": rf.kubernetes.image,
            "command": ["python", "-m", WORKLOAD_MODULES["router"], "--host", "0.0.0.0",
                        "--port", str(ROUTER_PORT), "--policy", "kv_headroom",
                        *[arg for w in workers for arg in ("--worker", w)],
                        "--adapters-volume", f"{run_dir_in_pod(plan)}/adapters"],
            "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": ROUTER_PORT}},
            "env": [*_env(plan), _credential_env(plan)],
            "volumeMounts": _MOUNTS,
            "resources": _resources(plan.pods["router"]["cpu"], plan.pods["router"]["memory"]),
        }]))  # fmt: skip
    # the run's only router carries every session: a drain waits for the run (or the operator)
    return [_http_service(plan, "router", ROUTER_PORT), router, _pdb(plan, "router", "router", maxUnavailable=0)]


def _service_accounts(plan: Plan) -> list[dict[str, Any]]:
    """The trainer's account (unless the run file names one) and the sandbox pool's, with the Role
    and RoleBinding of the pool: the only account with Kubernetes rights (it creates sandbox pods)."""
    kube = plan.run_file.kubernetes
    pool_name = f"{k8s_name(plan.run_name)}{POOL_ACCOUNT_SUFFIX}"
    accounts = []
    if not kube.service_account:  # the trainer's own account: bound to nothing, no token mounted
        accounts.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, "trainer", "trainer"),
                         "automountServiceAccountToken": False})
    accounts.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, "sandbox-pool", "sandbox-pool")})
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(plan, "sandbox-pool", "sandbox-pool"),
        "rules": [
            # what sandboxes.pool calls: create, read (wait), list (reap), patch (claim a warm pod), delete
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "patch", "delete"]},
            # attach (pxd's stdin/stdout) and exec open a websocket: a GET that recent API servers
            # also authorize as create. The pool attaches; exec is for a shell in a sandbox while debugging.
            {"apiGroups": [""], "resources": ["pods/attach", "pods/exec"], "verbs": ["create", "get"]},
            # the owner Lease of each pool process (renewed; the dead ones' deleted by the reaper)
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "get", "patch", "delete"]},
            # where PodSecurityPolicy admission runs, the only policy its pods may be admitted under:
            # sandbox-shaped pods only (no Secret, hostPath or token volumes, no privilege, no host
            # namespaces, non-root, gVisor or Kata); no other account of the run may use any policy,
            # so naming another service account in a pod gains nothing
            {"apiGroups": ["policy"], "resources": ["podsecuritypolicies"], "verbs": ["use"],
             "resourceNames": [SANDBOX_POD_SECURITY_POLICY]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(plan, "sandbox-pool", "sandbox-pool"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": pool_name},
        "subjects": [{"kind": "ServiceAccount", "name": pool_name, "namespace": kube.namespace}],
    }
    return [*accounts, role, binding]


def _sandbox_pool(plan: Plan, plan_hash: dict[str, str]) -> list[dict[str, Any]]:
    """The sandbox pool's Service and Deployment (the pool's own service account: it creates the
    sandbox pods, owned by its pod so that deleting the pool deletes them)."""
    rf = plan.run_file
    base, ns = k8s_name(plan.run_name), rf.kubernetes.namespace
    sbx = rf.sandbox
    max_sandboxes = sbx.max_sandboxes or plan.producer_budget_samples
    # a new pool starts only after the old one is gone (it reaps the old one's pods)
    pool = _one_pod_deployment(plan, "sandbox-pool", plan_hash, _pod_spec(plan, [{
            "name": "sandbox-pool",
            "image": rf.kubernetes.image,
            "command": ["python", "-m", WORKLOAD_MODULES["sandbox_pool"],
                        "--namespace", ns, "--run", base, "--host", "0.0.0.0", "--port", str(POOL_PORT),
                        "--max-sandboxes", str(max_sandboxes),
                        "--cpus", f"{sbx.cpus:g}", "--memory-gib", f"{sbx.memory_gib:g}",
                        "--command-timeout-s", f"{sbx.command_timeout_s:g}"],
            "ports": [{"name": "http", "containerPort": POOL_PORT}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": POOL_PORT}},
            "env": [*_env(plan),
                    # the owner reference of every sandbox pod: deleting the pool deletes them
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                    _credential_env(plan)],  # its API answers only to the run's credential
            "volumeMounts": _MOUNTS,
            # two stream threads and their buffers per connected sandbox: about 2 MiB each
            "resources": _resources(plan.pods["sandbox_pool"]["cpu"], plan.pods["sandbox_pool"]["memory"]),
        }], service_account=f"{base}{POOL_ACCOUNT_SUFFIX}", token=True), strategy={"type": "Recreate"})  # fmt: skip
    return [_http_service(plan, "sandbox-pool", POOL_PORT), pool]


def build_manifests(plan: Plan) -> list[dict[str, Any]]:
    """Every object of the run, in the order they should be applied: the run volume (unless the run
    file names a shared claim, which is the operator's), the plan, the credential's Secret, the
    service accounts and the pool's rights, the NetworkPolicies, then the engines, the router, the
    sandbox pool and the trainer's Job, each with its Service and PodDisruptionBudget."""
    # a changed plan rolls the long-running pods (they read it at start); the Job's template is immutable
    plan_hash = {"posttrain.dev/plan-sha256": hashlib.sha256(plan.to_json_text().encode()).hexdigest()[:16]}
    plan_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, "plan", "plan"),
        "data": {PLAN_FILE: plan.to_json_text()},
    }
    # No data here: apply_k8s makes the value at the first apply and keeps it after (see above).
    credential = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": _meta(plan, CREDENTIAL_COMPONENT, CREDENTIAL_COMPONENT)}
    volumes = [] if plan.run_file.kubernetes.volume_claim else [_run_volume(plan)]
    manifests = [*volumes, plan_map, credential, *_service_accounts(plan), *_network_policies(plan),
                 *_engine_fleet(plan, plan_hash), *_router(plan, plan_hash), *_sandbox_pool(plan, plan_hash),
                 _trainer_job(plan)]
    # Plain, unshared data: printed YAML then has no anchors, and a caller may edit one object safely.
    return [as_served(m) for m in json.loads(json.dumps(manifests))]


EVAL_POD_FILE = "eval-pod.json"  # in the run folder: eval_pod's answer, which deepswe_eval launches


def eval_pod(plan: Plan) -> dict[str, Any]:
    """The pod (``namespace``, ``metadata``, ``spec``) that evaluates a checkpoint of ``plan``'s run on
    the run's own fleet (``python -m training.fleet_eval``; ``deepswe_eval`` launches it through
    Dagster Pipes, setting its command and a ``checkpoint`` label): the trainer's image, volume,
    credential, router and pool, component ``eval`` (which the router's and the pool's
    NetworkPolicies admit), no Kubernetes rights, locked down like every workload. Small: the model
    runs on the engines and the episodes in sandbox pods. ``rl_run`` writes it into the run folder
    (:data:`EVAL_POD_FILE`), where the evaluations of the run's checkpoints read it."""
    base = k8s_name(plan.run_name)
    rf = plan.run_file
    spec = _pod_spec(plan, [{
        "name": "eval", "image": rf.kubernetes.image, "env": [*_env(plan), *_fleet_client_env(plan)],
        "volumeMounts": list(_MOUNTS),
        "resources": _resources("100m", "2Gi"),  # it mostly waits on the engines and the sandbox pods
    }], service_account=rf.kubernetes.service_account or f"{base}-trainer", restartPolicy="Never")
    return {"namespace": rf.kubernetes.namespace, "metadata": {"labels": _labels(plan, "eval")},
            "spec": json.loads(json.dumps(spec))}


POOL_ACCOUNT_SUFFIX = "-sandbox-pool"  # the pool's service account is RUN-sandbox-pool
ADMISSION_POLICY = "posttrain-sandbox-pool"


def sandbox_pool_admission_policy() -> list[dict[str, Any]]:
    """What a current cluster (Kubernetes >= 1.30: ``admissionregistration.k8s.io/v1``) enforces on
    the sandbox pools' tokens, where PodSecurityPolicy no longer exists: a ValidatingAdmissionPolicy
    and its binding, cluster-wide, installed once by the operator (as the RuntimeClass is; they are
    cluster-scoped, so not part of a run's namespaced manifests, which a user with rights in one
    namespace applies).

    It applies to requests by any service account named ``*-sandbox-pool`` in the request's
    namespace (the pool of run ``R`` is ``R-sandbox-pool``): a pod it creates, changes or deletes
    must be one of its run's sandboxes (labels ``posttrain.dev/role=sandbox``,
    ``posttrain.dev/run=R``, component ``sandbox``: the NetworkPolicy that cuts sandboxes off
    selects those), and a pod it creates or changes must have the shape of
    :func:`sandboxes.k8s.pod_spec`: the namespace's ``default`` account with no token, emptyDir
    volumes only, no environment from Secrets or ConfigMaps, no host namespaces or host ports,
    gVisor or Kata, and every container non-root, unprivileged, without privilege escalation, with
    every capability dropped and the RuntimeDefault seccomp profile. It may attach to or exec into its run's sandbox pods only
    (``sbx-R-...``). Pod Security Admission's ``restricted`` level (the namespace's labels) allows
    Secret and projected volumes and any service account; this closes those. Not exercised here:
    the test plane is 1.20 (PodSecurityPolicy, ``scripts/kube-local.sh``); the objects are
    validated offline against the current schemas, and the validations were evaluated by hand with
    cel-python on the escalation pods of tests/kube/test_pool_rbac.py (each refused) and on pods
    of :func:`sandboxes.k8s.pod_spec` (admitted).
    """
    def is_sandbox(pod: str) -> str:  # a CEL test that ``pod`` carries its run's sandbox labels
        labels = f"{pod}.metadata.labels"
        wanted = {f"{LABEL_PREFIX}/role": "'sandbox'", f"{LABEL_PREFIX}/run": "variables.run",
                  "app.kubernetes.io/component": "'sandbox'"}
        return " && ".join([f"has({labels})"] + [f"'{k}' in {labels} && {labels}['{k}'] == {v}" for k, v in wanted.items()])

    pod_write = "request.subResource == '' && request.operation in ['CREATE', 'UPDATE']"
    container_ok = ("has(c.securityContext) && has(c.securityContext.runAsNonRoot) && c.securityContext.runAsNonRoot"
                    " && has(c.securityContext.allowPrivilegeEscalation) && !c.securityContext.allowPrivilegeEscalation"
                    " && !(has(c.securityContext.privileged) && c.securityContext.privileged)"
                    " && has(c.securityContext.capabilities) && has(c.securityContext.capabilities.drop)"
                    " && 'ALL' in c.securityContext.capabilities.drop && !has(c.securityContext.capabilities.add)"
                    " && (has(c.securityContext.seccompProfile) ? c.securityContext.seccompProfile.type == 'RuntimeDefault'"
                    " : has(object.spec.securityContext) && has(object.spec.securityContext.seccompProfile)"
                    " && object.spec.securityContext.seccompProfile.type == 'RuntimeDefault')"
                    " && !has(c.envFrom) && (!has(c.env) || c.env.all(e, !has(e.valueFrom) || has(e.valueFrom.fieldRef)))"
                    " && (!has(c.ports) || c.ports.all(port, !has(port.hostPort) || port.hostPort == 0))")
    rule = lambda expression, message: {"expression": expression, "message": message}
    validations = [
        rule(f"request.subResource != '' || request.operation == 'CREATE' || ({is_sandbox('oldObject')})",
             "a sandbox pool may change or delete only its own run's sandbox pods"),
        rule(f"!({pod_write}) || ({is_sandbox('object')})",
             "a sandbox pool's pods carry its run's sandbox labels (posttrain.dev/role=sandbox, posttrain.dev/run, "
             "app.kubernetes.io/component=sandbox)"),
        rule(f"!({pod_write}) || ((!has(object.spec.serviceAccountName) || object.spec.serviceAccountName == 'default')"
             " && has(object.spec.automountServiceAccountToken) && !object.spec.automountServiceAccountToken)",
             "a sandbox pod runs as the namespace's default service account, without its token"),
        rule(f"!({pod_write}) || !has(object.spec.volumes) || object.spec.volumes.all(v, has(v.emptyDir))",
             "a sandbox pod has emptyDir volumes only (no Secret, ConfigMap, projected, hostPath or claim)"),
        rule(f"!({pod_write}) || (!(has(object.spec.hostNetwork) && object.spec.hostNetwork)"
             " && !(has(object.spec.hostPID) && object.spec.hostPID) && !(has(object.spec.hostIPC) && object.spec.hostIPC))",
             "a sandbox pod shares no host namespace"),
        rule(f"!({pod_write}) || (has(object.spec.runtimeClassName) && object.spec.runtimeClassName in {list(RUNTIME_CLASSES)})",
             f"a sandbox pod runs under RuntimeClass {' or '.join(RUNTIME_CLASSES)}"),
        rule(f"!({pod_write}) || (object.spec.containers.all(c, {container_ok})"
             f" && (!has(object.spec.initContainers) || object.spec.initContainers.all(c, {container_ok})))",
             "a sandbox pod's containers run non-root, unprivileged, without privilege escalation, with every "
             "capability dropped, the RuntimeDefault seccomp profile, no host port and no environment from Secrets "
             "or ConfigMaps"),
        rule("!(request.subResource in ['exec', 'attach']) || request.name.startsWith('sbx-' + variables.run + '-')",
             "a sandbox pool may attach to or exec into its own run's sandbox pods only"),
    ]
    account_prefix = "'system:serviceaccount:' + request.namespace + ':'"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": ADMISSION_POLICY, "labels": {"app.kubernetes.io/part-of": "posttrain",
                                                          "app.kubernetes.io/managed-by": MANAGED_BY}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["pods"]},
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CONNECT"], "resources": ["pods/exec", "pods/attach"]},
            ]},
            "matchConditions": [{"name": "by-a-sandbox-pool", "expression":
                                 f"request.userInfo.username.startsWith({account_prefix})"
                                 f" && request.userInfo.username.endsWith('{POOL_ACCOUNT_SUFFIX}')"}],
            "variables": [
                {"name": "account", "expression": f"request.userInfo.username.substring(({account_prefix}).size())"},
                {"name": "run", "expression": f"variables.account.substring(0, variables.account.size() - {len(POOL_ACCOUNT_SUFFIX)})"},
            ],
            "validations": validations,
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": ADMISSION_POLICY, "labels": dict(policy["metadata"]["labels"])},
        "spec": {"policyName": ADMISSION_POLICY, "validationActions": ["Deny"]},
    }
    return [policy, binding]


def as_served(manifest: Any) -> Any:
    """``manifest`` in the form a real API server's server-side apply accepts (Kubernetes 1.20 on).

    Every port names its ``protocol`` (SSA keys a port list by port *and* protocol and refuses an
    entry without one), and every resource quantity is a string (``nvidia.com/gpu: "8"``: SSA's
    typed merge refuses a number where the schema says quantity). Changes ``manifest`` in place.
    """
    if isinstance(manifest, list):
        for item in manifest:
            as_served(item)
    elif isinstance(manifest, dict):
        for key, value in manifest.items():
            if key == "ports" and isinstance(value, list):
                for port in value:
                    if isinstance(port, dict) and ("port" in port or "containerPort" in port):
                        port.setdefault("protocol", "TCP")
            elif key in ("requests", "limits") and isinstance(value, dict):
                for name, quantity in value.items():
                    if isinstance(quantity, (int, float)) and not isinstance(quantity, bool):
                        value[name] = f"{quantity:g}"
            as_served(value)
    return manifest

def missing_entry_points() -> list[str]:
    """Workload modules the manifests run that this checkout does not have (yet)."""
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
    # optional: kubernetes-validate (and its schemas) loads only when manifests are validated
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
    # optional: kubernetes-validate (and its schemas) loads only when manifests are validated
    import kubernetes_validate

    return kubernetes_version or kubernetes_validate.latest_version()
