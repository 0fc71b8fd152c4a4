"""One path from a checkpoint to its rows, whatever the task format: the checkpoint served once
(:func:`evals.evaluate.evaluate_checkpoint`, a real replica process of the local engine on a tiny
model) for the format's evaluation, and every row made by one builder
(:func:`evals.attempts.attempt_row`)."""

from __future__ import annotations

import pytest

from evals.attempts import GRADED, INFRA_ERROR, ROW_COLUMNS, VIEWER_FIELDS, AgentRun, attempt_row
from evals.evaluate import episode_attempt, evaluate_checkpoint
from evals.grading import GradeResult, zero_scores
from evals.harness import HttpClient, ModelCall, Trajectory
from evals.tasks import Task

TASK = Task("t1", "bundled", "python", "fix it", ("tests/test_a.py::test_a",), ("tests/test_b.py::test_b",), "",
            "junit", (), image="i", difficulty=2, split="eval")


def _episode() -> Trajectory:
    traj = Trajectory(TASK.id, "c/t1/0/0", "step_000001", "compact", stop_reason="commit", committed=True,
                      patch="diff --git a/x b/x\n", agent_s=1.5, grade_s=0.5)
    traj.calls = [ModelCall([1, 2], [3, 4, 5], [0.0] * 3, "a", {}, 0.1), ModelCall([1], [6], [0.0], "b", {}, 0.1)]
    traj.grade = GradeResult(GRADED, zero_scores(TASK.target_tests, TASK.existing_tests), detail="ran",
                             signals=("touches_tests",))
    return traj


def test_an_episode_and_an_agent_that_never_ran_make_their_rows_with_the_one_builder():
    traj = _episode()
    run = AgentRun.of_episode(traj)
    assert (run.patch, run.turns, run.output_tokens, run.committed, run.session_id) == (traj.patch, 2, 4, True, "c/t1/0/0")
    assert AgentRun.of_episode(traj, "", "the sandbox closed").patch == ""
    assert AgentRun.of_episode(traj, error="the sandbox closed").error == "the sandbox closed"  # the episode had none

    row = episode_attempt(TASK, 3, traj, "c-step_000001", 1).to_row()
    assert set(row) == set(ROW_COLUMNS)
    assert (row["task_id"], row["difficulty"], row["split"], row["attempt"], row["status"]) == ("t1", 2, "eval", 3, GRADED)
    assert (row["turns"], row["output_tokens"], row["agent_s"], row["grade_s"]) == (2, 4, 1.5, 0.5)
    assert (row["signals"], row["infra_retries"], row["detail"], row["reward"]) == ("touches_tests", 1, "ran", 0.0)
    assert row["diff"] == traj.patch and '"kind": "target"' in row["test_outcomes"]

    lost = attempt_row(TASK, 0, None, checkpoint="c-step_000001", adapter_version=None, status=INFRA_ERROR,
                       scores=None, detail="the task's image was not built").to_row()
    assert (lost["stop_reason"], lost["committed"], lost["turns"], lost["reward"]) == (INFRA_ERROR, False, 0, None)
    assert set(lost) == set(ROW_COLUMNS) - set(VIEWER_FIELDS)  # nothing for the viewer: the agent never ran


def test_a_checkpoint_is_served_once_for_whichever_evaluation_runs_its_attempts(tmp_path, monkeypatch):
    """The serving path the bundled and the Harbor evaluations share: the replica answers while the
    format's evaluation runs, which gets a client of it, the tokenizer, the end-of-sequence ids, the
    model's context and the settings; its rows are the call's."""
    from serving.tiny import build_tiny_model

    monkeypatch.setenv("POSTTRAIN_ENGINE", "local")
    model = build_tiny_model(tmp_path / "model")
    seen: dict = {}

    def evaluate_served(tasks, *, model, tokenizer, sandbox_factory, checkpoint, adapter_version, attempts,
                        stop_token_ids, **settings):
        assert isinstance(model, HttpClient) and model.health()  # the replica serves for the length of the call
        seen.update(tasks=tasks, factory=sandbox_factory, checkpoint=checkpoint, version=adapter_version,
                    attempts=attempts, stop=stop_token_ids, settings=settings, tokens=tokenizer.encode("hi"))
        return [{"task_id": t.id} for t in tasks]

    lines: list[str] = []
    rows = evaluate_checkpoint([TASK], model, "factory", checkpoint="c-step_000000", attempts=3, log=lines.append,
                               engine_log=tmp_path / "engine.log", evaluate_served=evaluate_served,
                               max_turns=2, workers=1)
    assert rows == [{"task_id": "t1"}]
    assert seen["tasks"] == [TASK] and seen["factory"] == "factory" and seen["checkpoint"] == "c-step_000000"
    assert seen["version"] is None and seen["attempts"] == 3 and seen["stop"] and seen["tokens"]
    assert seen["settings"]["max_turns"] == 2 and seen["settings"]["workers"] == 1
    assert seen["settings"]["max_context_tokens"] > 0  # the model's own context bounds each episode
    assert lines == [f"evaluating c-step_000000 (adapter none) on 1 tasks x 3 attempts, served on {lines[0].split()[-1]}"]
    assert lines[0].split()[-1].startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="an adapter needs an adapter_version"):
        evaluate_checkpoint([TASK], model, "factory", checkpoint="c-step_000001", adapter=tmp_path,
                            evaluate_served=evaluate_served)
