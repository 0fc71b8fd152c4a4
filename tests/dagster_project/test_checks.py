"""Each asset check passes on inputs that are right and fails, saying why, on inputs crafted wrong."""

import json
import shutil

import dagster as dg
import pandas as pd
import pytest

from assets.checks import (check_adapter_loads, check_attempts_recorded, check_checkpoint_complete, check_infra_share,
                           check_no_duplicates, check_none_dropped, check_oracles_pass, check_report_complete,
                           check_splits_disjoint)
from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from assets.training import checkpoints
from tests.dagster_project.helpers import write_full_checkpoint
from training.checkpoint import adapter_dir


# -- task_dataset -------------------------------------------------------------------------------


def _task(id_, split, instruction=None, source="bundled", oracle=True, validated=True):
    meta = {"reference_edits": [[0, 1, "x"]]} if oracle else {}
    if oracle and validated:
        meta["failing_output"] = "FAILED test_x"
    return {"id": id_, "source": source, "split": split, "instruction": instruction or f"fix {id_}",
            "metadata": json.dumps(meta)}


def _datasets(tmp_path, tasks, incomplete=(), suite=None):
    datasets = tmp_path / "datasets"
    (datasets / "bundled").mkdir(parents=True)
    pd.DataFrame(tasks).to_parquet(datasets / "tasks.parquet")
    (datasets / "incomplete.json").write_text(json.dumps(list(incomplete)))
    ids = [t["id"] for t in tasks if t["source"] == "bundled"] if suite is None else suite
    (datasets / "bundled" / "suite.json").write_text(json.dumps({"tasks": ids}))
    return datasets


def test_task_dataset_checks_pass_on_a_clean_dataset(tmp_path):
    datasets = _datasets(tmp_path, [_task("a", "train"), _task("b", "eval"), _task("h1", "eval", source="harbor", oracle=False)],
                         incomplete=[{"id": "h2", "source": "harbor", "path": "/x", "reason": "task.toml: no tests"}])
    for check in (check_none_dropped, check_splits_disjoint, check_oracles_pass):
        result = check(datasets)
        assert result.passed, (check.__name__, result.description)
    assert check_oracles_pass(datasets).metadata["without_oracle_result"].value == 1


def test_a_task_dropped_silently_is_named(tmp_path):
    datasets = _datasets(tmp_path, [_task("a", "train")], suite=["a", "lost-one"])
    result = check_none_dropped(datasets)
    assert not result.passed and "lost-one" in result.description
    reasonless = _datasets(tmp_path / "2", [_task("a", "train")], incomplete=[{"id": "z", "reason": ""}])
    assert "without a reason: z" in check_none_dropped(reasonless).description


def test_overlapping_splits_are_named(tmp_path):
    datasets = _datasets(tmp_path, [_task("a", "train", "same text"), _task("b", "eval", "same text"),
                                    _task("c", "train"), _task("c", "eval")])
    result = check_splits_disjoint(datasets)
    assert not result.passed
    assert "appear more than once: c" in result.description and "in both train and eval: c" in result.description
    assert "2 instruction(s) shared" in result.description  # "same text", and c's own
    # a templated instruction on two different repositories is two tasks; on one commit, one task
    templated = [{**_task("t", "train", "A test of orders.py fails."), "base_commit": "aaa"},
                 {**_task("e", "eval", "A test of orders.py fails."), "base_commit": "bbb"}]
    assert check_splits_disjoint(_datasets(tmp_path / "templated", templated)).passed
    templated[1]["base_commit"] = "aaa"
    leaked = check_splits_disjoint(_datasets(tmp_path / "leaked", templated))
    assert not leaked.passed and "1 instruction(s) shared by a train and an eval task on the same snapshot" in leaked.description


def test_an_unvalidated_oracle_fails(tmp_path):
    datasets = _datasets(tmp_path, [_task("a", "train"), _task("b", "eval", validated=False)])
    result = check_oracles_pass(datasets)
    assert not result.passed and "e.g. b" in result.description


# -- checkpoints ----------------------------------------------------------------------------------


def test_checkpoint_checks_pass_on_a_checkpoint_the_trainer_would_write(posttrain_home):
    for step in (0, 4):
        ckpt = write_full_checkpoint(posttrain_home, "r1", step)
        assert check_checkpoint_complete(ckpt, step).passed, check_checkpoint_complete(ckpt, step).description
        result = check_adapter_loads(ckpt, step)
        assert result.passed, result.description
    assert result.metadata["lora_rank"].value == 4


