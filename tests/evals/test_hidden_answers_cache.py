"""The hidden inputs' answers are computed once per task, not once per grader: the task stream
validates a task with a sandbox factory of its own in a folder that is renamed afterwards, and the
trainer then grades it with another factory, and every evaluation grades the suite in a process of
its own. Each of those used to answer the hidden inputs again in a sandbox of their own.

Real bubblewrap sandboxes; the factory below only counts the sandboxes it starts."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest

from evals import call_checks
from evals.bundled import build_task, stream_task
from evals.grading import grade_patch
from evals.sandbox import platform_sandbox_factory


class CountingFactory:
    """A bwrap sandbox factory of its own (a new object, as each process and the task stream make)
    that counts the sandboxes it starts."""

    def __init__(self):
        self.base = platform_sandbox_factory("bwrap")
        self.starts = 0

    @contextlib.contextmanager
    def __call__(self, task):
        self.starts += 1
        with self.base(task) as box:
            yield box


@pytest.fixture(autouse=True)
def _bwrap():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")


def test_answers_of_a_validated_task_serve_later_gradings_by_other_factories_and_processes(tmp_path):
    validating = CountingFactory()
    task = build_task(stream_task(7, 1, 0), tmp_path / "tasks", validating)
    assert validating.starts == 3  # the base run, the hidden answers, the reference solution's grading

    training = CountingFactory()  # another factory, the task in its final folder
    result = grade_patch(task, "", training)
    assert result.scores is not None and result.scores.reward == 0.0
    assert training.starts == 1  # the grading's own sandbox only

    call_checks._answers.clear()  # another process: nothing in memory, the task folder's file is read
    evaluating = CountingFactory()
    again = grade_patch(task, "", evaluating)
    assert evaluating.starts == 1
    assert again.statuses == result.statuses and again.test_output == result.test_output


def test_answers_are_keyed_by_what_decides_them(tmp_path):
    factory = CountingFactory()
    task = build_task(stream_task(7, 2, 0), tmp_path / "tasks", factory)
    checks = call_checks.graded_checks(task, factory)
    starts = factory.starts
    assert call_checks.graded_checks(task, factory) == checks and factory.starts == starts

    other_seed = call_checks.graded_checks(task, factory, seed=3)  # other inputs: answered anew
    assert factory.starts == starts + 1 and other_seed != checks

    # a changed base module on the host (the same id and commit) is not taken for the old one
    module = task.metadata["module_file"]
    path = tmp_path / "tasks" / task.id / "repo" / module
    path.write_text(path.read_text() + "\n")
    call_checks.graded_checks(task, factory)
    assert factory.starts == starts + 2


def test_a_cached_answer_file_that_does_not_read_back_is_answered_again(tmp_path):
    factory = CountingFactory()
    task = build_task(stream_task(7, 3, 0), tmp_path / "tasks", factory)
    checks = call_checks.graded_checks(task, factory)
    files = list((tmp_path / "tasks" / task.id / call_checks.ANSWERS_FOLDER).glob("*.json"))
    assert len(files) == 1 and set(json.loads(files[0].read_text())) == {"reference", "unfixed"}
    files[0].write_text('{"reference": {"0": ["int"')  # cut short
    call_checks._answers.clear()
    starts = factory.starts
    assert call_checks.graded_checks(task, factory) == checks
    assert factory.starts == starts + 1
