"""Agent scaffolds: the agent loop of an episode, picked by name.

``builtin`` is :func:`evals.harness.run_episode` (posttrain's own loop: token ids in and out through
the engine API, the embedded model's default); ``mini-swe-agent`` is mini-swe-agent's own loop over
the OpenAI chat API (:mod:`evals.scaffolds.mini_swe_agent`). Both return the same
:class:`evals.harness.Trajectory`, graded by :func:`evals.harness.grade_committed`, so rows and
rewards are alike whichever ran::

    traj = run_scaffold_episode("mini-swe-agent", task, model_url=router_url, sandbox_factory=factory,
                                adapter_version="step_000012", session_id="run-a/g7/3")

``model_url`` is the router (or one replica): the built-in loop calls its ``/generate``, a chat
scaffold its ``/v1/chat/completions``. The trainer config key ``scaffold`` and
``posttrain eval --scaffold`` pick the scaffold. Third-party scaffolds are imported only when used.
"""

from __future__ import annotations

import uuid
from typing import Any

from evals.harness import BUILTIN_SCAFFOLD, SCAFFOLD_NAMES, HttpClient, Trajectory, check_scaffold, run_episode
from evals.sandbox import SandboxFactory
from evals.tasks import Task

SCAFFOLDS = SCAFFOLD_NAMES
DEFAULT_SCAFFOLD = BUILTIN_SCAFFOLD


def run_scaffold_episode(scaffold: str, task: Task, *, model_url: str, sandbox_factory: SandboxFactory,
                         tokenizer: Any = None, adapter_version: str | None = None, session_id: str | None = None,
                         max_turns: int = 8, max_new_tokens: int = 256, temperature: float = 1.0,
                         time_limit_s: float | None = None, grade: bool = True,
                         grader_factory: SandboxFactory | None = None, grade_cache: dict | None = None,
                         **builtin_kwargs: Any) -> Trajectory:
    """One graded episode of ``task`` with the named scaffold (``builtin_kwargs`` go to
    :func:`evals.harness.run_episode` only: ``action_format``, ``seed``, ``stop_token_ids``)."""
    check_scaffold(scaffold)
    if scaffold == BUILTIN_SCAFFOLD and tokenizer is None:
        raise ValueError("scaffold 'builtin' needs the model's tokenizer (it sends token ids)")
    session_id = session_id or f"{task.id}/{uuid.uuid4().hex[:12]}"
    if scaffold == BUILTIN_SCAFFOLD:
        return run_episode(task, HttpClient(model_url), tokenizer, sandbox_factory, adapter_version=adapter_version,
                           session_id=session_id, max_turns=max_turns, max_new_tokens=max_new_tokens,
                           temperature=temperature, time_limit_s=time_limit_s, grade=grade,
                           grader_factory=grader_factory, grade_cache=grade_cache, **builtin_kwargs)
    if builtin_kwargs:
        raise ValueError(f"scaffold {scaffold!r} takes no {', '.join(sorted(builtin_kwargs))}")
    # heavy: mini-swe-agent and its dependencies (about 3,000 modules); only its scaffold needs them
    from evals.scaffolds.mini_swe_agent import run_mini_swe_agent

    return run_mini_swe_agent(task, chat_url=model_url, sandbox_factory=sandbox_factory, adapter_version=adapter_version,
                              session_id=session_id, max_turns=max_turns, max_new_tokens=max_new_tokens,
                              temperature=temperature, time_limit_s=time_limit_s, grade=grade,
                              grader_factory=grader_factory, grade_cache=grade_cache)
