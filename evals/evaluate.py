"""Evaluate one checkpoint: several attempts per task, one row per attempt.

:func:`evaluate` is the ``deepswe_eval`` asset's evaluation of bundled, SWE-bench and suite tasks, usable
without Dagster: :func:`evals.attempts.run_attempts` with a :class:`BundledVerifier`, which runs an
episode of the built-in harness and grades its committed work (:func:`evals.grading.grade_patch`)::

    rows = evaluate(tasks, model, tokenizer, sandbox_factory, EvalSection(attempts=8),
                    checkpoint="demo-step_000004", adapter_version="step_000004")

Each row holds the task, the attempt index, the grading status (``graded`` / ``apply_failed`` /
``agent_fault`` / ``infra_error``), the DeepSWE score fields, how the episode went, and ``signals``:
the cheating signals of its grading (:mod:`evals.signals`), sorted names joined by commas ('' for
none), and what the attempt did, for the trajectory viewer: ``diff`` (the committed work),
``test_outcomes`` (every target and existing test with its outcome), ``test_output`` and
``transcript`` (JSON text). An attempt that hits an infrastructure failure is retried up to ``infra_retries`` times; if it still fails it is recorded
with ``status="infra_error"`` and empty scores, and metrics leave it out (never scored as 0).
:func:`write_rows` stores rows as Parquet (temporary name, then rename).

:func:`evaluate_checkpoint` serves a base model (and an adapter, merged into its weights) with an
engine replica process (vLLM by default) and evaluates it, with :func:`evaluate` or, on Harbor tasks,
:func:`evals.harbor.evaluate_harbor`: the one path from a checkpoint to its rows.
:func:`eval_tasks` picks the tasks an ``[eval]`` section names (:func:`load_eval_tasks`: those of a source
and split, :func:`select_tasks`: the ids named).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from evals.attempts import (
    INFRA_ERROR, ROW_COLUMNS, SCORE_FIELDS, AgentRun, AttemptRow, attempt_row, attempt_seed, run_attempts, write_rows,
)
from evals.bundled import read_suite
from evals.harness import (HttpClient, ModelClient, Tokenizer, Trajectory, episode_context, run_episode,
                           shared_grade_cache)
from evals.sandbox import SandboxFactory
from evals.settings import EVAL_DEFAULTS, RUN_KEYS, EvalSection
from evals.tasks import Task, load_tasks
from serving.adapters import merge_adapter
from serving.client import EngineClient
from serving.engines.vllm import lora_rank_slot
from serving.fleet import start_engine, stop_replica

__all__ = ["ROW_COLUMNS", "SCORE_FIELDS", "BundledVerifier", "episode_attempt", "evaluate", "evaluate_checkpoint",
           "eval_split", "eval_tasks", "load_eval_tasks", "select_tasks", "served_checkpoint", "served_model",
           "write_rows"]

# What an attempt did, for the trajectory viewer (``viewer``): bounded so a runaway attempt cannot
# swell the Parquet file. ``test_outcomes`` and ``transcript`` are JSON text (see :func:`episode_attempt`).
MAX_DIFF_CHARS = 200_000
MAX_TEST_OUTPUT_CHARS = 20_000
MAX_TURN_CHARS = 20_000


def episode_attempt(task: Task, attempt: int, traj: Trajectory, checkpoint: str, infra_retries: int) -> AttemptRow:
    """The :class:`~evals.attempts.AttemptRow` of one graded (or infra-failed) episode of the harness
    (:func:`evals.attempts.attempt_row`), with what the viewer shows: the committed work, every test's
    outcome, the test output and the transcript."""
    grade = traj.grade
    if traj.stop_reason == INFRA_ERROR or grade is None:
        status, scores, detail = INFRA_ERROR, None, traj.error or "not graded"
    else:
        status, scores, detail = grade.status, grade.scores, grade.detail
    return attempt_row(
        task, attempt, AgentRun.of_episode(traj), checkpoint=checkpoint, adapter_version=traj.adapter_version,
        status=status, scores=scores, detail=detail, grade_s=traj.grade_s, infra_retries=infra_retries,
        signals=grade.signals if grade is not None else (), diff=traj.patch[:MAX_DIFF_CHARS],
        test_outcomes=json.dumps(outcome_of_tests(task, grade.statuses if grade is not None else None)),
        test_output=(grade.test_output if grade is not None else "")[-MAX_TEST_OUTPUT_CHARS:],
        transcript=json.dumps(attempt_transcript(task, traj)),
    )


def outcome_of_tests(task: Task, statuses: Mapping[str, str] | None) -> list[dict[str, str]]:
    """Every target and existing test of ``task`` with its outcome in the grading (``passed``,
    ``failed``, ``error``, ``skipped``...; ``missing`` when the run did not report it, ``not run``
    when nothing was graded): ``[{"test", "kind": "target"|"existing", "outcome"}]``."""
    out = []
    for kind, ids in (("target", task.target_tests), ("existing", task.existing_tests)):
        for test in ids:
            outcome = "not run" if statuses is None else str(statuses.get(test, "missing"))
            out.append({"test": test, "kind": kind, "outcome": outcome})
    return out


def attempt_transcript(task: Task, traj: Trajectory) -> list[dict[str, Any]]:
    """What the agent was asked, wrote and was answered, in order: ``{"role": "task", "text"}``, then
    per turn ``{"role": "model", "turn", "text", "output_tokens"}`` and each action's
    ``{"role": "action", "turn", "action", "observation", "duration_s"}``. A scaffold's episode keeps
    its own messages instead (``{"role": <its role>, "text"}``)."""
    out: list[dict[str, Any]] = [{"role": "task", "text": task.instruction[:MAX_TURN_CHARS]}]
    if traj.transcript and not traj.calls:
        for message in traj.transcript:
            content = message.get("content") if isinstance(message, dict) else message
            out.append({"role": str(message.get("role", "message")) if isinstance(message, dict) else "message",
                        "text": (content if isinstance(content, str) else json.dumps(content, default=str))[:MAX_TURN_CHARS]})
        return out
    for turn, call in enumerate(traj.calls):
        out.append({"role": "model", "turn": turn, "text": call.text[:MAX_TURN_CHARS],
                    "output_tokens": len(call.output_ids)})
        for step in traj.steps:
            if step.turn == turn:
                out.append({"role": "action", "turn": turn, "action": step.action,
                            "observation": step.observation[:MAX_TURN_CHARS], "duration_s": round(step.duration_s, 3)})
    return out


@dataclass
class BundledVerifier:
    """The :class:`~evals.attempts.Verifier` of tasks graded by posttrain's own grader (bundled,
    SWE-bench, suites): an episode of the built-in harness (:func:`evals.harness.run_episode`), whose
    committed work is graded in a fresh sandbox (:func:`evals.grading.grade_patch`). An episode lost
    to the infrastructure is run again, up to ``infra_retries`` times.

    With ``reuse_grading`` an attempt whose committed patch is identical to an earlier attempt's on
    the same task takes that grading instead of running the tests again (tiny models often commit
    the same patch, or nothing), an earlier attempt of any evaluation in this process with the same
    sandbox factory included (:func:`evals.harness.shared_grade_cache`); leave it off for tasks with
    nondeterministic tests."""

    model: ModelClient
    tokenizer: Tokenizer
    sandbox_factory: SandboxFactory
    checkpoint: str
    seed: int  # the [eval] seed (evals.settings.EvalSection, where its default is)
    adapter_version: str | None = None
    infra_retries: int = 2
    reuse_grading: bool = True
    episode: dict[str, Any] = field(default_factory=dict)  # run_episode's other keywords (max_turns, ...)

    def __post_init__(self) -> None:
        # shared by the evaluations of one factory in this process (evals.harness.shared_grade_cache)
        self._grade_cache: dict | None = shared_grade_cache(self.sandbox_factory) if self.reuse_grading else None

    def attempt(self, task: Task, task_index: int, attempt: int) -> AttemptRow:
        for retry in range(self.infra_retries + 1):
            traj = run_episode(
                task, self.model, self.tokenizer, self.sandbox_factory, adapter_version=self.adapter_version,
                session_id=f"{self.checkpoint}/{task.id}/{attempt}/{retry}",
                seed=attempt_seed(self.seed, task_index, attempt, retry), grade_cache=self._grade_cache,
                **self.episode,
            )
            if not traj.infra_error:
                break
        return episode_attempt(task, attempt, traj, self.checkpoint, retry)


def evaluate(
    tasks: Sequence[Task],
    model: ModelClient,
    tokenizer: Tokenizer,
    sandbox_factory: SandboxFactory,
    settings: EvalSection = EVAL_DEFAULTS,
    *,
    checkpoint: str,
    adapter_version: str | None = None,
    action_format: str = "compact",
    infra_retries: int = 2,
    reuse_grading: bool = True,
    **episode_kwargs: Any,
) -> list[dict[str, Any]]:
    """Run ``settings.attempts`` episodes of every task and return one row per attempt, in task
    order: :func:`evals.attempts.run_attempts` with a :class:`BundledVerifier`, its rows as dicts.

    ``settings`` is the run's ``[eval]`` section (:class:`evals.settings.EvalSection`), handed over
    whole: its :data:`~evals.settings.RUN` keys (attempts, max_turns, max_new_tokens, temperature,
    seed, workers) say how each task is run, and their defaults are the section's. A run key named
    loose among the keywords (``attempts=2``) is set on the section
    (:func:`_with_run_keywords`); the other keywords go to every episode
    (:func:`evals.harness.run_episode`: ``stop_token_ids``, ``max_context_tokens``, ...)."""
    settings = _with_run_keywords(settings, episode_kwargs)
    verifier = BundledVerifier(
        model, tokenizer, sandbox_factory, checkpoint, settings.seed, adapter_version, infra_retries=infra_retries,
        reuse_grading=reuse_grading,
        episode=dict(action_format=action_format, max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
                     temperature=settings.temperature, **episode_kwargs))
    return [row.to_row() for row in run_attempts(tasks, verifier, attempts=settings.attempts, workers=settings.workers)]


def eval_split(split: str) -> str:
    """The split filter of an ``[eval]`` ``split``: ``all`` is every task (no filter)."""
    return "" if split == "all" else split


def select_tasks(tasks: Sequence[Task], task_ids: Sequence[str], dataset: str | Path) -> list[Task]:
    """``tasks`` restricted to ``task_ids`` in that order (empty: all of them); an id that names no task
    raises ``ValueError`` naming the key and the dataset."""
    if not task_ids:
        return list(tasks)
    by_id = {t.id: t for t in tasks}
    unknown = [i for i in task_ids if i not in by_id]
    if unknown:
        raise ValueError(f"[eval] task_ids: {', '.join(unknown)} is not a task of {dataset} (in the split evaluated)")
    return [by_id[i] for i in task_ids]


def load_eval_tasks(source: str, split: str, *, bundled_dir: str | Path) -> list[Task]:
    """The tasks of ``split`` (empty: all) in ``source``: ``bundled`` is the suite at ``bundled_dir``
    as ``task_dataset`` built it (built at the default sizes if missing), anything else a task source
    :func:`evals.tasks.load_tasks` reads."""
    all_tasks = read_suite(bundled_dir) if source == "bundled" else load_tasks(source).tasks
    tasks = [t for t in all_tasks if not split or t.split == split]
    if not tasks:
        raise ValueError(f"deepswe_eval: task source {source!r} has no task in split {split!r}")
    return tasks


def eval_tasks(settings: EvalSection, *, bundled_dir: str | Path) -> list[Task]:
    """The tasks an ``[eval]`` section picks (its :data:`~evals.settings.TASKS` keys: the dataset,
    its split, the ids named, in that order), the bundled suite read from ``bundled_dir``: one
    reading of those keys for the ``deepswe_eval`` asset, the eval pod (``training.fleet_eval``)
    and ``posttrain eval``'s check before it runs. Not for a Harbor dataset, whose tasks need their
    images (``assets.harbor_eval``)."""
    tasks = load_eval_tasks(settings.dataset, eval_split(settings.split), bundled_dir=bundled_dir)
    return select_tasks(tasks, settings.task_ids, settings.dataset)


def evaluate_checkpoint(
    tasks: Sequence[Task],
    base_model: str | Path,
    sandbox_factory: SandboxFactory,
    settings: EvalSection = EVAL_DEFAULTS,
    *,
    checkpoint: str,
    adapter: str | Path | None = None,
    adapter_version: str | None = None,
    log: Callable[[str], None] | None = None,
    engine_log: str | Path | None = None,
    merge: bool = True,
    evaluate_served: Callable[..., list[dict[str, Any]]] | None = None,
    **episode_kwargs: Any,
) -> list[dict[str, Any]]:
    """Evaluate a checkpoint: ``base_model`` (a Hugging Face folder) with the peft folder ``adapter``
    served as ``adapter_version`` (none: the base model alone), by an engine replica process
    (:func:`serving.fleet.start_engine`: vLLM unless ``POSTTRAIN_ENGINE`` says otherwise; its output
    in ``engine_log``, else a temporary file) for the length of the call.

    ``settings`` is the ``[eval]`` section (:class:`evals.settings.EvalSection`) whose run keys say
    how each task is run; a run key named loose among the keywords (``attempts=3``) overrides it.
    ``evaluate_served`` runs the attempts on the served model: :func:`evaluate` (the default: bundled,
    SWE-bench and suite tasks, graded by posttrain's grader), handed ``settings`` whole, or
    :func:`evals.harbor.evaluate_harbor` (Harbor tasks, DeepSWE v1.1's verifier flow, with the
    built-in agent loop), handed its run keys loose (:meth:`~evals.settings.EvalSection.run_settings`).
    Either is called with the tasks, ``model`` (a client of the replica), ``tokenizer``,
    ``sandbox_factory``, ``checkpoint``, ``adapter_version`` (None without an adapter) and the other
    keywords; the model's end-of-sequence tokens stop each turn, and its context bounds each
    episode's. ``merge``: see :func:`served_checkpoint` (the adapter merged into the weights, the
    default, or LoRA at run time)."""
    with served_checkpoint(base_model, engine_log, checkpoint=checkpoint, adapter=adapter,
                           adapter_version=adapter_version, merge=merge) as (url, tokenizer, eos_ids):
        if log is not None:
            log(f"evaluating {checkpoint} (adapter {adapter_version or 'none'}) on {len(tasks)} tasks x "
                f"{episode_kwargs.get('attempts', settings.attempts)} attempts, served on {url}")
        served = dict(model=HttpClient(url), tokenizer=tokenizer, sandbox_factory=sandbox_factory, checkpoint=checkpoint,
                      adapter_version=adapter_version if adapter is not None else None, stop_token_ids=eos_ids,
                      **episode_context(base_model))
        if evaluate_served is None:  # it reads the run keys from the section (loose ones set on it)
            return evaluate(tasks, settings=settings, **{**served, **episode_kwargs})
        return evaluate_served(tasks, **{**served, **settings.run_settings(), **episode_kwargs})


def _with_run_keywords(settings: EvalSection, keywords: dict[str, Any]) -> EvalSection:
    """``settings`` with the :data:`~evals.settings.RUN` keys found in ``keywords`` taken out of it
    (``keywords`` is changed) and set there: how a caller that names a run key loose
    (``attempts=2``, as ``training.curriculum`` and the benchmarks do) reaches :func:`evaluate`,
    which reads every run key from the section, so that a key left out takes the section's default."""
    run = {key: keywords.pop(key) for key in RUN_KEYS if key in keywords}
    return dataclasses.replace(settings, **run) if run else settings


