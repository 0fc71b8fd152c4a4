"""An episode that only edits its task's file and commits runs no code of the agent's: its edits are
kept on the host and its commit's patch made there by the same ``git diff`` (:class:`evals.harness.HostEdits`,
:func:`evals.grading.edited_patch`), so it opens no sandbox of its own; its grading still runs in a
fresh one. The first action that needs a sandbox (a ``test``) opens it with the edits written there.

Real bwrap sandboxes, the real harness and grader; the policy is scripted (the reference fix)."""

from __future__ import annotations

import contextlib
import threading

from evals.actions import Action, reference_actions
from evals.bundled import default_sandbox_factory
from evals.grading import committed_patch
from evals.harness import execute, run_episode

from tests.evals.test_harness import ScriptedPolicy


class Counting:
    """A bwrap sandbox factory that counts the sandboxes it starts."""

    def __init__(self) -> None:
        self.starts = 0
        self.lock = threading.Lock()

    def __call__(self, task):
        @contextlib.contextmanager
        def opened():
            with self.lock:
                self.starts += 1
            with default_sandbox_factory()(task) as box:
                yield box
        return opened()


def sandbox_patch(task, actions) -> str:
    """The patch of ``actions`` (edits, then commit) done in a sandbox, read as the grader reads it."""
    with default_sandbox_factory()(task) as box:
        for action in actions:
            execute(action, task, box, written={})
        return committed_patch(box, task.base_commit)


def test_an_episode_that_edits_and_commits_opens_no_sandbox_and_is_graded_on_the_same_patch(small_tasks, tokenizer):
    task = small_tasks[-1]  # level 3: two edits
    actions = reference_actions(task)
    answer = "\n".join(a.to_compact() for a in actions)
    episodes, grader = Counting(), Counting()
    traj = run_episode(task, ScriptedPolicy(tokenizer, [answer]), tokenizer, episodes, max_turns=2,
                       grader_factory=grader)
    assert [s.observation for s in traj.steps] == ["ok", "ok", "committed"]
    assert traj.reward == 1.0 and traj.stop_reason == "commit"
    assert traj.patch == sandbox_patch(task, actions)  # the text a commit in a sandbox gives
    assert episodes.starts == 0 and grader.starts >= 1


def test_edits_that_change_nothing_commit_nothing(small_tasks, tokenizer):
    task = small_tasks[0]
    module = task.metadata["module_file"]
    first = task.metadata["source_text"].splitlines()[0]
    answer = f"replace {module}:1 {first}\ncommit"
    episodes = Counting()
    traj = run_episode(task, ScriptedPolicy(tokenizer, [answer]), tokenizer, episodes, max_turns=1,
                       grader_factory=default_sandbox_factory())
    assert [s.observation for s in traj.steps] == ["ok", "nothing to commit"]
    assert traj.patch == sandbox_patch(task, [Action("replace_line", {"path": module, "line": 1, "text": first}),
                                              Action("commit")]) == ""
    assert episodes.starts == 0 and traj.reward == 0.0


def test_the_first_test_opens_the_sandbox_with_the_edits_kept_so_far(small_tasks, tokenizer):
    task = small_tasks[0]
    fix = "\n".join(a.to_compact() for a in reference_actions(task)[:-1])
    episodes = Counting()
    traj = run_episode(task, ScriptedPolicy(tokenizer, [f"{fix}\ntest", "commit"]), tokenizer, episodes,
                       max_turns=2, grader_factory=default_sandbox_factory())
    assert traj.steps[-2].observation == "all tests pass" and traj.steps[-1].observation == "committed"
    assert episodes.starts == 1 and traj.reward == 1.0
    assert traj.patch == sandbox_patch(task, reference_actions(task))
