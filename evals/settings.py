"""``[eval]``: how each checkpoint of a run is evaluated, declared once, here, where it is used.

The run file's ``[eval]`` table is this dataclass: the planner validates it with the rest of the
run file (``training.planner.schema`` composes the sections) and keeps it whole in the plan; the
checkpoint sensor, ``posttrain backfill``, ``posttrain eval`` and the demo read it back from there
(:func:`parse_eval_table`), and the ``deepswe_eval`` asset's Dagster config is generated from these
fields (``assets.evals.DeepSWEEvalConfig``), so the keys, their types and their defaults are
written in this file only. The vocabulary (constraints, choices, the validation) is
``sandboxes.settings``'s.

Each key also says which part of an evaluation it is (``part`` in its metadata): :data:`TASKS`
picks the tasks, :data:`RUN` says how each task is run; the evaluation (``evals.evaluate.evaluate``,
on a local engine or in a Kubernetes run's eval pod, ``training.fleet_eval``) is handed the section
whole and reads the :data:`RUN` keys from it, so their defaults are written here only; the rest
are the asset's (sources, sandbox runtime, network, checks). The eval pod is given
:data:`POD_KEYS`, the two parts, read from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from sandboxes.settings import FRACTION, NON_NEGATIVE, POSITIVE, as_table, key_name, parse_table, setting

TASKS = "tasks"  # a key that picks the tasks evaluated
RUN = "run"  # a key that says how each task is run: a keyword argument of the evaluation


def _part(part: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``setting`` metadata with the part of the evaluation the key is (:data:`TASKS`, :data:`RUN`)."""
    return {**meta, "part": part}


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: how each checkpoint of the run is evaluated. The checkpoint sensor's evaluations,
    the demo's, ``posttrain backfill`` and ``posttrain eval`` read it; ``deepswe_eval``'s config is
    made from it."""

    dataset: str = field(default="bundled", metadata=_part(TASKS, setting(doc=(
        "bundled (the generated suite), a task source, or a Harbor dataset folder such as DeepSWE's tasks/"))))
    sources: str | None = field(default=None, metadata=setting(doc=(
        "folder of repository sources a Harbor dataset's images are built from (git folders or bundles)")))
    task_ids: tuple[str, ...] = field(default=(), metadata=_part(TASKS, setting(
        doc="task ids to evaluate; [] evaluates every one")))
    split: str = field(default="eval", metadata=_part(TASKS, setting(doc=(
        "the split evaluated: eval (held out), train, or all; a Harbor task without a split counts as held out"))))
    attempts: int = field(default=8, metadata=_part(RUN, setting(POSITIVE, doc="attempts per task (the k of pass@k)")))
    max_turns: int = field(default=4, metadata=_part(RUN, setting(POSITIVE, doc="model turns per attempt")))
    max_new_tokens: int = field(default=48, metadata=_part(RUN, setting(POSITIVE, doc="tokens per model turn")))
    temperature: float = field(default=1.0, metadata=_part(RUN, setting(NON_NEGATIVE)))
    seed: int = field(default=0, metadata=_part(RUN, setting(NON_NEGATIVE)))
    workers: int = field(default=2, metadata=_part(RUN, setting(POSITIVE, doc="attempts run at once")))
    sandbox_runtime: str = field(default="bwrap", metadata=setting(choices=("bwrap", "gvisor")))
    network: bool = field(default=True, metadata=setting(doc=(
        "a Harbor image built for the eval may reach the package registries (with the benchmark's date cutoff)")))
    environment_check: bool = field(default=True, metadata=setting(doc=(
        "run each Harbor task's reference solution once per image, so that strict credit spares the "
        "existing tests it fails here")))
    max_infra_error_share: float = field(default=0.1, metadata=setting(FRACTION, doc=(
        "share of attempts lost to the infrastructure above which the eval's check fails")))

    def run_settings(self) -> dict[str, Any]:
        """How each task is run (the :data:`RUN` keys), as keyword arguments: for an evaluation that
        takes them loose (``evals.harbor.evaluate_harbor``, whose agents are not only the model's)."""
        return {key: getattr(self, key) for key in RUN_KEYS}


EVAL_DEFAULTS = EvalSection()  # the run file's [eval] when it has none


def _keys_of(part: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(EvalSection) if f.metadata.get("part") == part)


TASK_KEYS = _keys_of(TASKS)  # dataset, task_ids, split
RUN_KEYS = _keys_of(RUN)  # attempts, max_turns, max_new_tokens, temperature, seed, workers
# The keys a Kubernetes run's eval pod is given (python -m training.fleet_eval --settings): which
# tasks, then how they are run; the rest are the asset's, which stays here.
POD_KEYS = TASK_KEYS + RUN_KEYS


def parse_eval_table(table: Any, source: str) -> EvalSection:
    """An ``[eval]`` table (from a run file, a plan, a Dagster config or command-line options)
    validated into an :class:`EvalSection`; ``sandboxes.settings.SettingsError`` (the planner's
    ``PlanError``) naming ``source`` and each offending key. A key set to ``None`` is unset."""
    return parse_table(EvalSection, table, "eval", source)


def validated_eval_table(table: Any, source: str) -> dict[str, Any]:
    """An ``[eval]`` table validated (as :func:`parse_eval_table` does) and written whole: every key
    with its value or its default (one left unset, ``sources``, left out), run-file names, lists for
    tuples (``sandboxes.settings.as_table``). What a process boundary that takes a table is given:
    ``deepswe_eval``'s Dagster run config (``assets.evals.checkpoint_eval_run_config``)."""
    section = parse_eval_table(table, source)
    return as_table(section)


def override_eval_section(section: EvalSection, table: Any, source: str) -> EvalSection:
    """``section`` (a run's ``[eval]``, already valid) with the keys of ``table`` (a command's
    options) set over it: the options are validated, as :func:`parse_eval_table` does, and the
    section is not turned back into a table to be read again."""
    given = parse_table(EvalSection, table, "eval", source)
    return replace(section, **{f.name: getattr(given, f.name) for f in fields(EvalSection)
                               if isinstance(table, Mapping) and table.get(key_name(f)) is not None})
