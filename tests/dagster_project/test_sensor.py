"""The checkpoint sensor adds a partition for each new checkpoint folder and requests its eval."""

from pathlib import Path

import dagster as dg

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from dagster_project.sensors import new_checkpoint_sensor
from tests.dagster_project.helpers import write_checkpoint
from training.checkpoint import checkpoint_path, run_path

REPO = Path(__file__).resolve().parents[2]


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


def _failed_eval_run(instance, key: str) -> str:
    """A real checkpoint_eval run of ``key`` that fails (its checkpoint folder has no metadata.json)."""
    from dagster_project.definitions import defs

    result = defs.resolve_job_def("checkpoint_eval").execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False, tags={"dagster/partition": key})
    assert not result.success
    return result.run_id


def test_a_failed_eval_is_requested_again_once_per_failed_run(posttrain_home):
    from dagster_project.sensors import MAX_EVAL_RUNS

    storage = PosttrainStorage(root=str(posttrain_home))
    checkpoint_path(run_path(posttrain_home, "r1"), 4).mkdir(parents=True)  # no metadata.json: the eval fails
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000004"])
        seen = set()
        for attempt in range(MAX_EVAL_RUNS):
            run_id = _failed_eval_run(instance, "r1-step_000004")
            result = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))
            keys = [r.run_key for r in result.run_requests]
            if attempt < MAX_EVAL_RUNS - 1:
                assert keys == [f"r1-step_000004:after-{run_id}"]
                assert result.run_requests[0].partition_key == "r1-step_000004"
                assert result.run_requests[0].tags["posttrain/workload"] == "eval"
                assert keys[0] not in seen
                seen.add(keys[0])
            else:
                assert keys == []  # MAX_EVAL_RUNS runs failed: no more requests


def test_a_failed_eval_that_the_daemon_will_retry_is_not_requested(posttrain_home):
    storage = PosttrainStorage(root=str(posttrain_home))
    checkpoint_path(run_path(posttrain_home, "r1"), 4).mkdir(parents=True)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000004"])
        run_id = _failed_eval_run(instance, "r1-step_000004")
        instance.add_run_tags(run_id, {"dagster/will_retry": "true"})
        result = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))
        assert not result.run_requests


def test_each_checkpoint_is_evaluated_as_its_run_files_eval_table_says(posttrain_home, tmp_path, capsys):
    """The run file's ``[eval]`` reaches the plan (resolved-plan.json), and the sensor's request for
    each checkpoint of the run carries it as deepswe_eval's config; a run planned without one gets the
    defaults, and a plan whose table does not validate requests nothing, saying which key."""
    from assets.evals import EVAL_DEFAULTS, eval_config
    from training.planner import resolve, write_resolved_plan

    storage = PosttrainStorage(root=str(posttrain_home))
    run_file = tmp_path / "run.toml"
    run_file.write_text((REPO / "examples" / "embedded.toml").read_text() + (
        '\n[eval]\ndataset = "/data/deepswe/tasks"\nsources = "/work/.mirror"\ntask_ids = ["a", "b"]\n'
        "attempts = 2\nmax_turns = 8\nmax_new_tokens = 256\n"))
    write_resolved_plan(resolve(run_file), storage.run_dir("deep"))
    write_checkpoint(posttrain_home, "deep", 0)
    write_checkpoint(posttrain_home, "plain", 0)
    write_checkpoint(posttrain_home, "broken", 0)
    (storage.run_dir("broken") / "resolved-plan.json").write_text('{"eval": {"attempts": 0}}')
    with dg.instance_for_test() as instance:
        result = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))
    configs = {r.partition_key: r.run_config["ops"]["deepswe_eval"]["config"] for r in result.run_requests}
    assert sorted(configs) == ["deep-step_000000", "plain-step_000000"]
    deep = configs["deep-step_000000"]
    assert (deep["dataset"], deep["sources"], deep["task_ids"]) == ("/data/deepswe/tasks", "/work/.mirror", ["a", "b"])
    assert (deep["attempts"], deep["max_turns"], deep["max_new_tokens"], deep["split"]) == (2, 8, 256, "eval")
    assert configs["plain-step_000000"] == eval_config(EVAL_DEFAULTS)
    logged = capsys.readouterr().err  # the sensor's log
    assert "broken-step_000000: not evaluated:" in logged and "[eval] attempts: expected a positive value" in logged