@contextlib.contextmanager
def served_checkpoint(base_model: str | Path, engine_log: str | Path | None = None, *, checkpoint: str,
                      adapter: str | Path | None = None, adapter_version: str | None = None, merge: bool = True,
                      **engine_settings: Any) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """:func:`served_model` of a checkpoint: the base model alone, or with the peft folder ``adapter``
    served as ``adapter_version`` (calls name that version, and records carry it).

    ``merge`` (the default) writes the adapter into a copy of the base's weights
    (:func:`serving.adapters.merge_adapter`, beside ``engine_log``, removed after the block) and serves
    that with no LoRA layers (``max_loras=0``; the replica answers to ``adapter_version`` for it). A
    checkpoint's evaluation serves one adapter only, and LoRA applied at run time cost about 1.5x the
    engine's CPU per generated token on the embedded default, a whole evaluation 1.2x its wall and CPU
    (``bench/vllm_cpu_cost.py``, ``bench/eval_merged.py``; docs/benchmarks.md).
    ``merge=False`` loads the adapter on a LoRA replica instead, its rank slot sized from the adapter.
    Yields what :func:`served_model` yields."""
    if adapter is not None and not adapter_version:
        raise ValueError(f"checkpoint {checkpoint}: an adapter needs an adapter_version to be served as")
    what = f"checkpoint {checkpoint}"
    if adapter is None:
        engine_settings.setdefault("max_loras", 0)
        with served_model(base_model, engine_log, what=what, **engine_settings) as served:
            yield served
    elif merge:
        engine_settings.setdefault("max_loras", 0)
        scratch = Path(engine_log).parent if engine_log is not None else None
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="posttrain-merged-", dir=scratch) as tmp:
            merged = merge_adapter(base_model, adapter, Path(tmp) / "model")
            with served_model(merged, engine_log, what=what, merged_version=adapter_version, **engine_settings) as served:
                yield served
    else:
        rank = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("r", 16)
        engine_settings.setdefault("max_lora_rank", lora_rank_slot(int(rank)))
        with served_model(base_model, engine_log, what=what, **engine_settings) as served:
            EngineClient(served[0]).load_lora_adapter(adapter_version, str(adapter))
            yield served


