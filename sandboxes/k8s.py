"""Kubernetes manifests for sandboxes: the Pod of one episode and the default-deny NetworkPolicy.

A sandbox pod runs ``pxd --stdio`` as its only container; the sandbox pool (:mod:`sandboxes.pool`)
talks to it by attaching to the container's stdin/stdout (the Kubernetes attach API), the same
protocol as the local runtimes, so the pod needs no network at all: the NetworkPolicy denies every
ingress and egress of the run's sandbox pods, which it selects by :func:`sandbox_selector` (every
pod of :func:`pod_spec` carries those labels). ``runtimeClassName`` selects gVisor (``gvisor``) or
Kata (``kata``).

The containers run locked down: non-root (uid 1000), no privilege escalation, every capability
dropped, the runtime's default seccomp profile, and a read-only root filesystem, so only the
workspace, ``/tmp`` and ``$HOME`` volumes are writable. A task that needs a writable root
(``writable_root=True``: a Harbor verifier that installs into the image's ``/opt/venv``, as
:func:`evals.tasks.needs_writable_root` decides) gets the sandbox container's root writable and
nothing else changed: as in the local runtimes (:mod:`sandboxes.runtimes`), the sandbox user can
write only what it owns in the image (``/usr`` and the rest of root's files stay unwritable to
it), and the writes land in the container's own writable layer, which counts against the pod's
``ephemeral-storage`` limit and goes with the pod. The init container keeps its read-only root.

Requests are a fraction of the limits (CPU 25 %, memory 40 % by default): sandboxes mostly idle
while the model thinks, and the placement in :mod:`sandboxes.placement` packs them accordingly.
The pod's node affinity comes from that placement (preferred nodes that hold the image).

Manifests are plain dicts; :func:`validate` checks them offline against the Kubernetes OpenAPI
schemas with ``kubernetes-validate``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from sandboxes.images import WORKDIR
from sandboxes.runtimes import Limits

LABEL_PREFIX = "posttrain.dev"
RUNTIME_CLASSES = ("gvisor", "kata")
# The PodSecurityPolicy the sandbox pool's service account may use (Kubernetes <= 1.24 with the
# PodSecurityPolicy admission plugin; scripts/kube-local.sh makes it): the pods of pod_spec and
# nothing broader. docs/kubernetes.md, "Least privilege", shows it and what current clusters use.
SANDBOX_POD_SECURITY_POLICY = "posttrain-sandbox"
DEFAULT_K8S_VERSION = "1.37.0"
_LABEL_OK = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


class ManifestError(ValueError):
    """A manifest setting is out of range, or a manifest failed schema validation."""


@dataclass(frozen=True)
class PodSettings:
    """Cluster-side sandbox settings (parsed once from the run's ``[sandbox]`` table)."""

    namespace: str = "posttrain"
    runtime_class: str = "gvisor"
    cpu_request_fraction: float = 0.25
    memory_request_fraction: float = 0.40
    pxd_python: str = "/usr/bin/python3"
    pxd_path: str = "/opt/pxd/pxd.py"

    def __post_init__(self):
        if self.runtime_class not in RUNTIME_CLASSES:
            raise ManifestError(f"sandbox.runtime_class must be one of {', '.join(RUNTIME_CLASSES)}, "
                                f"got {self.runtime_class!r}")
        for name in ("cpu_request_fraction", "memory_request_fraction"):
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ManifestError(f"sandbox.{name} must be in (0, 1], got {value!r}")


def label_value(text: str) -> str:
    """A valid label value for any id: itself when it fits, else a readable prefix and a hash."""
    if _LABEL_OK.match(text):
        return text
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:50].strip("-._")
    return f"{clean}-{hashlib.sha256(text.encode()).hexdigest()[:10]}" if clean else hashlib.sha256(text.encode()).hexdigest()[:16]


def _millicpu(cpus: float) -> str:
    return f"{max(1, round(cpus * 1000))}m"


def _mebibytes(mib: float) -> str:
    return f"{max(1, int(mib))}Mi"


