"""One attempt row for every task format: its statuses, its Parquet round trip, and the eval loop."""

import pandas as pd
import pytest

from evals.attempts import (
    GRADED, INFRA_ERROR, ROW_COLUMNS, SCORE_FIELDS, STATUSES, AttemptRow, Scores, run_attempts, write_rows,
)
from evals.tasks import Task

SCORES = Scores(reward=1.0, f2p=1.0, p2p=1.0, partial=1.0, strict_target_score=1.0, f2p_total=2, f2p_passed=2,
                p2p_total=3, p2p_passed=3)


def _row(status=GRADED, scores=SCORES, **kw):
    return AttemptRow(checkpoint="r-step_000001", adapter_version="step_000001", task_id="t", source="bundled",
                      difficulty=1, split="eval", attempt=0, status=status, scores=scores, **kw)


def test_a_row_has_the_columns_in_order_and_comes_back_from_parquet(tmp_path):
    graded = _row(diff="d", test_outcomes="[]", test_output="", transcript="[]", detail="x" * 900)
    lost = _row(INFRA_ERROR, None, detail="the sandbox died")
    assert list(graded.to_row()) == [c for c in ROW_COLUMNS if c not in SCORE_FIELDS] + list(SCORE_FIELDS)
    assert len(graded.detail) == 500 and graded.to_row()["target_score"] == 1.0
    assert "diff" not in lost.to_row() and lost.to_row()["reward"] is None  # no transcript; never scored
    frame = pd.read_parquet(write_rows([graded, lost], tmp_path / "rows.parquet"))
    assert list(frame.columns) == list(ROW_COLUMNS)
    back = [AttemptRow.from_row(r) for r in frame.to_dict("records")]
    assert back[0] == graded and back[1] == lost


def test_a_status_outside_the_four_is_refused():
    assert STATUSES == ("graded", "apply_failed", "agent_fault", "infra_error")
    with pytest.raises(ValueError, match="not one of graded, apply_failed, agent_fault, infra_error"):
        _row("passed")


def test_run_attempts_runs_every_attempt_of_every_task_through_the_verifier_in_order():
    class Count:
        def attempt(self, task, task_index, attempt):
            return AttemptRow("c", None, task.id, task.source, 0, "", attempt, GRADED, SCORES, turns=task_index)

    tasks = [Task(f"t{i}", "bundled", "python", "", (), (), "", "junit", (), image="i") for i in range(3)]
    rows = run_attempts(tasks, Count(), attempts=2, workers=3)
    assert [(r.task_id, r.attempt, r.turns) for r in rows] == [(f"t{i}", a, i) for i in range(3) for a in range(2)]
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        run_attempts(tasks, Count(), attempts=0, workers=1)