def model_tokens(base_model: str | Path, *, what: str = "model") -> tuple[Any, tuple[int, ...]]:
    """The tokenizer of ``base_model`` (a Hugging Face folder) and its end-of-sequence token ids,
    which stop each turn; ``FileNotFoundError`` naming ``what`` when the folder has no tokenizer."""
    from transformers import AutoConfig, AutoTokenizer  # heavy: only serving a model needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base_model))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{what}: base model {base_model} has no tokenizer: {exc}") from None
    eos = AutoConfig.from_pretrained(str(base_model)).eos_token_id
    return tokenizer, tuple(sorted(set(eos if isinstance(eos, list) else [eos] if eos is not None else [])))


@contextlib.contextmanager
def served_model(base_model: str | Path, engine_log: str | Path | None = None, *, what: str = "model",
                 **engine_settings: Any) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """``base_model`` (a Hugging Face folder) served by an engine replica process for the length of
    the block (:func:`serving.fleet.start_engine`: vLLM unless ``POSTTRAIN_ENGINE`` says otherwise;
    its output in ``engine_log``, else a temporary file, removed after a block that ended without an
    error): yields the replica's URL, the model's tokenizer and its end-of-sequence token ids.
    ``engine_settings`` go to the replica (``max_lora_rank``, ``tool_call_parser``, ...)."""
    tokenizer, eos_ids = model_tokens(base_model, what=what)
    scratch = None
    if engine_log is None:
        scratch = Path(tempfile.mkdtemp(prefix="posttrain-eval-"))
        engine_log = scratch / "engine.log"
    proc, url = start_engine(str(base_model), Path(engine_log), **engine_settings)
    try:
        yield url, tokenizer, eos_ids
    finally:
        stop_replica(proc)
    if scratch is not None:  # kept where anything failed (a failed start names the log in its error)
        shutil.rmtree(scratch, ignore_errors=True)
