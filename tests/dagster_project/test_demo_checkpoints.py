"""Every checkpoint a demo run saves is evaluated (issue 52): the demo evaluates the base and the final
checkpoint, a checkpoint between them while its budget allows, and leaves the others to the
checkpoint sensor, which must really take them. A demo once added every checkpoint's partition up
front, so the sensor (which adds and requests a complete checkpoint folder without a partition) said
"no new checkpoint" on every tick and the mid-run checkpoint was never scored.

Real Dagster (an instance on disk, the real sensor); real checkpoint folders written by the trainer's
own writer. The eval itself is a runless ``deepswe_eval`` materialization in the instance: a real
eval needs a served model, and what is under test is what the sensor sees afterwards."""

from __future__ import annotations

import dagster as dg

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.demo import evaluate_checkpoints
from dagster_project.sensors import new_checkpoint_sensor
from tests.dagster_project.helpers import write_checkpoint

KEYS = ["demo-step_000000", "demo-step_000022", "demo-step_000044"]


def _save_run(home) -> None:
    for step in (0, 22, 44):
        write_checkpoint(home, "demo", step)


def _evaluate(instance, done: list[str]):
    def evaluate(key: str) -> None:
        instance.report_runless_asset_event(dg.AssetMaterialization("deepswe_eval", partition=key))
        done.append(key)

    return evaluate


def _sensor(instance, storage):
    return new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))


def test_a_checkpoint_the_demo_leaves_is_requested_by_the_sensor(posttrain_home):
    _save_run(posttrain_home)
    storage = PosttrainStorage(root=str(posttrain_home))
    lines: list[str] = []
    done: list[str] = []
    with dg.instance_for_test() as instance:
        # the base and the final checkpoint took the demo past its budget: the one between is left
        evaluated, left = evaluate_checkpoints(instance, list(reversed(KEYS)), _evaluate(instance, done),
                                               lambda: 1190.0, log=lines.append)
        assert done == [KEYS[0], KEYS[2]] and evaluated == [KEYS[0], KEYS[2]] and left == [KEYS[1]]
        assert any(f"not evaluating checkpoint {KEYS[1]} here" in line for line in lines)
        assert instance.get_dynamic_partitions(checkpoints_partitions.name) == [KEYS[0], KEYS[2]]

        result = _sensor(instance, storage)
        assert [r.partition_key for r in result.run_requests] == [KEYS[1]]
        assert result.run_requests[0].run_key == KEYS[1]
        assert result.run_requests[0].run_config["ops"]["deepswe_eval"]["config"]["dataset"] == "bundled"
        [add] = result.dynamic_partitions_requests
        assert list(add.partition_keys) == [KEYS[1]]


def test_within_its_budget_the_demo_evaluates_all_three_and_leaves_the_sensor_nothing(posttrain_home):
    _save_run(posttrain_home)
    storage = PosttrainStorage(root=str(posttrain_home))
    done: list[str] = []
    with dg.instance_for_test() as instance:
        evaluated, left = evaluate_checkpoints(instance, KEYS, _evaluate(instance, done), lambda: 60.0,
                                               log=lambda m: None)
        assert done == [KEYS[0], KEYS[2], KEYS[1]] and evaluated == KEYS and left == []
        assert instance.get_dynamic_partitions(checkpoints_partitions.name) == KEYS  # in step order
        assert not _sensor(instance, storage).run_requests


def test_a_checkpoint_whose_eval_was_already_requested_is_neither_evaluated_twice_nor_hidden(posttrain_home):
    """A daemon running beside the demo: its sensor took the mid-run checkpoint while the run trained
    and its eval is recorded; the demo, out of budget, neither evaluates it again nor takes its
    partition away."""
    _save_run(posttrain_home)
    done: list[str] = []
    lines: list[str] = []
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, [KEYS[1]])
        instance.report_runless_asset_event(dg.AssetMaterialization("deepswe_eval", partition=KEYS[1]))
        evaluated, left = evaluate_checkpoints(instance, KEYS, _evaluate(instance, done), lambda: 1190.0,
                                               log=lines.append)
        assert done == [KEYS[0], KEYS[2]] and left == []
        assert KEYS[1] in instance.get_dynamic_partitions(checkpoints_partitions.name)
        assert any("its eval was already requested" in line for line in lines)