def test_a_missing_file_or_a_broken_adapter_fails(posttrain_home):
    ckpt = write_full_checkpoint(posttrain_home, "r1", 4)
    (ckpt / "optimizer.pt").unlink()
    result = check_checkpoint_complete(ckpt, 4)
    assert not result.passed and result.description == "missing optimizer.pt"

    ckpt = write_full_checkpoint(posttrain_home, "r1", 8)
    (adapter_dir(ckpt) / "adapter_model.safetensors").write_bytes(b"\0" * 64)  # cut, not safetensors
    assert not check_checkpoint_complete(ckpt, 8).passed
    assert "does not load" in check_adapter_loads(ckpt, 8).description

    ckpt = write_full_checkpoint(posttrain_home, "r1", 12)
    (adapter_dir(ckpt) / "adapter_config.json").write_text(json.dumps({"r": 16}))
    assert "r = 16, the tensors have rank(s) [4]" in check_adapter_loads(ckpt, 12).description
    shutil.rmtree(adapter_dir(ckpt))
    assert not check_checkpoint_complete(ckpt, 12).passed


def test_checkpoint_checks_are_recorded_in_the_instance(posttrain_home):
    write_full_checkpoint(posttrain_home, "r1", 4)
    ckpt = write_full_checkpoint(posttrain_home, "r1", 8)
    (ckpt / "rng.pt").unlink()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000004", "r1-step_000008"])
        storage = PosttrainStorage(root=str(posttrain_home))
        outcomes = {}
        for key in ("r1-step_000004", "r1-step_000008"):
            result = dg.materialize([checkpoints], instance=instance, partition_key=key, resources={"storage": storage})
            assert result.success  # a failed check is reported, the checkpoint is still recorded
            outcomes[key] = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert outcomes["r1-step_000004"] == {"checkpoint_complete": True, "adapter_loads": True}
        assert outcomes["r1-step_000008"] == {"checkpoint_complete": False, "adapter_loads": True}


# -- deepswe_eval and eval_report ----------------------------------------------------------------


def _rows(tasks=("t1", "t2"), attempts=2, **override):
    rows = [{"task_id": t, "attempt": a, "status": "graded", "reward": 1.0 if a == 0 else 0.0, "detail": ""}
            for t in tasks for a in range(attempts)]
    return pd.DataFrame(rows)


def test_eval_checks_pass_on_complete_rows():
    frame = _rows()
    assert check_attempts_recorded(frame, ["t1", "t2"], 2).passed
    assert check_infra_share(frame, 0.1).passed
    assert check_no_duplicates(frame).passed


def test_eval_checks_fail_on_missing_unscored_and_duplicated_attempts():
    frame = _rows()
    missing = frame.iloc[1:]
    assert "1 attempt(s) without a row, e.g. task t1 attempt 0" in check_attempts_recorded(missing, ["t1", "t2"], 2).description
    unscored = frame.copy()
    unscored.loc[2, "reward"] = None
    assert "graded row(s) without a reward, e.g. task t2" in check_attempts_recorded(unscored, ["t1", "t2"], 2).description
    silent = frame.copy()
    silent.loc[0, "status"], silent.loc[0, "reward"] = "infra_error", None
    assert "do not say what failed" in check_attempts_recorded(silent, ["t1", "t2"], 2).description
    odd = frame.copy()
    odd.loc[0, "status"] = "skipped"
    assert "status 'skipped'" in check_attempts_recorded(odd, ["t1", "t2"], 2).description
    doubled = pd.concat([frame, frame.iloc[[3]]], ignore_index=True)
    result = check_no_duplicates(doubled)
    assert not result.passed and "task t2 attempt 1" in result.description


@pytest.mark.parametrize("lost,passed", [(0, True), (1, False)])
def test_infra_error_share_over_the_threshold_fails(lost, passed):
    frame = _rows(attempts=4)
    frame.loc[:lost * 2 - 1, "status"] = "infra_error"  # 2 of 8 = 25% when lost
    result = check_infra_share(frame, 0.1)
    assert result.passed is passed
    assert result.metadata["infra_error_share"].value == (0.25 if lost else 0.0)


def test_report_check_names_an_evaluated_checkpoint_left_out():
    assert check_report_complete({"r-step_000000", "r-step_000004"}, {"r-step_000000", "r-step_000004"}).passed
    result = check_report_complete({"r-step_000000"}, {"r-step_000000", "r-step_000004"})
    assert not result.passed and "r-step_000004" in result.description
