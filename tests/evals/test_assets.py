"""The evals assets materialized in a real Dagster instance: task_dataset from built sources,
deepswe_eval of a checkpoint served by a real (random, tiny) model, eval_report from attempt rows."""

import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from assets.evals import deepswe_eval, eval_report
from assets.resources import PosttrainStorage
from assets.tasks import task_dataset
from training.checkpoint import write_checkpoint

from .conftest import DEEPSWE


def test_task_dataset_loads_sources_and_reports_incomplete(small_suite, posttrain_home):
    sources = [str(small_suite)] + ([str(DEEPSWE)] if DEEPSWE.is_dir() else [])
    storage = PosttrainStorage(root=str(posttrain_home))
    with dg.instance_for_test() as instance:
        result = dg.materialize([task_dataset], instance=instance, resources={"storage": storage},
                                run_config={"ops": {"task_dataset": {"config": {"sources": sources}}}})
        assert result.success
        meta = result.asset_materializations_for_node("task_dataset")[0].metadata
    frame = pd.read_parquet(storage.datasets_dir() / "tasks.parquet")
    expected = 9 + (111 if DEEPSWE.is_dir() else 0)
    assert meta["tasks"].value == expected == len(frame)
    assert meta["train_roles"].value == {"demonstrations": 3, "rl": 3}
    assert set(frame["source"]) == ({"bundled", "harbor"} if DEEPSWE.is_dir() else {"bundled"})
    incomplete = json.loads((storage.datasets_dir() / "incomplete.json").read_text())
    assert len(incomplete) == (2 if DEEPSWE.is_dir() else 0)


def test_task_dataset_builds_the_bundled_suite_with_the_rl_tasks_asked_for(posttrain_home):
    """``bundled_rl_per_level`` sets how many RL tasks a level has (0: as many as demonstrations);
    a negative count is refused naming the key, before anything is built."""
    storage = PosttrainStorage(root=str(posttrain_home))

    def materialize(config):
        with dg.instance_for_test() as instance:
            return dg.materialize([task_dataset], instance=instance, resources={"storage": storage}, raise_on_error=False,
                                  run_config={"ops": {"task_dataset": {"config": {"sources": ["bundled"], **config}}}})

    refused = materialize({"bundled_per_level": 2, "bundled_rl_per_level": -1})
    assert not refused.success
    assert "bundled_rl_per_level" in str(refused.get_step_failure_events()[0].event_specific_data.error)
    assert not (storage.datasets_dir() / "bundled").exists()
    result = materialize({"bundled_per_level": 2, "bundled_rl_per_level": 3, "bundled_extra_eval_per_level": 1})
    assert result.success
    meta = result.asset_materializations_for_node("task_dataset")[0].metadata
    # per level: 2 (one held out, one demonstration), 3 for RL, 1 more held out
    assert meta["tasks"].value == 18
    assert meta["train_roles"].value == {"demonstrations": 3, "rl": 9}


def _rows(checkpoint, outcomes):
    rows = []
    for task_id, rewards in outcomes.items():
        for attempt, reward in enumerate(rewards):
            rows.append({"checkpoint": checkpoint, "task_id": task_id, "attempt": attempt,
                         "status": "infra_error" if reward is None else "graded",
                         "reward": reward, "target_score": reward, "strict_target_score": reward, "partial": reward})
    return rows


