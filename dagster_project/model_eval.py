"""``posttrain eval --model``: any model folder, with or without an adapter, evaluated as a run's
checkpoint is, in the local Dagster instance.

The model is registered as the checkpoint ``<name>-step_000000``: a run of its own name whose one
checkpoint, step 0, is the model. Its folder ``runs/<name>/checkpoints/step_000000/`` names the
model folder in ``metadata.json`` (key ``registered_model``) and holds a copy of the adapter;
``runs/<name>/eval.json`` keeps the ``[eval]`` table it was evaluated with, which the checkpoint
sensor's retries and ``posttrain backfill`` read as they read a run's plan. The ``checkpoints``
partition is added to the instance first (so the sensor never requests it too), then the
``checkpoint_eval`` job runs in this process against the instance: the UI shows the model beside
the runs' checkpoints, and ``eval_report`` scores it with them.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import dagster as dg
import pandas as pd

from assets.evals import EVAL_SETTINGS_FILE, eval_config, eval_rows_path, eval_run_config
from assets.partitions import checkpoint_partition_key, checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.definitions import defs
from training.checkpoint import checkpoint_path, read_metadata, write_checkpoint
from training.planner.runner import PLAN_FILENAME
from training.planner.schema import EvalSection

REGISTERED_KEY = "registered_model"  # metadata.json of a registered model's checkpoint


class RegistrationError(ValueError):
    """The model cannot be registered under that name; the message says why and what to pass."""


def model_name(model: Path, adapter: Path | None, name: str | None) -> str:
    """The registered name: ``name``, else the model folder's name (with the adapter folder's), made
    of the letters a partition key takes."""
    if name:
        try:
            checkpoint_partition_key(name, 0)
        except ValueError as exc:
            raise RegistrationError(f"--name {name!r}: {exc}") from None
        return name
    base = model.name + (f"-{adapter.name}" if adapter is not None else "")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "model"


@dataclass(frozen=True)
class ModelEval:
    """One ``posttrain eval --model`` run: the partition key, the Dagster run and its attempt rows."""

    key: str
    run_id: str
    success: bool
    error: str
    rows: list[dict[str, Any]]


def register_model(storage: PosttrainStorage, instance: dg.DagsterInstance, name: str, model: Path,
                   adapter: Path | None, section: EvalSection) -> str:
    """Register ``model`` (and ``adapter``) as the checkpoint ``<name>-step_000000`` (see the module
    docstring); the same model under the same name again reuses it. Returns the partition key."""
    key = checkpoint_partition_key(name, 0)
    run_dir = storage.run_dir(name)
    if (run_dir / PLAN_FILENAME).is_file():
        raise RegistrationError(f"--name {name}: {run_dir} is an RL run's folder; give the model another --name")
    ckpt = checkpoint_path(run_dir, 0)
    wanted = {"base_model": str(model), "adapter": adapter is not None, REGISTERED_KEY: True,
              "adapter_source": str(adapter) if adapter is not None else None}
    if (ckpt / "metadata.json").is_file():
        meta = read_metadata(ckpt, name=key)
        if (meta.get("base_model"), meta.get("adapter_source")) != (wanted["base_model"], wanted["adapter_source"]):
            raise RegistrationError(
                f"--name {name}: already registered for the model {meta.get('base_model')} (adapter "
                f"{meta.get('adapter_source') or 'none'}), not {model} (adapter {adapter or 'none'}); give another --name")
    if key not in set(instance.get_dynamic_partitions(checkpoints_partitions.name)):
        instance.add_dynamic_partitions(checkpoints_partitions.name, [key])
    if not (ckpt / "metadata.json").is_file():
        def fill(tmp: Path) -> None:
            if adapter is not None:
                shutil.copytree(adapter, tmp / "adapter")

        write_checkpoint(run_dir, 0, fill, {**wanted, **({"adapter_version": name} if adapter is not None else {})})
    settings = run_dir / EVAL_SETTINGS_FILE
    tmp = settings.with_name(f".{settings.name}.tmp")
    tmp.write_text(json.dumps({"eval": eval_config(section)}, indent=1) + "\n")
    tmp.replace(settings)
    return key


def evaluate_model(model: Path, adapter: Path | None, name: str | None, section: EvalSection, *,
                   log: Callable[[str], None] = print, log_level: str = "INFO") -> ModelEval:
    """Register the model (:func:`register_model`) and run ``checkpoint_eval`` for it in this process,
    against the instance of ``DAGSTER_HOME`` (``posttrain`` sets it), with ``section``'s settings."""
    storage = PosttrainStorage()
    with dg.DagsterInstance.get() as instance:
        key = register_model(storage, instance, model_name(model, adapter, name), model, adapter, section)
        log(f"posttrain eval: {model}{f' with {adapter}' if adapter else ''} registered as checkpoint {key}; "
            f"evaluating it in the Dagster instance at {instance.root_directory}")
        run_config = {**eval_run_config(section), "loggers": {"console": {"config": {"log_level": log_level}}}}
        result = defs.resolve_job_def("checkpoint_eval").execute_in_process(
            instance=instance, partition_key=key, run_config=run_config, raise_on_error=False)
        error = ""
        if not result.success:
            failures = [e for e in result.all_events if e.is_step_failure]
            error = "; ".join(e.step_failure_data.error.message.strip() for e in failures
                              if e.step_failure_data and e.step_failure_data.error) or "the run failed"
    path = eval_rows_path(storage, key, result.run_id)
    rows = pd.read_parquet(path).to_dict("records") if path.is_file() else []
    return ModelEval(key, result.run_id, result.success, error, rows)
