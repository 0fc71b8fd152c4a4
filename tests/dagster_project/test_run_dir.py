"""The run directory as the trainer writes it and the platform reads it (training.checkpoint):
which folders are complete checkpoints, and how a checkpoint whose metadata is missing or broken is
reported, by the trainer's reader and by the ``checkpoints`` asset alike."""

import dagster as dg
import pytest

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from assets.training import checkpoints
from dagster_project.sensors import complete_checkpoint_keys
from tests.dagster_project.helpers import write_checkpoint
from training.checkpoint import (CheckpointLoadError, IncompleteCheckpointError, adapter_dir, checkpoint_path,
                                 checkpoint_policy, checkpoints_dir, list_checkpoints, read_metadata, run_path)


def test_only_complete_checkpoints_with_their_own_names_are_listed(posttrain_home):
    run = run_path(posttrain_home, "r1")
    for step in (0, 4, 12):
        write_checkpoint(posttrain_home, "r1", step, loss=1.0)
    # a checkpoint being written, one without metadata, and names no step of ours is spelt as
    for name in (".tmp-step_000016-123", "step_000020", "step_12", "step_0000013", "step_x"):
        (checkpoints_dir(run) / name).mkdir()
        if name != "step_000020":
            (checkpoints_dir(run) / name / "metadata.json").write_text("{}")
    saved = list_checkpoints(run)
    assert [(c.step, c.path) for c in saved] == [(s, checkpoint_path(run, s)) for s in (0, 4, 12)]
    assert saved[1].metadata()["loss"] == 1.0 and saved[1].metadata()["step"] == 4
    storage = PosttrainStorage(root=str(posttrain_home))
    assert complete_checkpoint_keys(storage) == ["r1-step_000000", "r1-step_000004", "r1-step_000012"]
    assert storage.checkpoint_dir("r1-step_000012") == checkpoint_path(run, 12)


def test_missing_metadata_names_the_file(tmp_path):
    ckpt = checkpoint_path(tmp_path, 3)
    ckpt.mkdir(parents=True)
    with pytest.raises(IncompleteCheckpointError) as err:
        read_metadata(ckpt, name="r-step_000003")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, CheckpointLoadError)
    assert str(err.value).startswith(f"checkpoint r-step_000003: checkpoint file {ckpt / 'metadata.json'} is missing")
    assert err.value.path == ckpt / "metadata.json"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_broken_metadata_names_the_file_and_what_was_expected(tmp_path, content):
    ckpt = checkpoint_path(tmp_path, 3)
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_bytes(content)
    with pytest.raises(CheckpointLoadError, match="expected a JSON object") as err:
        read_metadata(ckpt)
    assert f"checkpoint file {ckpt / 'metadata.json'} does not load" in str(err.value)
    assert not isinstance(err.value, FileNotFoundError)


def test_checkpoint_asset_reports_broken_metadata_like_the_trainer(posttrain_home):
    ckpt = write_checkpoint(posttrain_home, "r1", 5)
    (ckpt / "metadata.json").write_text("[]")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000005"])
        with pytest.raises(CheckpointLoadError, match=r"checkpoint r1-step_000005: checkpoint file .*step_000005/"
                                                      r"metadata.json does not load .*expected a JSON object"):
            dg.materialize([checkpoints], instance=instance, partition_key="r1-step_000005",
                           resources={"storage": PosttrainStorage(root=str(posttrain_home))})


def test_policy_of_a_checkpoint(posttrain_home, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    base = write_checkpoint(posttrain_home, "r1", 0, base_model=str(model))
    trained = write_checkpoint(posttrain_home, "r1", 4, base_model=str(model), adapter_version="step_000004")
    policy = checkpoint_policy(base, name="r1-step_000000")
    assert (policy.base_model, policy.adapter, policy.adapter_version) == (model, None, None)
    policy = checkpoint_policy(trained, name="r1-step_000004")
    assert (policy.base_model, policy.adapter, policy.adapter_version) == (model, adapter_dir(trained), "step_000004")
    no_model = write_checkpoint(posttrain_home, "r1", 8, base_model=str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="checkpoint r1-step_000008: metadata key 'base_model'"):
        checkpoint_policy(no_model, name="r1-step_000008")
