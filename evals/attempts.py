"""One evaluated attempt: its statuses, its scores, its row, and the loop that makes the rows.

Every evaluation, whatever the task format, ends in the same place: one :class:`AttemptRow` per
(task, attempt), written to Parquet with :data:`ROW_COLUMNS` (:func:`write_rows`) and aggregated by
:mod:`evals.report`. How an attempt is run and scored depends on the format, behind the small
:class:`Verifier` protocol:

- bundled, SWE-bench and suite tasks: :class:`evals.evaluate.BundledVerifier` runs an episode of the
  built-in harness and grades the committed work in a fresh sandbox (:func:`evals.grading.grade_patch`);
- Harbor tasks (DeepSWE v1.1): :class:`evals.harbor.HarborVerifier` runs an agent, then the task's
  own verifier script on the committed work, and grades the reports it wrote
  (:func:`evals.harbor.verify`).

Both end in :func:`evals.grading.score`, which turns test statuses into :class:`Scores`. A status is
one of :data:`STATUSES`:

- ``graded``: the tests ran; ``scores`` hold;
- ``apply_failed``: the committed patch did not apply; scores are all zero;
- ``agent_fault``: the agent broke what it controls (its repository, its sandbox); scores are zero;
- ``infra_error``: the sandboxes or the engine failed after every retry; no scores, and no aggregate
  counts it (never scored as 0).

:func:`attempt_row` makes every row, whatever the format: the task, what the agent did
(:class:`AgentRun`) and how its work was graded. :func:`run_attempts` runs every attempt of every
task through one verifier, on a pool of workers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from evals.signals import join_signals
from evals.tasks import IncompleteTask, Task

GRADED, APPLY_FAILED, INFRA_ERROR, AGENT_FAULT = "graded", "apply_failed", "infra_error", "agent_fault"
STATUSES = (GRADED, APPLY_FAILED, AGENT_FAULT, INFRA_ERROR)


@dataclass(frozen=True)
class Scores:
    """One attempt's scores, named as in DeepSWE v1.1's ``reward.json``.

    ``reward.json`` gives the share of target tests passed under two names, ``f2p`` and
    ``target_score``; here it is one value, ``f2p``, and ``target_score`` is derived from it (never
    passed in), so that both names stay in every row and JSON output.
    """

    reward: float
    f2p: float
    p2p: float
    partial: float
    target_score: float = field(init=False)
    strict_target_score: float
    f2p_total: int
    f2p_passed: int
    p2p_total: int
    p2p_passed: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_score", self.f2p)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


SCORE_FIELDS = tuple(Scores.__dataclass_fields__)
# What an attempt did, for the trajectory viewer: only the built-in harness records it (a Harbor
# attempt leaves these columns empty).
VIEWER_FIELDS = ("diff", "test_outcomes", "test_output", "transcript")
ROW_COLUMNS = ("checkpoint", "adapter_version", "task_id", "source", "difficulty", "split", "attempt", "status",
               *SCORE_FIELDS, "committed", "stop_reason", "turns", "output_tokens", "agent_s", "grade_s",
               "infra_retries", "detail", "session_id", "signals", *VIEWER_FIELDS)
MAX_DETAIL_CHARS = 500


@dataclass(frozen=True)
class AttemptRow:
    """One attempt of one task at one checkpoint, as stored in the eval's Parquet file.

    ``scores`` is None for an ``infra_error`` (and flattened into the score columns of the row);
    ``signals`` are the cheating signals of its grading (:mod:`evals.signals`), sorted names joined
    by commas ('' for none). ``diff``, ``test_outcomes`` and ``transcript`` (JSON text) and
    ``test_output`` are what the trajectory viewer shows; None where the verifier records none."""

    checkpoint: str
    adapter_version: str | None
    task_id: str
    source: str
    difficulty: int
    split: str
    attempt: int
    status: str
    scores: Scores | None
    committed: bool = False
    stop_reason: str = ""
    turns: int = 0
    output_tokens: int = 0
    agent_s: float = 0.0
    grade_s: float = 0.0
    infra_retries: int = 0
    detail: str = ""
    session_id: str | None = ""
    signals: str = ""
    diff: str | None = None
    test_outcomes: str | None = None
    test_output: str | None = None
    transcript: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"attempt status {self.status!r} is not one of {', '.join(STATUSES)}")
        object.__setattr__(self, "detail", self.detail[:MAX_DETAIL_CHARS])

    @property
    def reward(self) -> float | None:
        return self.scores.reward if self.scores is not None else None

    def to_row(self) -> dict[str, Any]:
        """The Parquet row (:data:`ROW_COLUMNS`, the scores last); the viewer's columns are left out where None."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scores"}
        for name in VIEWER_FIELDS:
            if row[name] is None:
                del row[name]
        for name in SCORE_FIELDS:
            row[name] = getattr(self.scores, name) if self.scores is not None else None
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "AttemptRow":
        """The attempt of a Parquet row (a dict, or a pandas row); missing viewer columns are None."""

        def value(name: str) -> Any:
            v = row.get(name)
            return None if v is None or (isinstance(v, float) and v != v) else v

        scores = None
        if value("reward") is not None:
            scores = Scores(**{name: value(name) for name in SCORE_FIELDS if name != "target_score"})
        kept = {f.name: value(f.name) for f in fields(cls) if f.name not in ("scores",) and value(f.name) is not None}
        return cls(**{**kept, "scores": scores})