def pod_name(run: str, episode: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", f"sbx-{run}-{episode}".lower()).strip("-")
    return (base[:52].rstrip("-") + "-" + hashlib.sha256(f"{run}/{episode}".encode()).hexdigest()[:10])


def sandbox_selector(run: str) -> dict[str, str]:
    """The labels that select every sandbox pod of ``run``: the NetworkPolicy's ``podSelector`` and
    the pool's list selector. :func:`pod_spec` sets them on every pod (a test holds the two together)."""
    return {f"{LABEL_PREFIX}/role": "sandbox", f"{LABEL_PREFIX}/run": label_value(run)}


# The init container's copy of the image's workspace into the pod's volume: each entry of it with
# its attributes (cp -a), never the folder itself: `cp -a /workspace/. DEST` also sets DEST's own
# times, which the sandbox user may not on the volume's mount point, and GNU cp then fails the pod
# ("preserving times for '/mnt/workspace/.': Operation not permitted", seen with a Debian image; a
# busybox cp only warned). POSIX sh and cp only, as every task image has them.
COPY_WORKSPACE = (f"set -e; cd {WORKDIR}; for f in * .[!.]* ..?*; do "
                  'if [ -e "$f" ] || [ -L "$f" ]; then cp -a "$f" /mnt/workspace/; fi; done')


# The workspace's mount point is the volume's, owned by root (the pod's fsGroup only makes it the
# sandbox user's group), while the repository in it is the sandbox user's: git (>= 2.35.2) then
# refuses every command there ("detected dubious ownership"), so nothing the agent did could be
# committed, and the grader's `git apply` failed too (seen on the node: every patch empty, every
# score 0). safe.directory is honoured only from protected configuration, which includes
# GIT_CONFIG_COUNT; pxd passes its environment to every command, the harness's and the grader's.
GIT_SAFE_WORKSPACE = [{"name": "GIT_CONFIG_COUNT", "value": "1"}, {"name": "GIT_CONFIG_KEY_0", "value": "safe.directory"},
                      {"name": "GIT_CONFIG_VALUE_0", "value": WORKDIR}]


def pod_spec(*, run: str, task_id: str, episode: str, image: str, limits: Limits = Limits(),
             settings: PodSettings = PodSettings(), preferred_nodes: list[str] | None = None,
             required_nodes: list[str] | None = None, writable_root: bool = False) -> dict:
    """The Pod of one episode's sandbox. ``image`` is the task image's registry reference.

    ``writable_root``: the sandbox container gets ``readOnlyRootFilesystem: false`` (its
    securityContext is otherwise the same; the module docstring says what stays read-only)."""
    if not image:
        raise ManifestError("pod_spec: image must name the task image (registry/repository:tag)")
    labels = {**sandbox_selector(run),
              f"{LABEL_PREFIX}/task": label_value(task_id), f"{LABEL_PREFIX}/episode": label_value(episode),
              "app.kubernetes.io/name": "posttrain", "app.kubernetes.io/instance": label_value(run),
              "app.kubernetes.io/component": "sandbox", "app.kubernetes.io/part-of": "posttrain",
              "app.kubernetes.io/managed-by": "sandboxes.pool"}
    resources = {
        "limits": {"cpu": _millicpu(limits.cpus), "memory": _mebibytes(limits.memory_mib),
                   "ephemeral-storage": _mebibytes(limits.disk_mib + limits.tmp_mib)},
        "requests": {"cpu": _millicpu(limits.cpus * settings.cpu_request_fraction),
                     "memory": _mebibytes(limits.memory_mib * settings.memory_request_fraction),
                     "ephemeral-storage": _mebibytes(min(limits.disk_mib, 256))},
    }
    locked_down = {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "privileged": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    affinity = {}
    if required_nodes:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(required_nodes)}]}]}
    if preferred_nodes:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 100, "preference": {"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": list(preferred_nodes)}]}}]
    spec = {
        "runtimeClassName": settings.runtime_class,
        "restartPolicy": "Never",
        "activeDeadlineSeconds": max(1, int(limits.wall_s)),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False, "hostPID": False, "hostIPC": False,
        "terminationGracePeriodSeconds": 0,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        # the image's workspace is copied into a size-limited volume: the per-sandbox writable layer
        "initContainers": [{
            "name": "workspace", "image": image, "command": ["/bin/sh", "-c", COPY_WORKSPACE],
            "securityContext": locked_down,
            "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}, "requests": {"cpu": "50m", "memory": "32Mi"}},
            "volumeMounts": [{"name": "workspace", "mountPath": "/mnt/workspace"}],
        }],
        "containers": [{
            "name": "sandbox", "image": image,
            "command": [settings.pxd_python, "-I", "-S", settings.pxd_path, "--workspace", WORKDIR, "--stdio"],
            "stdin": True, "stdinOnce": True, "tty": False,
            "workingDir": WORKDIR,
            "env": [{"name": "HOME", "value": "/home/sandbox"}, {"name": "TMPDIR", "value": "/tmp"},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, *GIT_SAFE_WORKSPACE],
            "resources": resources,
            "securityContext": {**locked_down, "readOnlyRootFilesystem": not writable_root},
            "volumeMounts": [{"name": "workspace", "mountPath": WORKDIR}, {"name": "tmp", "mountPath": "/tmp"},
                             {"name": "home", "mountPath": "/home/sandbox"}],
        }],
        "volumes": [
            {"name": "workspace", "emptyDir": {"sizeLimit": _mebibytes(limits.disk_mib)}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": _mebibytes(limits.tmp_mib)}},
            {"name": "home", "emptyDir": {"medium": "Memory", "sizeLimit": _mebibytes(limits.tmp_mib)}},
        ],
    }
    if affinity:
        spec["affinity"] = {"nodeAffinity": affinity}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(run, episode), "namespace": settings.namespace, "labels": labels},
            "spec": spec}


def network_policy(*, run: str, settings: PodSettings = PodSettings()) -> dict:
    """Deny all ingress and egress of the run's sandbox pods (no rule = nothing allowed; the rule
    lists are left out rather than empty: the API server stores an empty list as none, and a
    server-side apply of ``[]`` would change the object every time)."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"sandbox-deny-all-{label_value(run)}"[:63].rstrip("-."), "namespace": settings.namespace,
                     "labels": {f"{LABEL_PREFIX}/run": label_value(run)}},
        "spec": {
            "podSelector": {"matchLabels": sandbox_selector(run)},
            "policyTypes": ["Ingress", "Egress"],
        },
    }


def validate(manifest: dict, k8s_version: str = DEFAULT_K8S_VERSION) -> None:
    """Check a manifest against the Kubernetes OpenAPI schema (offline, strict: unknown keys fail)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(manifest, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top)"
        raise ManifestError(f"{manifest.get('kind', '?')} {manifest.get('metadata', {}).get('name', '?')}: "
                            f"{where}: {exc.message}") from None
