"""``posttrain demo`` end to end, in a reduced configuration: the real asset graph in a real Dagster
instance, a small bundled suite built and validated in sandboxes, the base model built and SFT'd briefly,
its curriculum from one attempt per training task, a 2-step asynchronous GRPO run launched through the
launcher (trainer process, a vLLM engine replica, sandboxed episodes), every saved checkpoint
evaluated on the held-out split, and the report. The full demo is the same with the defaults of
``dagster_project.demo`` (see docs/benchmarks.md for its figures)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest


@pytest.mark.slow
def test_reduced_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    from dagster_project.instance import ensure_dagster_home

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    ensure_dagster_home(str(tmp_path))
    from dagster_project.demo import run_demo

    rl = {"overrides": {"trainer": {"steps": 2, "checkpoint_every": 1},
                        "async": {"group_size": 4, "collection_size": 8, "max_policy_lag": 1}}}
    # a suite of 8 tasks a level before the RL and 4 extra held-out ones: 54 tasks, 18 held out
    assert run_demo("e2e", rl, curriculum_config={"attempts_per_task": 1, "sft_steps": 40},
                    eval_config={"attempts": 2}, dataset_config={"bundled_per_level": 8, "bundled_extra_eval_per_level": 4}) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "e2e"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000", "step_000001", "step_000002"]
    steps = pd.read_parquet(run / "metrics" / "steps.parquet")
    assert steps["step"].tolist() == [1, 2] and (steps["samples"] == 8).all()
    # the run file's trainer keys reach the trainer: the embedded default rewards partial credit
    assert json.loads((run / "trainer-config.json").read_text())["reward"] == "strict_target_score"
    assert (run / "adapters" / "step_000002" / "adapter_model.safetensors").is_file()
    for key in ("e2e-step_000000", "e2e-step_000001", "e2e-step_000002"):  # every checkpoint saved
        rows = pd.concat([pd.read_parquet(p) for p in (tmp_path / "evals" / "deepswe" / key).glob("*.parquet")])
        assert len(rows) == 36 and rows["task_id"].nunique() == 18  # every held-out task, twice
        assert f"{key}: held-out pass@1" in out
    assert (tmp_path / "curriculum" / "curriculum.json").is_file()
    # Every model call was vLLM's: the curriculum's and the trainer's replicas ran it.
    for log in (tmp_path / "curriculum" / "engine.log", run / "logs" / "engine-0.log"):
        text = log.read_text(errors="replace")
        assert "replica (vllm) serving" in text and "(APIServer pid=" in text, log
    assert "pass@1 change over the base model" in out
    import dagster as dg

    with dg.DagsterInstance.get() as instance:  # every checkpoint a partition, in step order
        assert instance.get_dynamic_partitions("checkpoints") == ["e2e-step_000000", "e2e-step_000001", "e2e-step_000002"]
    assert os.environ["POSTTRAIN_HOME"] == str(tmp_path)