def test_eval_report_tables_plots_and_flawed_lists(posttrain_home):
    storage = PosttrainStorage(root=str(posttrain_home))
    out = storage.evals_dir() / "deepswe"
    out.mkdir(parents=True)
    base = _rows("r-step_000000", {"a": [0, 0], "b": [0, 1], "c": [0, 0], "d": [1, 1]})
    new = _rows("r-step_000004", {"a": [1, 1], "b": [1, 1], "c": [0, None], "d": [1, 1]})
    pd.DataFrame(base).to_parquet(out / "r-step_000000.parquet")
    pd.DataFrame(new).to_parquet(out / "r-step_000004.parquet")
    flawed = storage.datasets_dir() / "flawed"
    flawed.mkdir(parents=True)
    (flawed / "audit.csv").write_text("id,reason,source\na,instruction does not say which function,review 2026-11\n")
    with dg.instance_for_test() as instance:
        result = dg.materialize([eval_report], instance=instance, resources={"storage": storage},
                                run_config={"ops": {"eval_report": {"config": {"k": 2, "resamples": 200}}}})
        assert result.success
        meta = result.asset_materializations_for_node("eval_report")[0].metadata
    tables = meta["scores"].value
    # all tasks: new pass@1 = (1 + 1 + 0 + 1) / 4 = 0.75 (the infra error is left out); base = (0 + .5 + 0 + 1)/4
    assert "| r-step_000004 | 4 | 7 | 1 | 0.750" in tables
    assert "| r-step_000000 | 4 | 8 | 0 | 0.375" in tables
    assert "### without audit" in tables
    # without task a: new (1 + 0 + 1)/3, base (.5 + 0 + 1)/3
    assert "| r-step_000004 | 3 | 5 | 1 | 0.667" in tables
    csv = pd.read_csv(storage.reports_dir() / "eval_report.csv")
    row = csv[(csv["subset"] == "all") & (csv["checkpoint"] == "r-step_000004")].iloc[0]
    assert row["delta_pass@1"] == pytest.approx(0.375)
    for name in ("pass_at_1.png", "pass_at_k.png", "target_scores.png"):
        assert (storage.reports_dir() / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert meta["pass@1 per checkpoint"].value.startswith("![pass@1 per checkpoint](data:image/png;base64,")
    # task by task against the base model: a went from 0/2 to 2/2 (gained) and is on the audit list
    per_task = {r.data["task_id"]: r.data for r in meta["per_task r-step_000004"].value.records}
    assert (per_task["a"]["base"], per_task["a"]["checkpoint"], per_task["a"]["flip"]) == ("0/2", "2/2", "gained")
    assert per_task["a"]["flawed"] == "audit" and per_task["a"]["change"] == 1.0
    assert [per_task[t]["flip"] for t in "bcd"] == ["", "", ""] and per_task["c"]["checkpoint"] == "0/1"
    assert per_task["a"]["viewer"].endswith("/evals/r-step_000004/tasks/a")
    flips = {r.data["checkpoint"]: r.data for r in meta["flips per checkpoint"].value.records}
    assert (flips["r-step_000004"]["gained"], flips["r-step_000004"]["lost"]) == (1, 0)


def test_deepswe_eval_of_a_checkpoint(small_suite, posttrain_home):
    from serving.tiny import build_tiny_model

    storage = PosttrainStorage(root=str(posttrain_home))
    model = build_tiny_model(posttrain_home / "model")
    key = "t-step_000000"
    ckpt = write_checkpoint(storage.run_dir("t"), 0, lambda tmp: None, {"base_model": str(model), "adapter": None})
    assert ckpt == storage.checkpoint_dir(key)
    config = {"dataset": str(small_suite), "split": "eval", "attempts": 2, "max_turns": 1, "max_new_tokens": 8,
              "workers": 1}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", [key])
        result = dg.materialize([deepswe_eval], instance=instance, resources={"storage": storage}, partition_key=key,
                                run_config={"ops": {"deepswe_eval": {"config": config}}})
        assert result.success
        meta = result.asset_materializations_for_node("deepswe_eval")[0].metadata
    rows = pd.concat([pd.read_parquet(p) for p in (storage.evals_dir() / "deepswe" / key).glob("*.parquet")])
    n_eval = meta["tasks"].value
    assert n_eval >= 1 and len(rows) == 2 * n_eval
    assert set(rows["checkpoint"]) == {key} and set(rows["split"]) == {"eval"}
    assert rows["status"].isin(["graded", "apply_failed", "infra_error"]).all()
    assert meta["adapter_version"].value == "base"
    # the engine's output is kept beside the rows, and the asset names it
    engine_log = Path(meta["engine_log"].value)
    assert engine_log.parent == storage.evals_dir() / "deepswe" / key and "Application startup" in engine_log.read_text()
    # each attempt's page in the viewer: its transcript, tests and diff are in the rows
    assert meta["viewer"].value.endswith(f"/evals/{key}")
    assert {r.data["task_id"] for r in meta["per_task"].value.records} == set(rows["task_id"])
    assert all(json.loads(t)[0]["role"] == "task" for t in rows["transcript"])
    assert {o["kind"] for t in rows["test_outcomes"] for o in json.loads(t)} == {"target", "existing"}
    # the published flawed lists are installed in a new home
    assert (storage.datasets_dir() / "flawed" / "epoch-ai-benchmark-review.jsonl").is_file()


@pytest.mark.slow
def test_difficulty_curriculum_from_a_served_model(small_suite, posttrain_home, tmp_path):
    """The curriculum asset on a run file of its own: a real (random, tiny) model served by an engine
    process, one attempt per RL task, the pass rates and tiers written to curriculum.json."""
    from assets.curriculum import difficulty_curriculum
    from evals.bundled import read_suite
    from evals.tasks import rl_tasks
    from serving.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[model]\npath = "{model}"\n\n[curriculum]\ntasks = "{small_suite}"\nretry_after_steps = 3\n')
    storage = PosttrainStorage(root=str(posttrain_home))
    config = {"run_file": str(run_file), "attempts_per_task": 1, "max_turns": 1, "max_new_tokens": 8, "workers": 1}
    with dg.instance_for_test() as instance:
        result = dg.materialize([difficulty_curriculum], instance=instance, resources={"storage": storage},
                                run_config={"ops": {"difficulty_curriculum": {"config": config}}})
        assert result.success
        meta = result.asset_materializations_for_node("difficulty_curriculum")[0].metadata
    written = json.loads((storage.curriculum_dir() / "curriculum.json").read_text())
    suite = read_suite(small_suite)
    assert len(suite) == 9  # read as it was built, not rebuilt at the default sizes
    ids = {t.id for t in rl_tasks(suite)}
    assert set(written["pass_rates"]) == ids and meta["tasks"].value == len(ids)
    assert sorted(t for tier in written["tiers"].values() for t in tier) == sorted(ids)
    assert written["settings"] == {"retry_after_steps": 3} and written["attempts_per_task"] == 1
    assert written["run_file"] == str(run_file) and written["base_model"] == str(model)
    assert len(pd.read_parquet(storage.curriculum_dir() / "base_attempts.parquet")) == len(ids)
    assert (storage.curriculum_dir() / "engine.log").is_file()
