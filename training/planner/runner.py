"""Starting a planned run: the run directory, its resolved-plan.json, and the launch.

Locally the trainer's entry point (``python -m training``) runs as a child process with the resolved
plan; it starts the engine, router and sandboxes it needs. On Kubernetes the manifests of
``training.planner.k8s`` are applied server-side (:func:`apply_k8s`): the API server merges each
object under the field manager ``posttrain``, so the same plan applied twice changes nothing, and a
changed plan updates the objects in place. ``dry_run=True`` asks the API server what would change
and changes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sandboxes.files import NotARegularFile, read_regular_bytes
from sandboxes.httpserver.auth import Credential, process_credential
from sandboxes.home import default_home
from training.planner.resolve import Plan
import base64

PLAN_FILENAME = "resolved-plan.json"
TRAINER_MODULE = "training"


class RunStartError(RuntimeError):
    """The run cannot start (the trainer is not built, the run directory holds another plan, ...)."""


def default_run_dir(plan: Plan, home: str | None = None) -> Path:
    """``[run] dir`` if set, else HOME/runs/NAME with HOME = --home, $POSTTRAIN_HOME, ./posttrain-data."""
    if plan.run_file.run.dir:
        return Path(plan.run_file.run.dir).expanduser().resolve()
    root = Path(home).expanduser().resolve() if home else default_home()
    return root / "runs" / plan.run_name


def write_resolved_plan(plan: Plan, run_dir: str | os.PathLike[str], *, replace: bool = False) -> Path:
    """Write ``run_dir/resolved-plan.json`` atomically (temporary file, then rename).

    A run directory that already holds a different plan is refused unless ``replace``: a result must
    always trace back to the settings that produced it. The same plan again (a resumed run) is fine.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / PLAN_FILENAME
    text = plan.to_json_text()
    if target.exists() and not replace:
        try:
            existing: Any = json.loads(read_regular_bytes(target))
        except NotARegularFile as exc:  # a FIFO there would be waited on forever
            raise RunStartError(f"{exc} (the run directory's {PLAN_FILENAME})") from None
        except (OSError, ValueError):
            existing = None
        if existing != json.loads(text):
            raise RunStartError(
                f"{target} already holds a different plan; this run directory belongs to that run. "
                "Use another [run] name or --run-dir, or pass --replace-plan to overwrite it"
            )
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".{PLAN_FILENAME}.", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the plan is read by every workload of the run
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def trainer_args(plan_path: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> list[str]:
    """Arguments of ``python -m training``: it reads the plan's trainer table and writes into RUN_DIR."""
    return ["--config", str(plan_path), "--run-dir", str(run_dir)]


def trainer_launcher(gpus: int, python: str = "python") -> list[str]:
    """The command that starts the trainer's entry point with ``gpus`` GPUs: one process, or with more
    than one GPU torchrun's one process per GPU on this host (``--standalone``: its own rendezvous on
    a free local port), rank 0 running the loop and the others training data parallel with it
    (``training.backends.parallel``). Its arguments (:func:`trainer_args`) follow."""
    if gpus > 1:
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m", TRAINER_MODULE]
    return [python, "-m", TRAINER_MODULE]


def trainer_command(plan_path: Path, run_dir: Path, gpus: int = 0) -> list[str]:
    return [*trainer_launcher(gpus, sys.executable), *trainer_args(plan_path, run_dir)]


def trainer_is_built() -> bool:
    return importlib.util.find_spec(f"{TRAINER_MODULE}.__main__") is not None


def start_local(plan_path: Path, run_dir: Path, gpus: int = 0) -> int:
    """Run the trainer's entry point on this machine in the foreground, one process per GPU when
    ``gpus`` (the plan's ``[trainer] gpus``) is more than one; return its exit status. They are given
    this process's trainer credential in their environment (one for all of a run's processes)."""
    if not trainer_is_built():
        raise RunStartError(
            f"the trainer is not built: there is no `python -m {TRAINER_MODULE}` entry point "
            f"({TRAINER_MODULE}/__main__.py, issue 6); the plan is written to {plan_path}, nothing was started"
        )
    return subprocess.call(trainer_command(plan_path, run_dir, gpus), env=process_credential().environment())


FIELD_MANAGER = "posttrain"
# The run's trainer credential Secret (training.planner.k8s): its component label and its one key.
CREDENTIAL_COMPONENT = "credential"
CREDENTIAL_KEY = "credential"

# The REST collection of each kind the run's manifests hold (all namespaced).
_COLLECTIONS = {
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Service"): "services",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("batch/v1", "Job"): "jobs",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("policy/v1beta1", "PodDisruptionBudget"): "poddisruptionbudgets",
}
# A kind whose newest API version an older server lacks, and the earlier version that holds the
# same fields (PodDisruptionBudget reached policy/v1 in Kubernetes 1.21).
_EARLIER_VERSIONS = {("policy/v1", "PodDisruptionBudget"): "policy/v1beta1"}
_AS_DICT = {200: "object", 201: "object"}  # the client's deserializer keeps "object" answers as plain dicts
# Server-set fields that say nothing about what the manifest asked for.
_SERVER_FIELDS = ("resourceVersion", "managedFields", "generation", "creationTimestamp", "uid", "selfLink")


@dataclass(frozen=True)
class Applied:
    """What applying one object did (or, in a dry run, would do): ``created``, ``configured``
    (with the changed fields) or ``unchanged``."""

    kind: str
    name: str
    action: str
    changed: tuple[str, ...] = ()
    dry_run: bool = False

    def __str__(self) -> str:
        verb = {"created": "would be created", "configured": "would change", "unchanged": "unchanged"}[self.action] \
            if self.dry_run else self.action
        fields = f": {', '.join(self.changed)}" if self.changed else ""
        return f"{self.kind}/{self.name} {verb}{fields}"


def object_path(manifest: dict[str, Any]) -> str:
    """The REST path of a manifest's object, e.g. ``/apis/apps/v1/namespaces/NS/deployments/NAME``."""
    api, kind = manifest["apiVersion"], manifest["kind"]
    collection = _COLLECTIONS.get((api, kind))
    if collection is None:
        raise RunStartError(f"{kind}/{manifest['metadata'].get('name')}: no REST collection known for "
                            f"{api} {kind} (training/planner/runner.py _COLLECTIONS)")
    prefix = "/api/v1" if api == "v1" else f"/apis/{api}"
    meta = manifest["metadata"]
    return f"{prefix}/namespaces/{meta['namespace']}/{collection}/{meta['name']}"


def _content(obj: dict[str, Any] | None) -> dict[str, Any]:
    if obj is None:
        return {}
    out = {k: v for k, v in obj.items() if k != "status"}
    out["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in _SERVER_FIELDS}
    return out


def changed_fields(before: Any, after: Any, prefix: str = "", limit: int = 8) -> list[str]:
    """Dotted paths where two objects differ (at most ``limit``; lists compare whole)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[str] = []
        for key in sorted(set(before) | set(after), key=str):
            if before.get(key) != after.get(key):
                out += changed_fields(before.get(key), after.get(key), f"{prefix}.{key}" if prefix else str(key), limit)
            if len(out) >= limit:
                return out[:limit]
        return out
    return [] if before == after else [prefix or "(object)"]


def kube_api_client(kubeconfig: str | None = None):
    """An ``ApiClient`` from the in-cluster configuration, else the kubeconfig (``RunStartError`` if neither)."""
    # heavy: kubernetes (over 1,000 modules); only talking to a cluster needs it
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config(config_file=kubeconfig)
        except (config.ConfigException, OSError) as exc:
            raise RunStartError(f"no Kubernetes configuration: not in a cluster, and the kubeconfig fails: {exc}") from exc
    return client.ApiClient()


def served_group_versions(api, group: str) -> set[str]:
    """The ``group/version`` strings the API server serves for ``group`` (discovery: ``GET /apis/GROUP``)."""
    # heavy: kubernetes (over 1,000 modules); only talking to a cluster needs it
    from kubernetes.client.exceptions import ApiException

    try:
        answer = api.call_api(f"/apis/{group}", "GET", response_types_map=_AS_DICT, auth_settings=["BearerToken"],
                              _return_http_data_only=True, header_params={"Accept": "application/json"})
    except ApiException as exc:
        if exc.status == 404:
            return set()
        raise
    return {v.get("groupVersion") for v in (answer or {}).get("versions") or []}


def for_server(manifests: list[dict[str, Any]], api) -> list[dict[str, Any]]:
    """The manifests with each kind at an API version this server serves: a PodDisruptionBudget as
    ``policy/v1`` where served, else ``policy/v1beta1`` (chosen by discovery, asked once per group).
    Raises ``RunStartError`` naming the object when neither is served."""
    served: dict[str, set[str]] = {}
    out = []
    for manifest in manifests:
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        earlier = _EARLIER_VERSIONS.get((api_version, kind))
        if earlier is not None:
            group = api_version.split("/")[0]
            if group not in served:
                served[group] = served_group_versions(api, group)
            if api_version not in served[group]:
                if earlier not in served[group]:
                    raise RunStartError(f"{kind}/{manifest['metadata']['name']}: the API server serves neither "
                                        f"{api_version} nor {earlier} (it serves {sorted(served[group]) or 'no version'} of {group})")
                manifest = {**manifest, "apiVersion": earlier}
        out.append(manifest)
    return out


def apply_k8s(manifests: list[dict[str, Any]], kubeconfig: str | None = None, *, dry_run: bool = False,
              api_client=None) -> list[Applied]:
    """Apply every manifest server-side (field manager ``posttrain``, conflicts forced) and say
    what each did; with ``dry_run`` the API server computes the same without keeping anything.

    Raises ``RunStartError`` naming the object that could not be applied; the ones before it stay.
    An immutable field (a Job's pod template) that a changed plan touches is named with what to do.
    """
    # heavy: kubernetes (over 1,000 modules); only talking to a cluster needs it
    from kubernetes.client.exceptions import ApiException

    api = api_client or kube_api_client(kubeconfig)
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
    done: list[Applied] = []
    try:
        manifests = for_server(manifests, api)
    except RunStartError:
        raise
    except Exception as exc:  # discovery could not reach the server
        raise RunStartError(f"the API server could not be asked which versions it serves ({type(exc).__name__}: {exc})") from exc
    owner: dict[str, Any] | None = None
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if owner is not None and manifest["kind"] not in UNOWNED_KINDS:
            manifest = owned_by(manifest, owner)
        path = object_path(manifest)
        try:
            try:
                before = api.call_api(path, "GET", response_types_map=_AS_DICT, auth_settings=["BearerToken"],
                                      _return_http_data_only=True, header_params={"Accept": "application/json"})
            except ApiException as exc:
                if exc.status != 404:
                    raise
                before = None
            if is_credential(manifest):
                manifest = with_credential(manifest, before)
            after = api.call_api(path, "PATCH", query_params=query, body=manifest, response_types_map=_AS_DICT,
                                 header_params={"Content-Type": "application/apply-patch+yaml",
                                                "Accept": "application/json"},
                                 auth_settings=["BearerToken"], _return_http_data_only=True)
        except ApiException as exc:
            message = _api_message(exc)
            hint = ""
            if exc.status == 422 and "immutable" in message and kind == "Job":
                hint = (f"; a Job's pod template cannot change: delete it (kubectl -n {manifest['metadata']['namespace']} "
                        f"delete job {name}; checkpoints and the rollout store stay on the volume) and run again")
            applied = ", ".join(str(a) for a in done) or "nothing"
            raise RunStartError(f"applying {kind}/{name} failed: HTTP {exc.status} {exc.reason}: {message}{hint}; "
                                f"applied before it: {applied}") from exc
        except Exception as exc:  # a connection error, a TLS failure
            applied = ", ".join(str(a) for a in done) or "nothing"
            raise RunStartError(f"applying {kind}/{name} failed ({exc}); applied before it: {applied}") from exc
        if is_plan(manifest):
            owner = after
        if before is None:
            done.append(Applied(kind, name, "created", dry_run=dry_run))
        else:
            diff = changed_fields(_content(before), _content(after))
            done.append(Applied(kind, name, "configured" if diff else "unchanged", tuple(diff), dry_run))
    return done


# What the run's plan ConfigMap does not own: the run volume (checkpoints and the rollout store
# outlive the run's workloads).
UNOWNED_KINDS = ("PersistentVolumeClaim", "ConfigMap")
PLAN_COMPONENT = "plan"


def _is(manifest: dict[str, Any], kind: str, component: str) -> bool:
    """A manifest of ``kind`` labelled as the run's ``component`` (``app.kubernetes.io/component``)."""
    labels = manifest.get("metadata", {}).get("labels") or {}
    return manifest.get("kind") == kind and labels.get("app.kubernetes.io/component") == component


def is_plan(manifest: dict[str, Any]) -> bool:
    """The run's plan ConfigMap (``training.planner.k8s``: component ``plan``): the owner of the rest."""
    return _is(manifest, "ConfigMap", PLAN_COMPONENT)


def is_credential(manifest: dict[str, Any]) -> bool:
    """The run's trainer credential Secret (``training.planner.k8s``: component ``credential``)."""
    return _is(manifest, "Secret", CREDENTIAL_COMPONENT)


def with_credential(manifest: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The credential Secret with its value: the one the server holds (an apply never changes the
    credential of running pods), else a new one (:meth:`Credential.generate`, the one place credentials
    are made)."""
    value = ((before or {}).get("data") or {}).get(CREDENTIAL_KEY)
    if not value:
        value = base64.b64encode(Credential.generate().value.encode()).decode()
    return {**manifest, "data": {CREDENTIAL_KEY: value}}


def owned_by(manifest: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with an owner reference to ``owner`` (the plan ConfigMap as the server holds it):
    deleting the plan deletes the run's workloads (``kubectl delete configmap R-plan``), the run
    volume stays. Not a controller reference, and it never blocks the owner's deletion."""
    meta = owner["metadata"]
    ref = {"apiVersion": owner.get("apiVersion", "v1"), "kind": owner.get("kind", "ConfigMap"),
           "name": meta["name"], "uid": meta["uid"], "blockOwnerDeletion": False}
    return {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [ref]}}


def delete_k8s(manifests: list[dict[str, Any]], kubeconfig: str | None = None, *, api_client=None,
               keep_kinds: tuple[str, ...] = UNOWNED_KINDS) -> list[str]:
    """Delete the run's objects (last applied first), except those of ``keep_kinds`` (by default the
    run volume and the plan); an object already gone is fine. Returns ``KIND/NAME`` of each deleted.
    Pods of the workloads go with them (propagation ``Background``: the garbage collector's work)."""
    # heavy: kubernetes (over 1,000 modules); only talking to a cluster needs it
    from kubernetes.client.exceptions import ApiException

    api = api_client or kube_api_client(kubeconfig)
    deleted = []
    for manifest in reversed(for_server(manifests, api)):
        if manifest["kind"] in keep_kinds:
            continue
        try:
            api.call_api(object_path(manifest), "DELETE", query_params=[("propagationPolicy", "Background")],
                         response_types_map=_AS_DICT, auth_settings=["BearerToken"], _return_http_data_only=True,
                         header_params={"Accept": "application/json"})
            deleted.append(f"{manifest['kind']}/{manifest['metadata']['name']}")
        except ApiException as exc:
            if exc.status != 404:
                raise RunStartError(f"deleting {manifest['kind']}/{manifest['metadata']['name']} failed: "
                                    f"HTTP {exc.status} {exc.reason}: {_api_message(exc)}") from exc
    return deleted


def read_object(api, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The object as the server holds it now (``None`` when there is none)."""
    # heavy: kubernetes (over 1,000 modules); only talking to a cluster needs it
    from kubernetes.client.exceptions import ApiException

    try:
        return api.call_api(object_path(manifest), "GET", response_types_map=_AS_DICT, auth_settings=["BearerToken"],
                            _return_http_data_only=True, header_params={"Accept": "application/json"})
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


FLEET_KINDS = ("StatefulSet", "Deployment")


def fleet_not_ready(manifests: list[dict[str, Any]], api) -> list[str]:
    """The run's long-running workloads (engines, router, sandbox pool) that are not ready yet, each
    as ``KIND/NAME ready/wanted``; empty when all are."""
    waiting = []
    for manifest in manifests:
        if manifest["kind"] not in FLEET_KINDS:
            continue
        obj = read_object(api, manifest) or {}
        wanted = (obj.get("spec") or {}).get("replicas", manifest["spec"].get("replicas", 1))
        ready = (obj.get("status") or {}).get("readyReplicas") or 0
        if ready < wanted:
            waiting.append(f"{manifest['kind']}/{manifest['metadata']['name']} {ready}/{wanted} ready")
    return waiting


def wait_fleet(manifests: list[dict[str, Any]], api, *, timeout_s: float, poll_s: float = 5.0,
               log: Callable[[str], None] = print, setting: str = "--fleet-timeout") -> None:
    """Wait until every long-running workload of ``manifests`` is ready (:func:`fleet_not_ready`),
    saying each change of what is still awaited; ``RunStartError`` after ``timeout_s``. The
    trainer starts after this: its first episodes would otherwise meet a router with no healthy
    replica (an engine loads its model for minutes). ``setting`` names the caller's timeout in the
    error."""
    deadline = time.monotonic() + timeout_s
    said = None
    while waiting := fleet_not_ready(manifests, api):
        if waiting != said:
            log(f"waiting for {', '.join(waiting)}")
            said = waiting
        if time.monotonic() > deadline:
            raise RunStartError(f"the fleet was not ready within {timeout_s:g} s ({setting}): {', '.join(waiting)}")
        time.sleep(poll_s)
    log("engines, router and sandbox pool ready")


def job_outcome(job: dict[str, Any] | None) -> str | None:
    """``"succeeded"`` or ``"failed"`` once the Job has finished (its ``Complete`` or ``Failed``
    condition), else ``None``; a Job that is gone counts as failed."""
    if job is None:
        return "failed"
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return "succeeded" if condition["type"] == "Complete" else "failed"
    return None


def _api_message(exc) -> str:
    try:
        return json.loads(exc.body).get("message", "") or str(exc.body)
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or "")
