"""Sensors: each checkpoint a run saves becomes a partition and is evaluated."""

import dagster as dg

from assets.partitions import checkpoint_partition_key, checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.jobs import checkpoint_eval_job
from training.checkpoint import list_checkpoints


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


@dg.sensor(job=checkpoint_eval_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def new_checkpoint_sensor(context: dg.SensorEvaluationContext, storage: PosttrainStorage) -> dg.SensorResult:
    """Adds a ``checkpoints`` partition for every new checkpoint folder and requests its eval."""
    known = set(context.instance.get_dynamic_partitions(checkpoints_partitions.name))
    new = [key for key in complete_checkpoint_keys(storage) if key not in known]
    if not new:
        return dg.SensorResult(skip_reason="no new checkpoint")
    context.log.info(f"new checkpoints: {', '.join(new)}")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=key, partition_key=key) for key in new],
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new)],
    )


sensors = [new_checkpoint_sensor]
