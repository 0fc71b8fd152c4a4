"""How many sandboxes a new task of the task stream costs before its first grading is done: its
validation answers the hidden inputs in the sandbox of its base run (not one of their own), and the
trainer's gradings use the same factory as the stream's validation (``platform_sandbox_factory`` of
a local runtime is one per process), so they do not answer them again.

Real bubblewrap sandboxes; ``sandboxes.start`` is wrapped only to count the sandboxes started."""

from __future__ import annotations

import threading

import pytest

import sandboxes
from evals.bundled import build_task, stream_task
from evals.grading import grade_patch
from evals.sandbox import platform_sandbox_factory
from tests.sandboxes.conftest import installed

pytestmark = pytest.mark.skipif(not installed("bwrap"), reason="bubblewrap is not installed")


@pytest.fixture
def starts(monkeypatch, no_kept_answers):
    """The tasks (by id) each started sandbox was for, counted at ``sandboxes.start``."""
    real = sandboxes.start
    started = []
    lock = threading.Lock()

    def counting(source, **kwargs):
        with lock:
            started.append(str(source))
        return real(source, **kwargs)

    monkeypatch.setattr(sandboxes, "start", counting)
    return started


def test_the_trainer_and_the_task_stream_share_one_factory_per_runtime():
    assert platform_sandbox_factory("bwrap") is platform_sandbox_factory("bwrap")
    assert platform_sandbox_factory("gvisor") is platform_sandbox_factory("gvisor")
    assert platform_sandbox_factory("bwrap") is not platform_sandbox_factory("gvisor")
    # a factory with its own settings is its own
    assert platform_sandbox_factory("bwrap", allow_unisolated=False) is not platform_sandbox_factory("bwrap")


def test_a_new_stream_task_costs_two_sandboxes_then_one_per_grading(tmp_path, starts):
    """The stream validates a new task with ``platform_sandbox_factory(runtime)`` (TaskStream's
    default), the trainer grades with its own call of it (training.episodes): the base run with
    the hidden answers, the reference's grading, then the trainer's grading of a patch alone."""
    task = build_task(stream_task(11, 2, 0), tmp_path / "tasks", platform_sandbox_factory("bwrap"))
    assert len(starts) == 2, starts  # 0ddbdf4: 3 (the hidden answers in a sandbox of their own)
    result = grade_patch(task, "", platform_sandbox_factory("bwrap"))
    assert result.scores is not None and result.scores.reward == 0.0
    assert len(starts) == 3, starts  # 0ddbdf4: 5 (the trainer's factory answered them again)


def test_answers_from_the_validation_sandbox_are_the_ones_a_fresh_sandbox_gives(tmp_path):
    """The answers kept from the validation's sandbox equal those a sandbox of their own computes
    (another factory), so grading decides the same."""
    from evals import call_checks

    shared = platform_sandbox_factory("bwrap")
    task = build_task(stream_task(11, 3, 1), tmp_path / "tasks", shared)
    own = platform_sandbox_factory("bwrap", toolchains=())  # not the shared one: answers in a sandbox of its own
    assert call_checks.graded_checks(task, shared) == call_checks.graded_checks(task, own)
    assert any(c.hidden for c in call_checks.graded_checks(task, shared))
