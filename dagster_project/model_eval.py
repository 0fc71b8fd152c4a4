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

An eval never corrupts the record it adds to. A Harbor dataset is checked before any run
(:func:`check_harbor_dataset`: every task named must load, every image must build; the whole
message of each failure, naming the task and its file); ``eval.json`` is written when the name is
first registered and replaced only by an eval that succeeded with every attempt graded, so a
failed or partial eval leaves the settings a backfill reads as they were; and the rows of a run
that failed are moved out of ``evals/deepswe/<checkpoint>/`` (which ``eval_report`` and ``posttrain
score`` read) to ``evals/deepswe-failed/<checkpoint>/``, where they cannot mix with the record.
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
from evals.attempts import INFRA_ERROR
from evals.harbor import eval_split
from evals.settings import EvalSection
from evals.tasks import TaskSet
from sandboxes.cache import node_cache
from sandboxes.harbor import build_harbor_image, harbor_image_name
from sandboxes.images import ImageStore
from training.checkpoint import checkpoint_path, read_metadata, write_checkpoint
from training.planner.runner import PLAN_FILENAME

REGISTERED_KEY = "registered_model"  # metadata.json of a registered model's checkpoint


class RegistrationError(ValueError):
    """The model cannot be registered under that name; the message says why and what to pass."""


class DatasetError(ValueError):
    """The eval's dataset cannot be evaluated as asked: one line per task, naming it, its file and why."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def check_harbor_dataset(section: EvalSection, storage: PosttrainStorage, task_set: TaskSet, *,
                         log: Callable[[str], None] = print) -> list[str]:
    """Everything ``deepswe_eval`` would find wrong with the Harbor dataset of ``section``, found before
    any Dagster run: a task ``section.task_ids`` names that does not load or cannot be built from the
    sources (its folder and the reason, which names the file), and every image of the tasks to
    evaluate that does not build (its Dockerfile and the builder's whole message). The images are
    built into the store and node cache the asset reads, so the run finds them cached. Returns the
    ids of the tasks the run will evaluate; raises :class:`DatasetError` listing every problem."""
    problems: list[str] = []
    incomplete = {t.id: t for t in task_set.incomplete}
    buildable = {t.id: t for t in task_set.tasks}
    if section.task_ids:
        for task_id in section.task_ids:
            if task_id in incomplete:
                item = incomplete[task_id]
                problems.append(f"task {task_id} ({item.path}): {item.reason}")
        tasks = [buildable[i] for i in section.task_ids if i in buildable]
    else:
        split = eval_split(section.split)
        tasks = [t for t in task_set.tasks if not split or t.split in (split, "")]
        if not tasks:
            problems.append(f"{section.dataset}: no buildable task" + (f" in split {split!r}" if split else ""))
    store, cache = ImageStore(storage.images_dir()), node_cache(storage.path)
    for i, task in enumerate(tasks, 1):
        dockerfile = task.metadata["environment"]
        try:
            build = build_harbor_image(harbor_image_name(task.id), dockerfile, task.base_commit or "",
                                       section.sources, store, network=section.network)
            cache.acquire(build.image, store).release()
        except Exception as exc:  # noqa: BLE001 - any build failure is that task's problem, reported whole
            problems.append(f"task {task.id} ({dockerfile}): its image does not build: {exc}")
            continue
        log(f"posttrain eval: [{i}/{len(tasks)}] image of {task.id}: {build.image.size_bytes / 1e6:.1f} MB, "
            f"{'cached' if build.cached else f'built in {build.build_s:.1f} s'}")
    if problems:
        raise DatasetError(problems)
    return [t.id for t in tasks]


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
    """One ``posttrain eval --model`` run: the partition key, the Dagster run, its attempt rows and
    where they are (``evals/deepswe-failed/...`` for a run that failed; no file when none were written)."""

    key: str
    run_id: str
    success: bool
    error: str
    rows: list[dict[str, Any]]
    path: Path


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
    if not (run_dir / EVAL_SETTINGS_FILE).is_file():  # a later eval replaces it only once it succeeded
        write_eval_settings(run_dir, section)
    return key


def write_eval_settings(run_dir: Path, section: EvalSection) -> Path:
    """Write ``run_dir/eval.json`` (the ``[eval]`` a registered model is evaluated with) in one rename."""
    settings = run_dir / EVAL_SETTINGS_FILE
    tmp = settings.with_name(f".{settings.name}.tmp")
    tmp.write_text(json.dumps({"eval": eval_config(section)}, indent=1) + "\n")
    tmp.replace(settings)
    return settings


def evaluate_model(model: Path, adapter: Path | None, name: str | None, section: EvalSection, *,
                   log: Callable[[str], None] = print, log_level: str = "INFO") -> ModelEval:
    """Register the model (:func:`register_model`) and run ``checkpoint_eval`` for it in this process,
    against the instance of ``DAGSTER_HOME`` (``posttrain`` sets it), with ``section``'s settings.
    ``eval.json`` takes ``section`` once the run succeeded with no attempt lost to the infrastructure;
    a failed run's rows are moved where the record's readers do not look (see the module docstring)."""
    storage = PosttrainStorage()
    with dg.DagsterInstance.get() as instance:
        run_name = model_name(model, adapter, name)
        key = register_model(storage, instance, run_name, model, adapter, section)
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
    if not result.success and path.is_file():
        aside = storage.evals_dir() / "deepswe-failed" / key / path.name
        aside.parent.mkdir(parents=True, exist_ok=True)
        path.replace(aside)
        path = aside
    elif result.success and not any(r["status"] == INFRA_ERROR for r in rows):
        write_eval_settings(storage.run_dir(run_name), section)
    return ModelEval(key, result.run_id, result.success, error, rows, path)
