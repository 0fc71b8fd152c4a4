"""Sensors: each checkpoint a run saves becomes a partition and is evaluated; a failed eval is asked for again.

Run requests are keyed by partition for the first eval (``<partition>``) and by the failed run for a
repeat (``<partition>:after-<run_id>``): the daemon never launches two runs for one key, so each
failure is followed by exactly one new request, up to :data:`MAX_EVAL_RUNS` runs per checkpoint.
"""

from __future__ import annotations

import dagster as dg

from assets.evals import checkpoint_eval_run_config
from assets.partitions import checkpoint_partition_key, checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.automation import automation_sensors
from dagster_project.jobs import EVAL_TAGS, checkpoint_eval_job
from training.checkpoint import list_checkpoints
from sandboxes.settings import SettingsError

MAX_EVAL_RUNS = 4  # eval runs per checkpoint, the first one included, that the sensor requests (run retries aside)
PARTITION_TAG = "dagster/partition"
WILL_RETRY_TAG = "dagster/will_retry"


def complete_checkpoint_keys(storage: PosttrainStorage) -> list[str]:
    """Partition keys of every complete checkpoint under the storage root, sorted.

    A checkpoint folder is complete once its ``metadata.json`` exists: the trainer writes a
    checkpoint under a temporary name and renames it into place, so a half-written one is never seen.
    """
    keys = []
    runs = storage.runs_dir()
    if not runs.is_dir():
        return keys
    for run in runs.iterdir():
        for saved in list_checkpoints(run):
            try:
                keys.append(checkpoint_partition_key(run.name, saved.step))
            except ValueError:
                continue  # a run name or step that no partition key can carry
    return sorted(keys)


def failed_eval_run_keys(instance: dg.DagsterInstance, log=None) -> list[tuple[str, str]]:
    """``(partition key, run key)`` of each checkpoint whose newest eval run failed for good (no run
    retry coming) and whose ``deepswe_eval`` partition was never materialized, the run key naming the
    failed run's id, sorted by partition key."""
    runs = instance.get_runs(filters=dg.RunsFilter(job_name=checkpoint_eval_job.name))  # newest first
    by_partition: dict[str, list[dg.DagsterRun]] = {}
    for run in runs:
        key = run.tags.get(PARTITION_TAG)
        if key:
            by_partition.setdefault(key, []).append(run)
    failed = {key: mine for key, mine in by_partition.items()
              if mine[0].status == dg.DagsterRunStatus.FAILURE and mine[0].tags.get(WILL_RETRY_TAG) != "true"}
    if not failed:
        return []
    evaluated = instance.get_materialized_partitions(dg.AssetKey("deepswe_eval"))
    keys = []
    for key, mine in sorted(failed.items()):
        if key in evaluated:
            continue
        if len(mine) >= MAX_EVAL_RUNS:
            if log is not None:
                log(f"{key}: {len(mine)} eval runs failed (newest {mine[0].run_id}); not requested again")
            continue
        keys.append((key, f"{key}:after-{mine[0].run_id}"))
    return keys


def eval_request(storage: PosttrainStorage, key: str, run_key: str, log=None) -> dg.RunRequest | None:
    """The ``checkpoint_eval`` request of checkpoint ``key``, run as its run's ``[eval]`` says (the run
    file's, kept in the run's plan, validated as ``evals.settings.EvalSection`` declares it and handed
    to ``deepswe_eval`` as its config: :func:`assets.evals.checkpoint_eval_run_config`, one call from
    the partition key to the run config). An ``[eval]`` that does not validate requests nothing and is
    logged with the file and the key."""
    try:
        run_config = checkpoint_eval_run_config(storage, key)
    except SettingsError as exc:  # the run's [eval] does not validate (the planner calls it PlanError)
        if log is not None:
            log(f"{key}: not evaluated: {exc}")
        return None
    return dg.RunRequest(run_key=run_key, partition_key=key, tags=EVAL_TAGS, run_config=run_config)


@dg.sensor(job=checkpoint_eval_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def new_checkpoint_sensor(context: dg.SensorEvaluationContext, storage: PosttrainStorage) -> dg.SensorResult:
    """Adds a ``checkpoints`` partition for every new checkpoint folder and requests its eval, with
    the settings of its run's ``[eval]`` (the run file's); asks again for the eval of a checkpoint
    whose newest eval run failed (a new request per failed run, at most 4 runs per checkpoint). Every
    request of a tick, new or repeated, is made by :func:`eval_request`; an ``[eval]`` that does not
    validate is logged as an error."""
    known = set(context.instance.get_dynamic_partitions(checkpoints_partitions.name))
    new = [key for key in complete_checkpoint_keys(storage) if key not in known]
    asked = [(key, key) for key in new] + failed_eval_run_keys(context.instance, log=context.log.info)
    requests = [r for r in (eval_request(storage, key, run_key, context.log.error) for key, run_key in asked) if r]
    retries = [r.partition_key for r in requests if r.run_key != r.partition_key]  # keyed by the failed run
    if not new and not retries:
        return dg.SensorResult(skip_reason="no new checkpoint and no failed eval")
    if new:
        context.log.info(f"new checkpoints: {', '.join(new)}")
    if retries:
        context.log.info(f"evals requested again after a failed run: {', '.join(retries)}")
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new)] if new else [],
    )


sensors = [new_checkpoint_sensor, *automation_sensors]
