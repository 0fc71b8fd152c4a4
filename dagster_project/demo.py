"""``posttrain demo``: the whole asset graph on the embedded default, in the local instance.

Materializes ``task_dataset``, ``image_cache``, ``difficulty_curriculum`` and ``rl_run``; adds a
``checkpoints`` partition for each checkpoint the run saved and evaluates each one; then builds
``eval_report``. Everything lands in the local Dagster instance, so ``posttrain ui`` shows it after.
"""

from __future__ import annotations

import time
from typing import Any

import dagster as dg

from dagster_project.partitions import checkpoints_partitions, parse_checkpoint_partition_key
from dagster_project.resources import PosttrainStorage
from dagster_project.sensors import complete_checkpoint_keys

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def _stage(message: str, started: float) -> None:
    print(f"[demo {time.monotonic() - started:7.1f}s] {message}", flush=True)


def _execute(defs: dg.Definitions, job_name: str, instance: dg.DagsterInstance, **kwargs: Any) -> None:
    result = defs.resolve_job_def(job_name).execute_in_process(instance=instance, raise_on_error=True, **kwargs)
    if not result.success:
        raise RuntimeError(f"job {job_name} failed")


def run_demo(run_name: str, rl_run_config: dict[str, Any] | None = None) -> int:
    from dagster_project.definitions import defs

    started = time.monotonic()
    storage = PosttrainStorage()
    with dg.DagsterInstance.get() as instance:
        _stage(f"Dagster instance at {instance.root_directory}; files under {storage.path}", started)
        _stage("materializing task_dataset, image_cache, difficulty_curriculum, rl_run", started)
        run_config: dict[str, Any] = dict(QUIET_LOGS)
        run_config["ops"] = {"rl_run": {"config": {"run_name": run_name, **(rl_run_config or {})}}}
        _execute(defs, "rl_pipeline", instance, run_config=run_config)

        keys = [k for k in complete_checkpoint_keys(storage) if parse_checkpoint_partition_key(k)[0] == run_name]
        if not keys:
            raise RuntimeError(f"run {run_name!r} saved no checkpoint under {storage.run_dir(run_name)}")
        known = set(instance.get_dynamic_partitions(checkpoints_partitions.name))
        instance.add_dynamic_partitions(checkpoints_partitions.name, [k for k in keys if k not in known])
        for i, key in enumerate(keys, 1):
            _stage(f"evaluating checkpoint {key} ({i}/{len(keys)})", started)
            _execute(defs, "checkpoint_eval", instance, partition_key=key, run_config=QUIET_LOGS)

        _stage("building eval_report", started)
        _execute(defs, "eval_report_job", instance, run_config=QUIET_LOGS)
        _stage(f"done. Report: {storage.reports_dir()}; run: {storage.run_dir(run_name)}", started)
        _stage("open the UI with `posttrain ui` to browse every asset and its metadata", started)
    return 0
