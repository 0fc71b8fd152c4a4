"""``deepswe_eval`` on a Harbor dataset, materialized in a real Dagster instance: bundled tasks exported
with ``posttrain tasks export-harbor``, their images built through the image cache, a checkpoint of a
real (random, tiny) model served by a vLLM replica process, every attempt through DeepSWE v1.1's
verifier flow in bwrap sandboxes; then ``eval_report`` over the same rows, with a flawed list."""

from __future__ import annotations

import json

import dagster as dg
import pandas as pd
import pytest

from assets.evals import ATTEMPTS_CHECK, DUPLICATES_CHECK, INFRA_CHECK, deepswe_eval, eval_report
from assets.resources import PosttrainStorage
from dagster_project.cli import main
from evals.evaluate import ROW_COLUMNS
from evals.tasks import load_bundled
from training.checkpoint import write_checkpoint

KEY = "h-step_000000"


@pytest.mark.slow
def test_deepswe_eval_of_a_checkpoint_on_a_harbor_dataset(small_suite, posttrain_home, tmp_path, capsys):
    from serving.tiny import build_tiny_model

    # three held-out tasks of the bundled suite as a Harbor dataset; the third's recipe cannot be built
    ids = [t.id for t in load_bundled(small_suite).tasks if t.split == "eval"][:3]
    dataset = tmp_path / "harbor"
    assert main(["tasks", "export-harbor", str(small_suite), str(dataset), "--tasks", ",".join(ids)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"] == 3
    broken = dataset / "tasks" / ids[2] / "environment" / "Dockerfile"
    broken.write_text(broken.read_text() + "RUN echo no such dependency >&2 && exit 3\n")

    storage = PosttrainStorage(root=str(posttrain_home))
    model = build_tiny_model(tmp_path / "model")
    write_checkpoint(storage.run_dir("h"), 0, lambda tmp: None, {"base_model": str(model), "adapter": None})
    flawed = storage.datasets_dir() / "flawed"
    flawed.mkdir(parents=True)
    (flawed / "audit.csv").write_text(f"id,reason,source\n{ids[0]},the instruction is ambiguous,review\n")
    config = {"dataset": str(dataset), "sources": str(dataset / "repos"), "network": False,
              "attempts": 2, "max_turns": 2, "max_new_tokens": 16, "workers": 2, "max_infra_error_share": 0.5}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", [KEY])
        result = dg.materialize([deepswe_eval], instance=instance, resources={"storage": storage}, partition_key=KEY,
                                run_config={"ops": {"deepswe_eval": {"config": config}}})
        assert result.success
        logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
        meta = result.asset_materializations_for_node("deepswe_eval")[0].metadata
        checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
        report = dg.materialize([eval_report], instance=instance, resources={"storage": storage},
                                run_config={"ops": {"eval_report": {"config": {"k": 2, "resamples": 100}}}})
        assert report.success
        report_meta = report.asset_materializations_for_node("eval_report")[0].metadata

    # progress of the image builds, one line per task, the broken recipe reported
    assert sum(f"/3] {i}: " in m for m in logs for i in ids) == 3
    assert any(f"[3/3] {ids[2]}: no image" in m and "exit" in m for m in logs), logs
    assert any("served on http://127.0.0.1:" in m for m in logs)

    rows = pd.read_parquet(storage.evals_dir() / "deepswe" / KEY / f"{result.run_id}.parquet")
    assert list(rows.columns) == list(ROW_COLUMNS)
    assert sorted(zip(rows["task_id"], rows["attempt"])) == sorted((i, a) for i in ids for a in range(2))
    served, lost = rows[rows["task_id"] != ids[2]], rows[rows["task_id"] == ids[2]]
    # every attempt of a built task went through the verifier and was graded (a random model scores 0)
    assert served["status"].isin(["graded", "apply_failed", "agent_fault"]).all(), served[["status", "detail"]]
    assert served["reward"].notna().all() and (served["reward"] == 0.0).all()
    assert (served["grade_s"] > 0).all() and (served["turns"] >= 1).all() and (served["source"] == "harbor").all()
    assert set(rows["checkpoint"]) == {KEY} and rows["adapter_version"].isna().all()
    assert (lost["status"] == "infra_error").all() and lost["reward"].isna().all()
    assert lost["detail"].str.startswith("the task's image was not built:").all()
    for task_id in ids[:2]:
        for attempt in range(2):
            grade = json.loads((storage.evals_dir() / "harbor" / KEY / result.run_id / task_id / str(attempt)
                                / "posttrain-grade.json").read_text())
            assert grade["status"] in ("graded", "apply_failed") and grade["scores"]["reward"] == 0.0

    assert meta["tasks"].value == 3 and meta["attempts"].value == 6 and meta["infra_errors"].value == 2
    assert meta["pass@1"].value == 0.0 and meta["adapter_version"].value == "base"
    assert checks[ATTEMPTS_CHECK].passed and checks[DUPLICATES_CHECK].passed
    share = checks[INFRA_CHECK].metadata["infra_error_share"].value
    assert checks[INFRA_CHECK].passed and share == pytest.approx(1 / 3, abs=1e-4)

    # the report reads the Harbor rows unchanged: 2 tasks graded (4 attempts, 2 infra errors), again
    # without the flawed list's task
    tables = report_meta["scores"].value
    assert f"| {KEY} | 2 | 4 | 2 | 0.000 [0.000, 0.000] |" in tables, tables
    assert "### without audit" in tables and f"| {KEY} | 1 | 2 | 2 | 0.000 [0.000, 0.000] |" in tables, tables


def test_the_harbor_tasks_of_deepswe_eval_and_its_config_errors(small_suite, tmp_path):
    """Which Harbor tasks the asset takes (``task_ids``, ``split``; a task without a split, as
    DeepSWE's have, is held out), the tasks it names that cannot be built (kept, with the reason, for
    their infra_error rows) and the errors that name the config key."""
    from assets.harbor_eval import harbor_eval_tasks
    from evals.harbor import export_harbor

    tasks = [t for t in load_bundled(small_suite).tasks if t.split == "eval"][:2]
    dataset = tmp_path / "harbor"
    export_harbor(tasks, dataset)
    toml = dataset / "tasks" / tasks[1].id / "task.toml"
    toml.write_text(toml.read_text().replace('split = "eval"\n', ""))  # no split, as in DeepSWE
    context = dg.build_asset_context()
    repos = str(dataset / "repos")
    def ids(split, task_ids):
        found, unbuildable = harbor_eval_tasks(context, str(dataset), repos, split, task_ids)
        return [t.id for t in found], [(t.id, t.reason) for t in unbuildable]

    assert ids("eval", []) == ([t.id for t in tasks], [])
    assert ids("train", []) == ([tasks[1].id], [])
    assert ids("all", [tasks[0].id]) == ([tasks[0].id], [])
    with pytest.raises(ValueError, match="needs sources"):
        harbor_eval_tasks(context, str(dataset), "", "eval", [])
    with pytest.raises(ValueError, match=r"task_ids names no-such-task, not a task of"):
        harbor_eval_tasks(context, str(dataset), repos, "eval", ["no-such-task"])
    with pytest.raises(ValueError, match=rf"task_ids names {tasks[0].id}, not in split 'train'"):
        harbor_eval_tasks(context, str(dataset), repos, "train", [tasks[0].id])
    (dataset / "tasks" / tasks[0].id / "tests" / "config.json").unlink()  # named, yet it cannot be built
    assert ids("eval", [tasks[0].id, tasks[1].id]) == ([tasks[1].id], [(tasks[0].id, "missing tests/config.json")])
    assert ids("eval", []) == ([tasks[1].id], [])  # not named: left out, in the one line of the log


def test_an_episode_is_bounded_by_the_served_models_context(tmp_path):
    """Real tasks' prompts can be longer than a small model's context (DeepSWE's sqlfmt task: 2277
    tokens; the embedded base model: 2048): the episode is bounded by the model folder's
    ``max_position_embeddings`` and stops, rather than the engine refusing the call."""
    from evals.harness import episode_context, model_context_tokens

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert model_context_tokens(tmp_path) == 2048
    assert episode_context(tmp_path) == {"max_context_tokens": 2048}
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": "long"}))
    assert model_context_tokens(tmp_path) is None
    assert model_context_tokens(tmp_path / "missing") is None
    assert episode_context(tmp_path / "missing") == {}  # run_episode's own bound then


@pytest.mark.slow
def test_a_harbor_eval_of_a_kubernetes_runs_checkpoint_runs_here_and_keeps_its_rows(small_suite, posttrain_home, tmp_path,
                                                                                  capsys):
    """A run launched on Kubernetes leaves its eval pod in its folder; a Harbor dataset is still
    evaluated here (its images, DeepSWE's verifier flow), and its rows are written like any other's."""
    from serving.tiny import build_tiny_model
    from training.planner.k8s import EVAL_POD_FILE

    [task_id] = [t.id for t in load_bundled(small_suite).tasks if t.split == "eval"][:1]
    dataset = tmp_path / "harbor"
    assert main(["tasks", "export-harbor", str(small_suite), str(dataset), "--tasks", task_id]) == 0
    capsys.readouterr()
    storage = PosttrainStorage(root=str(posttrain_home))
    model = build_tiny_model(tmp_path / "model")
    write_checkpoint(storage.run_dir("h"), 0, lambda tmp: None, {"base_model": str(model), "adapter": None})
    (storage.run_dir("h") / EVAL_POD_FILE).write_text(json.dumps({"kind": "Pod", "metadata": {"name": "never-launched"}}))
    config = {"dataset": str(dataset), "sources": str(dataset / "repos"), "network": False,
              "attempts": 1, "max_turns": 1, "max_new_tokens": 8, "workers": 1}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", [KEY])
        result = dg.materialize([deepswe_eval], instance=instance, resources={"storage": storage}, partition_key=KEY,
                                run_config={"ops": {"deepswe_eval": {"config": config}}})
    assert result.success
    rows = pd.read_parquet(storage.evals_dir() / "deepswe" / KEY / f"{result.run_id}.parquet")
    assert list(rows["task_id"]) == [task_id]
