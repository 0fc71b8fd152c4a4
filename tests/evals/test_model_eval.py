"""Any model in one command: ``posttrain eval DATASET --model DIR`` registers the model folder as the
checkpoint ``NAME-step_000000`` of the local Dagster instance (posttrain sets the instance itself) and
runs its ``checkpoint_eval`` there, as the checkpoint sensor runs a run's, on a Harbor dataset this
project owns (the bundled suite exported as Harbor tasks): a real instance on disk, real sandboxes,
a tiny random model served by a real vLLM replica; ``posttrain backfill`` reads the same settings."""

from __future__ import annotations

import json
import os
import types

import dagster as dg
import pandas as pd
import pytest

from dagster_project.cli import backfill_run_config, main
from evals.harbor import export_harbor
from evals.tasks import load_bundled


@pytest.mark.slow
def test_a_model_folder_is_registered_and_evaluated_in_the_instance_in_one_command(small_suite, posttrain_home,
                                                                                  tmp_path, capsys, monkeypatch):
    from serving.tiny import build_tiny_model

    monkeypatch.delenv("DAGSTER_HOME")  # posttrain sets it: $POSTTRAIN_HOME/dagster
    ids = [t.id for t in load_bundled(small_suite).tasks if t.split == "eval"][:2]
    dataset = tmp_path / "harbor"
    export_harbor([t for t in load_bundled(small_suite).tasks if t.id in ids], dataset)
    model = build_tiny_model(tmp_path / "tiny")
    command = ["eval", str(dataset), "--sources", str(dataset / "repos"), "--model", str(model), "--offline",
               "--attempts", "1", "--max-turns", "1", "--max-new-tokens", "8", "--workers", "1", "--json"]
    # (a task that cannot be built is refused before any run: tests/evals/test_eval_record.py)

    assert main(command) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    key = result["checkpoint"]
    assert key == "tiny-step_000000"
    assert f"registered as checkpoint {key}" in err
    rows_path = posttrain_home / "evals" / "deepswe" / key / f"{result['run_id']}.parquet"
    assert result["rows_path"] == str(rows_path) and f"posttrain eval: attempt rows: {rows_path}" in err
    rows = {r["task_id"]: r for r in result["rows"]}
    assert all(r["status"] in ("graded", "apply_failed", "agent_fault") and r["reward"] == 0.0 for r in rows.values())

    # the instance is posttrain's own, and it holds the model beside any run's checkpoints
    assert os.environ["DAGSTER_HOME"] == str(posttrain_home / "dagster")
    with dg.DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions("checkpoints") == [key]
        assert instance.get_materialized_partitions(dg.AssetKey("deepswe_eval")) == {key}
        assert instance.get_materialized_partitions(dg.AssetKey("checkpoints")) == {key}
        evaluations = [e.dagster_event.event_specific_data for e in instance.all_logs(result["run_id"])
                       if e.dagster_event and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"]
    checks = {(c.asset_key.to_user_string(), c.check_name): c.passed for c in evaluations}
    saved = pd.read_parquet(posttrain_home / "evals" / "deepswe" / key / f"{result['run_id']}.parquet")
    assert sorted(saved["task_id"]) == sorted(ids)
    ckpt = posttrain_home / "runs" / "tiny" / "checkpoints" / "step_000000"
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["base_model"] == str(model) and meta["registered_model"] and not meta["adapter"]
    settings = json.loads((posttrain_home / "runs" / "tiny" / "eval.json").read_text())["eval"]
    assert settings["dataset"] == str(dataset) and settings["attempts"] == 1 and settings["network"] is False
    # the registered model holds no trainer state, and its checkpoint is complete without it
    assert checks[("checkpoints", "checkpoint_complete")] and checks[("checkpoints", "adapter_loads")]
    assert checks[("deepswe_eval", "infra_error_share_under_threshold")]

    # a backfill of that partition evaluates it as it was evaluated, with the options given over it
    args = types.SimpleNamespace(asset="deepswe_eval", run_file=None, dataset=None, attempts=3)
    config = backfill_run_config(args, [key])["ops"]["deepswe_eval"]["config"]
    assert (config["dataset"], config["max_turns"], config["attempts"]) == (str(dataset), 1, 3)

    # the name belongs to that model now: another model under it is refused, before any run
    other = build_tiny_model(tmp_path / "other")
    assert main([*command[:4], "--model", str(other), "--name", "tiny", "--attempts", "1"]) == 2
    assert "--name tiny: already registered for the model" in capsys.readouterr().err
    assert main(["eval", str(dataset), "--sources", str(dataset / "repos"), "--model", str(tmp_path)]) == 2
    assert "not a Hugging Face model folder (no config.json)" in capsys.readouterr().err
