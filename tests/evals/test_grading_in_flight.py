"""A group's episodes run at once on one task, and several commit the same patch, or run ``test`` on
the same edited tree, at about the same moment: with a shared ``grade_cache`` that tree's tests and
that patch's grading run once, and the episodes that asked meanwhile wait for that result
(:func:`evals.harness.cached_once`) instead of each starting a sandbox of its own to compute it too.

Real sandboxes and the real harness; the policy is scripted (the reference fix). To make the two
episodes ask at the same moment whatever the machine's load, the first test run and the first
grading are held until the other episode has asked too: it either starts the same work (what the
code before this change did) or waits for the first's result."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from evals import harness
from evals.actions import reference_actions
from evals.bundled import default_sandbox_factory
from evals.harness import run_episode

from tests.evals.test_harness import ScriptedPolicy

HOLD_LIMIT_S = 60.0  # only a bound on the hold: the counts decide, whichever way the hold ends


def waiting_in_cached_once(thread: threading.Thread) -> bool:
    """True when ``thread`` is blocked waiting for another's result inside ``cached_once``
    (:func:`evals.harness.cached_once`)."""
    frame = sys._current_frames().get(thread.ident)
    top = frame.f_code.co_name if frame is not None else ""
    while frame is not None:
        if frame.f_code.co_name == "cached_once":
            return top == "wait"
        frame = frame.f_back
    return False


class Held:
    """Counts calls of one kind of work; the first is held until a second starts or the other
    episode thread waits for the first's result."""

    def __init__(self) -> None:
        self.calls = 0
        self.second = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def enter(self) -> None:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if not first:
            self.second.set()
            return
        others = [t for t in self.threads if t is not threading.current_thread()]
        deadline = time.monotonic() + HOLD_LIMIT_S
        while time.monotonic() < deadline and not self.second.is_set():
            if others and all(waiting_in_cached_once(t) for t in others):
                return
            self.second.wait(0.01)


def test_episodes_of_a_group_run_the_same_trees_tests_and_grade_the_same_patch_once(small_tasks, tokenizer,
                                                                                 monkeypatch, no_kept_answers):
    task = small_tasks[0]
    fix = "\n".join(a.to_compact() for a in reference_actions(task)[:-1])
    tests, gradings = Held(), Held()

    def factory(t):
        @contextlib.contextmanager
        def opened():
            with default_sandbox_factory()(t) as box:
                real_exec = box.exec

                def exec_(command, **kw):
                    if command == t.test_command:
                        tests.enter()
                    return real_exec(command, **kw)

                box.exec = exec_
                yield box
        return opened()

    real_grade = harness.grade_patch

    def grade(*args, **kwargs):
        gradings.enter()
        return real_grade(*args, **kwargs)

    monkeypatch.setattr(harness, "grade_patch", grade)
    cache: dict = {}
    answers = [f"{fix}\ntest", "commit"]
    trajectories = [None, None]

    def episode(i: int) -> None:
        trajectories[i] = run_episode(task, ScriptedPolicy(tokenizer, answers), tokenizer, factory,
                                      session_id=f"g/{i}", max_turns=3, grade_cache=cache)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(2)]
    tests.threads = gradings.threads = threads
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = trajectories
    assert first.steps[-2].observation == second.steps[-2].observation == "all tests pass"
    assert first.reward == second.reward == 1.0 and first.patch == second.patch
    assert (tests.calls, gradings.calls) == (1, 1)


def test_a_computation_that_fails_leaves_the_key_to_the_next_caller():
    """An infrastructure error is not kept (``keep``) and an exception is not cached: a caller that
    waited computes the value itself."""
    import pytest

    from evals.harness import cached_once

    cache: dict = {}
    assert cached_once(cache, "k", lambda: "infra", keep=lambda v: v != "infra") == "infra"
    assert "k" not in cache

    def boom():
        raise OSError("sandbox gone")

    with pytest.raises(OSError):
        cached_once(cache, "k", boom)
    assert cached_once(cache, "k", lambda: "graded") == "graded" and cache == {"k": "graded"}
    assert cached_once(cache, "k", lambda: "other") == "graded"  # computed once
