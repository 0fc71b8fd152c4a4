"""Materializing assets in a real (temporary) Dagster instance."""

import dagster as dg
import pytest

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from assets.training import checkpoints
from tests.dagster_project.helpers import write_checkpoint
from training.checkpoint import checkpoint_path, run_path


def test_checkpoint_partition_materializes_with_metadata(posttrain_home):
    write_checkpoint(posttrain_home, "r1", 8, loss=0.25)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000008"])
        result = dg.materialize(
            [checkpoints],
            instance=instance,
            partition_key="r1-step_000008",
            resources={"storage": PosttrainStorage(root=str(posttrain_home))},
            selection=[checkpoints],
        )
        assert result.success
        [mat] = result.asset_materializations_for_node("checkpoints")
        assert mat.partition == "r1-step_000008"
        assert mat.metadata["loss"].value == 0.25
        assert mat.metadata["step"].value == 8
        stored = instance.get_latest_materialization_event(dg.AssetKey("checkpoints"))
        assert stored.asset_materialization.partition == "r1-step_000008"


def test_incomplete_checkpoint_fails_with_a_clear_error(posttrain_home):
    checkpoint_path(run_path(posttrain_home, "r1"), 3).mkdir(parents=True)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000003"])
        with pytest.raises(FileNotFoundError, match="r1-step_000003: .*metadata.json is missing"):
            dg.materialize(
                [checkpoints],
                instance=instance,
                partition_key="r1-step_000003",
                resources={"storage": PosttrainStorage(root=str(posttrain_home))},
            )
