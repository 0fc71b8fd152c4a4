"""What validating a new task costs its sandboxes (issue 55): the base run of the task's tests, one
command that answers the hidden inputs with the base module and with the reference solution, then
the grading of the reference solution's patch, made on the host (:func:`evals.bundled.reference_patch`).

At 18f84c2 a validation ran ten commands: the tests, two probe installs and two probe runs, a
``git commit`` of the reference solution, the grader's ``true`` and ``git diff`` script, then the
grading's two. The answers and the grade must be what they were.

Real bubblewrap sandboxes; ``PlatformSandbox.exec`` is wrapped only to record the commands."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from evals import call_checks
from evals.actions import apply_edits
from evals.bundled import build_task, stream_task
from evals.grading import GRADED, grade_patch
from evals.sandbox import platform_sandbox_factory
from tests.sandboxes.conftest import installed

pytestmark = pytest.mark.skipif(not installed("bwrap"), reason="bubblewrap is not installed")


def test_a_new_task_is_validated_in_four_commands(tmp_path, commands):
    task = build_task(stream_task(11, 2, 0), tmp_path / "tasks", platform_sandbox_factory("bwrap"))
    assert len(commands) == 4, commands
    assert commands[0] == task.test_command  # the base run
    assert commands[1].count("; python3 -I -S /tmp/.posttrain-grader/_posttrain_probe_") == 2  # base, then reference
    assert "git commit" not in "\n".join(commands)


def test_the_reference_patch_made_on_the_host_is_the_reference_solution(tmp_path):
    from evals.bundled import reference_patch  # new in issue 55

    factory = platform_sandbox_factory("bwrap")
    task = build_task(stream_task(11, 3, 1), tmp_path / "tasks", factory)
    module = task.metadata["module_file"]
    patch = reference_patch(task)
    assert patch.startswith(f"diff --git a/{module} b/{module}\n")
    repo = tmp_path / "copy"
    shutil.copytree(task.repo_path, repo)
    (tmp_path / "fix.patch").write_text(patch)
    subprocess.run(["git", "-C", str(repo), "apply", str(tmp_path / "fix.patch")], check=True)
    base = (tmp_path / "tasks" / task.id / "repo" / module).read_text()
    edits = [(int(line), text) for _, line, text in task.metadata["reference_edits"]]
    assert (repo / module).read_text() == apply_edits(base, edits)
    result = grade_patch(task, patch, factory)
    assert result.status == GRADED and result.scores.reward == 1.0, result.detail


def test_answering_in_one_command_leaves_the_module_and_gives_a_fresh_sandboxs_answers(tmp_path, commands):
    factory = platform_sandbox_factory("bwrap")
    task = build_task(stream_task(11, 1, 2), tmp_path / "tasks", factory)
    kept = call_checks.graded_checks(task, factory)
    shared = platform_sandbox_factory("bwrap")

    def other(task):  # a factory of its own, with no answers kept
        return shared(task)

    with other(task) as box:
        base = box.read_file(task.metadata["module_file"])
        commands.clear()
        call_checks.answer_hidden_in(box, task, other)
        assert len(commands) == 1, commands
        assert box.read_file(task.metadata["module_file"]) == base
    assert call_checks.graded_checks(task, other) == kept
