"""Evaluations in one process share their gradings (issue 55): the demo evaluates the base model and
then the final checkpoint in one process, and before this each evaluation graded again, in a fresh
sandbox, every patch the other had graded (a task both solve with the same fix; an attempt that
never commits). The grade of a bundled task is a function of the task and the patch, so the second
evaluation takes it; a task of the same id with other content (another suite's) does not.

Real bubblewrap sandboxes; the factory (tests/evals/conftest.py) only counts the sandboxes it starts."""

from __future__ import annotations

import dataclasses

import pytest

from evals.actions import demonstration
from evals.evaluate import evaluate
from tests.evals.conftest import CountingFactory
from tests.sandboxes.conftest import installed

pytestmark = pytest.mark.skipif(not installed("bwrap"), reason="bubblewrap is not installed")


class Answers:
    """Answers every call of a task with its text in ``by_task`` (SGLang's response shape)."""

    def __init__(self, tokenizer, by_task: dict[str, str]):
        self.tokenizer, self.by_task = tokenizer, by_task

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        text = self.by_task[rid.split("/")[1]]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in ids]}}


def test_a_second_evaluation_takes_the_first_ones_gradings(small_tasks, tokenizer):
    tasks = small_tasks[:2]
    # the first task solved, the second never acted on (its empty patch graded)
    policy = Answers(tokenizer, {tasks[0].id: demonstration(tasks[0])[1], tasks[1].id: "no idea"})
    factory = CountingFactory()
    first = evaluate(tasks, policy, tokenizer, factory, checkpoint="a-step_000000", attempts=2, max_turns=1,
                     workers=1)
    opened_first = factory.starts
    # per task: its hidden answers; the solved one's grading (its episodes only edit and commit: no
    # sandbox of their own, evals.harness.HostEdits), the other's one grading
    assert opened_first == 2 + 1 + 1
    second = evaluate(tasks, policy, tokenizer, factory, checkpoint="b-step_000004", attempts=2, max_turns=1,
                      workers=1)
    assert factory.starts - opened_first == 0  # no grading, and the episodes need no sandbox
    assert [r["reward"] for r in first] == [r["reward"] for r in second] == [1.0, 1.0, 0.0, 0.0]
    assert [r["status"] for r in second] == ["graded"] * 4


def test_a_task_of_the_same_id_with_other_content_has_other_grades(small_tasks):
    from evals.harness import grade_key  # new in issue 55

    task = small_tasks[0]
    moved = dataclasses.replace(task, base_commit="0" * 40)
    other_tests = dataclasses.replace(task, metadata={**task.metadata, "reference_edits": []})
    keys = {grade_key(t, "diff --git a/x b/x\n") for t in (task, moved, other_tests)}
    assert len(keys) == 3
    assert grade_key(task, "") == grade_key(dataclasses.replace(task), "")