class Verifier(Protocol):
    """Runs and scores attempts of one task format: ``attempt(task, task_index, attempt)`` runs attempt
    number ``attempt`` of ``task`` (the ``task_index``-th task of the eval, which seeds its
    sampling) with its retries, and returns its row; it never raises for a sandbox or engine
    failure (that is an ``infra_error`` row)."""

    def attempt(self, task: Task, task_index: int, attempt: int) -> AttemptRow: ...


def attempt_seed(seed: int, task_index: int, attempt: int, retry: int = 0) -> int:
    """The sampling seed of one try of one attempt: each attempt samples differently, reproducibly."""
    return seed * 1_000_003 + task_index * 1009 + attempt * 17 + retry


@dataclass
class AgentRun:
    """What an agent did in one attempt: its committed patch, and how it went."""

    patch: str
    stop_reason: str = ""
    committed: bool = False
    turns: int = 0
    output_tokens: int = 0
    agent_s: float = 0.0
    error: str = ""
    session_id: str = ""

    @classmethod
    def of_episode(cls, traj: Any, patch: str | None = None, error: str = "") -> "AgentRun":
        """The run of an episode (an :class:`evals.harness.Trajectory`); ``patch`` when its committed
        work was read elsewhere (else the episode's own), ``error`` when the episode has none."""
        return cls(traj.patch if patch is None else patch, traj.stop_reason, traj.committed, len(traj.calls),
                   sum(len(c.output_ids) for c in traj.calls), traj.agent_s, traj.error or error, traj.session_id)


def attempt_row(task: Task | IncompleteTask, attempt: int, run: AgentRun | None, *, checkpoint: str,
                adapter_version: str | None, status: str, scores: Scores | None, detail: str = "",
                grade_s: float = 0.0, signals: Iterable[str] = (), infra_retries: int = 0,
                **viewer: str | None) -> AttemptRow:
    """The :class:`AttemptRow` of attempt ``attempt`` of ``task``, whatever its format: what the agent
    did (``run``; None when it never ran, as for a task that could not be built or an agent lost to
    the infrastructure: stop reason ``infra_error``) and how its work was graded (``status``,
    ``scores``, ``detail``, ``grade_s``, the cheating ``signals``). ``viewer``: what the trajectory
    viewer shows (:data:`VIEWER_FIELDS`), where the verifier records it."""
    return AttemptRow(
        checkpoint=checkpoint, adapter_version=adapter_version, task_id=task.id, source=task.source,
        difficulty=getattr(task, "difficulty", 0), split=getattr(task, "split", ""), attempt=attempt,
        status=status, scores=scores, committed=bool(run and run.committed),
        stop_reason=run.stop_reason if run else INFRA_ERROR, turns=run.turns if run else 0,
        output_tokens=run.output_tokens if run else 0, agent_s=run.agent_s if run else 0.0, grade_s=grade_s,
        infra_retries=infra_retries, detail=detail, session_id=run.session_id if run else "",
        signals=join_signals(signals), **viewer,
    )


def run_attempts(tasks: Sequence[Task], verifier: Verifier, *, attempts: int, workers: int) -> list[AttemptRow]:
    """``attempts`` attempts of every task through ``verifier``, ``workers`` at a time; one row per
    attempt, in task order, then attempt order. Both have no default here: they are the ``[eval]``
    section's (``evals.settings.EvalSection``), where their defaults are written, handed on by the
    evaluation of each task format."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")

    def one(job: tuple[int, int]) -> AttemptRow:
        task_index, attempt = job
        return verifier.attempt(tasks[task_index], task_index, attempt)

    jobs = [(ti, a) for ti in range(len(tasks)) for a in range(attempts)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, jobs))


def write_rows(rows: Sequence[AttemptRow | Mapping[str, Any]], path: str | Path) -> Path:
    """Write attempt rows (:class:`AttemptRow` or their :meth:`~AttemptRow.to_row` dicts) to Parquet
    atomically; an empty list writes the schema with no rows."""
    import pandas as pd  # heavy, and only writing needs it: the grader and the harness import this module

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [r.to_row() if isinstance(r, AttemptRow) else dict(r) for r in rows]
    frame = pd.DataFrame(records, columns=list(ROW_COLUMNS))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)
    return path
