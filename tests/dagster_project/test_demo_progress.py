"""``posttrain demo`` prints a progress line per RL step, read from the ``rl_run`` observations in the
instance; on a terminal the line is a bar redrawn in place."""

import io
import time

import dagster as dg
import pytest

from dagster_project.demo import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def observe(instance, step: int) -> None:
    instance.report_runless_asset_event(dg.AssetObservation("rl_run", metadata={
        "step": step, "of_steps": 4, "loss": 0.25 * step, "reward_mean": 0.5, "solve_rate": 0.375,
        "policy_age_mean": 0.5, "policy_age_max": 1, "tokens_per_s": 1234.4, "phase_generation_s": 30.2,
        "phase_sandbox_s": 12.0, "phase_grading_s": 6.4, "wait_s": 4.0, "train_s": 2.0, "eta_s": 180.0}))


def test_one_line_per_step_and_only_steps_of_this_demo():
    with dg.instance_for_test() as instance:
        observe(instance, 9)  # an earlier run's step: not this demo's
        out = io.StringIO()
        progress = StepProgress(instance, 4, time.monotonic(), out=out, poll_s=0.05)
        for step in (1, 2):
            observe(instance, step)
        progress.poll()
        observe(instance, 3)
        progress.poll()
        lines = out.getvalue().splitlines()
        assert [line.split("]", 1)[1].split("  ")[0] for line in lines] == [
            " rl_run step 1/4", " rl_run step 2/4", " rl_run step 3/4"]
        assert "loss +0.2500  reward 0.500  solve 0.375  age 0.50/1  tok/s 1234" in lines[0]
        assert "time gen 30s sandbox 12s grade 6s wait 4s train 2s  ETA 180s" in lines[0]


def test_a_bar_on_a_terminal():
    with dg.instance_for_test() as instance:
        out = Terminal()
        progress = StepProgress(instance, 4, time.monotonic(), out=out, poll_s=0.05)
        progress.start()
        observe(instance, 2)
        progress.stop()
        text = out.getvalue()
        assert text.startswith("\r[demo") and "rl_run [############............] 2/4" in text
        assert text.endswith("\n")


def test_the_result_is_the_final_change_with_its_interval_level_3_and_the_stream(tmp_path):
    """The demo's last lines: the final checkpoint's paired change (above zero here: 20 of 60 tasks
    go from failed to solved, none back), level 3's change, and the run's task stream summary."""
    import json

    import pandas as pd

    from dagster_project.demo import result_lines

    rows = pd.DataFrame([
        {"checkpoint": ckpt, "task_id": f"t{i:02d}", "status": "graded", "difficulty": 1 + i % 3,
         "reward": float(ckpt.endswith("44") and i < 20 or i >= 40)}
        for ckpt in ("demo-step_000000", "demo-step_000044") for i in range(60) for _ in range(2)])
    (tmp_path / "task_stream").mkdir()
    (tmp_path / "task_stream" / "state.json").write_text(json.dumps({
        "drawn": 200, "drawn_by_level": {"1": 90, "2": 70, "3": 40}, "solved": 120, "retried": 15, "rejected": 0,
        "validation_s_per_task": 0.4, "passed_over": 31}))
    lines = result_lines(rows, "demo-step_000044", tmp_path)
    assert lines[0].startswith("result: demo-step_000044 held-out pass@1 33.3% -> 66.7%, change +33.3 points, 95% CI [+")
    assert "(above zero; paired over 60 tasks)" in lines[0]
    assert lines[1] == "result: level 3 35.0% -> 65.0% (+30.0 [+10.0, +50.0], 20 tasks)"
    assert lines[2] == ("task stream: 200 new tasks served (L1/L2/L3 90/70/40), 120 solved, 15 retries of unsolved "
                        "ones, 0 rejected by validation, 31 passed over as unlikely to teach, 0.4 s of validation a task")


def test_the_demo_budget_counts_the_set_up_it_is_told_of(monkeypatch) -> None:
    from dagster_project.demo import _before_demo_s

    monkeypatch.delenv("POSTTRAIN_DEMO_STARTED_AT", raising=False)
    assert _before_demo_s() == 0.0
    monkeypatch.setenv("POSTTRAIN_DEMO_STARTED_AT", str(int(time.time()) - 120))
    assert 119 <= _before_demo_s() < 180
    monkeypatch.setenv("POSTTRAIN_DEMO_STARTED_AT", "yesterday")
    with pytest.raises(ValueError, match="POSTTRAIN_DEMO_STARTED_AT='yesterday': expected Unix seconds"):
        _before_demo_s()
