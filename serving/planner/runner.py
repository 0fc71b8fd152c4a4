"""Starting a planned run: the run directory, its resolved-plan.json, and the launch.

Locally the trainer's entry point (``python -m training``) runs as a child process with the resolved
plan; it starts the engine, router and sandboxes it needs. On Kubernetes the manifests of
``serving.planner.k8s`` are created through the Kubernetes API.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from serving.planner.resolve import Plan

PLAN_FILENAME = "resolved-plan.json"
TRAINER_MODULE = "training"


class RunStartError(RuntimeError):
    """The run cannot start (the trainer is not built, the run directory holds another plan, ...)."""


def default_run_dir(plan: Plan, home: str | None = None) -> Path:
    """``[run] dir`` if set, else HOME/runs/NAME with HOME = --home, $POSTTRAIN_HOME, ./posttrain-data."""
    if plan.run_file.run.dir:
        return Path(plan.run_file.run.dir).expanduser().resolve()
    root = home or os.environ.get("POSTTRAIN_HOME") or str(Path.cwd() / "posttrain-data")
    return Path(root).expanduser().resolve() / "runs" / plan.run_name


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
            existing: Any = json.loads(target.read_text())
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


def trainer_command(plan_path: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", TRAINER_MODULE, *trainer_args(plan_path, run_dir)]


def trainer_is_built() -> bool:
    return importlib.util.find_spec(f"{TRAINER_MODULE}.__main__") is not None


def start_local(plan_path: Path, run_dir: Path) -> int:
    """Run the trainer's entry point on this machine in the foreground; return its exit status."""
    if not trainer_is_built():
        raise RunStartError(
            f"the trainer is not built: there is no `python -m {TRAINER_MODULE}` entry point "
            f"({TRAINER_MODULE}/__main__.py, issue 6); the plan is written to {plan_path}, nothing was started"
        )
    return subprocess.call(trainer_command(plan_path, run_dir))


def apply_k8s(manifests: list[dict[str, Any]], kubeconfig: str | None = None) -> list[str]:
    """Create every manifest through the Kubernetes API (in-cluster config, else kubeconfig).

    Raises ``RunStartError`` naming the object that could not be created; the ones before it stay.
    """
    from kubernetes import client, config, utils

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config(config_file=kubeconfig)
        except (config.ConfigException, OSError) as exc:
            raise RunStartError(f"no Kubernetes configuration: not in a cluster, and the kubeconfig fails: {exc}") from exc
    api = client.ApiClient()
    created = []
    for manifest in manifests:
        what = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            utils.create_from_dict(api, manifest, namespace=manifest["metadata"].get("namespace"))
        except Exception as exc:  # the client raises FailToCreateError, ApiException or a connection error
            done = ", ".join(created) or "nothing"
            raise RunStartError(f"creating {what} failed ({exc}); created before it: {done}") from exc
        created.append(what)
    return created
