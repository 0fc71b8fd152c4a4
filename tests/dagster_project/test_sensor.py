"""The checkpoint sensor adds a partition for each new checkpoint folder and requests its eval."""

import dagster as dg

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.sensors import new_checkpoint_sensor
from tests.dagster_project.helpers import write_checkpoint
from training.checkpoint import checkpoint_path, run_path


def test_new_checkpoints_become_partitions_with_eval_requests(posttrain_home):
    write_checkpoint(posttrain_home, "r1", 0)
    write_checkpoint(posttrain_home, "r1", 4)
    # A checkpoint still being written (no metadata.json yet) is not picked up.
    checkpoint_path(run_path(posttrain_home, "r1"), 8).mkdir()
    storage = PosttrainStorage(root=str(posttrain_home))
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        result = new_checkpoint_sensor(context)
        assert [r.partition_key for r in result.run_requests] == ["r1-step_000000", "r1-step_000004"]
        [add] = result.dynamic_partitions_requests
        assert add.partitions_def_name == "checkpoints"
        assert list(add.partition_keys) == ["r1-step_000000", "r1-step_000004"]

        # Once those partitions exist, only the next new checkpoint is requested.
        instance.add_dynamic_partitions(checkpoints_partitions.name, list(add.partition_keys))
        write_checkpoint(posttrain_home, "r1", 12)
        result = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))
        assert [r.partition_key for r in result.run_requests] == ["r1-step_000012"]


def test_no_runs_folder_means_nothing_to_do(posttrain_home):
    storage = PosttrainStorage(root=str(posttrain_home))
    with dg.instance_for_test() as instance:
        result = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))
        assert not result.run_requests
