"""The hidden inputs' answers are computed once per task and sandbox factory in a process, keyed by
what decides them: the task stream validates a task in a folder it then renames, and gradings of
one task that start together (a group's episodes) used to start a sandbox each for them.

Real bubblewrap sandboxes; the factory (tests/evals/conftest.py) only counts the sandboxes it starts."""

from __future__ import annotations

import shutil
import threading

import pytest

from evals import call_checks
from evals.bundled import build_task, stream_task
from evals.grading import grade_patch
from tests.evals.conftest import CountingFactory


@pytest.fixture(autouse=True)
def _bwrap():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")


def test_a_validated_task_is_not_answered_again_in_its_final_folder(tmp_path):
    factory = CountingFactory()
    task = build_task(stream_task(7, 1, 0), tmp_path / "tasks", factory)  # validated aside, then renamed
    assert factory.starts == 2  # the base run with the hidden answers, the reference solution's grading
    result = grade_patch(task, "", factory)
    assert result.scores is not None and result.scores.reward == 0.0
    assert factory.starts == 3  # the grading's own sandbox only

    other = CountingFactory()  # another factory answers them in a sandbox of its own
    again = grade_patch(task, "", other)
    assert other.starts == 2 and again.statuses == result.statuses


def test_gradings_that_start_together_answer_once(tmp_path):
    build = CountingFactory()
    task = build_task(stream_task(7, 3, 0), tmp_path / "tasks", build)
    factory = CountingFactory()
    barrier = threading.Barrier(3)
    rewards = []

    def grade():
        barrier.wait()
        rewards.append(grade_patch(task, "", factory).scores.reward)

    threads = [threading.Thread(target=grade) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rewards == [0.0, 0.0, 0.0]
    assert factory.starts == 3 + 1  # three gradings, one sandbox for the hidden answers


def test_answers_are_keyed_by_what_decides_them(tmp_path):
    factory = CountingFactory()
    task = build_task(stream_task(7, 2, 0), tmp_path / "tasks", factory)
    checks = call_checks.graded_checks(task, factory)
    starts = factory.starts
    assert call_checks.graded_checks(task, factory) == checks and factory.starts == starts

    other_seed = call_checks.graded_checks(task, factory, seed=3)  # other inputs: answered anew
    assert factory.starts == starts + 1 and other_seed != checks

    # a changed base module on the host (the same id and commit) is not taken for the old one
    path = tmp_path / "tasks" / task.id / "repo" / task.metadata["module_file"]
    path.write_text(path.read_text() + "\n")
    call_checks.graded_checks(task, factory)
    assert factory.starts == starts + 2
