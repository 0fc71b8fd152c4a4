"""The asset graph is the platform's public surface: keys, partitions and edges are pinned here."""

import dagster as dg
import pytest

from dagster_project.definitions import defs
from dagster_project.partitions import checkpoint_partition_key, parse_checkpoint_partition_key

KEYS = {"task_dataset", "image_cache", "difficulty_curriculum", "rl_run", "checkpoints", "deepswe_eval", "eval_report"}
EDGES = {
    "image_cache": {"task_dataset"},
    "difficulty_curriculum": {"image_cache"},
    "rl_run": {"difficulty_curriculum"},
    "checkpoints": {"rl_run"},
    "deepswe_eval": {"checkpoints"},
    "eval_report": {"deepswe_eval"},
    "task_dataset": set(),
}


def test_asset_keys():
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == KEYS


def test_partitions():
    graph = defs.resolve_asset_graph()
    for key in KEYS:
        partitions = graph.get(dg.AssetKey(key)).partitions_def
        if key in {"checkpoints", "deepswe_eval"}:
            assert isinstance(partitions, dg.DynamicPartitionsDefinition)
            assert partitions.name == "checkpoints"
        else:
            assert partitions is None, key


@pytest.mark.parametrize("asset", sorted(EDGES))
def test_dependencies(asset):
    graph = defs.resolve_asset_graph()
    parents = {k.to_user_string() for k in graph.get(dg.AssetKey(asset)).parent_keys}
    assert parents >= EDGES[asset]
    assert parents <= KEYS


def test_every_asset_has_a_description():
    graph = defs.resolve_asset_graph()
    for key in KEYS:
        assert graph.get(dg.AssetKey(key)).description, key


def test_jobs_and_sensor():
    assert defs.resolve_job_def("checkpoint_eval").partitions_def.name == "checkpoints"
    assert defs.resolve_sensor_def("new_checkpoint_sensor").job_name == "checkpoint_eval"


def test_partition_keys_sort_by_step():
    keys = [checkpoint_partition_key("run-a", s) for s in (44, 4, 0)]
    assert sorted(keys) == ["run-a-step_000000", "run-a-step_000004", "run-a-step_000044"]
    assert parse_checkpoint_partition_key("run-a-step_000044") == ("run-a", 44)


@pytest.mark.parametrize("bad", ["run", "run-step_44", "-step_000001", "run-step_0000001"])
def test_bad_partition_keys_are_named(bad):
    with pytest.raises(ValueError, match="expected '<run_name>-step_NNNNNN'"):
        parse_checkpoint_partition_key(bad)
