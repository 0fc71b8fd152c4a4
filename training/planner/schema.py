"""The run file: one TOML file per RL run, parsed once into frozen dataclasses.

This module composes the run file from its sections and declares none of its keys: each section
is declared once, in the package that acts on it, and composed here. ``[eval]`` is
``evals.settings.EvalSection``, ``[inference]`` ``serving.settings.InferenceSection``, ``[sandbox]``
``sandboxes.settings.SandboxSection``; ``[trainer]`` is made from the trainer's config
(``training.config.TrainConfig`` and its ``LossConfig``), each key optional, with the one key of the
planner's own (``gpus``, the trainer pod's size); the sections the planner alone reads (``[run]``,
``[model]``, ``[async]``, ``[curriculum]``, ``[kubernetes]``) are declared in
:mod:`training.planner.sections`. One vocabulary (``sandboxes.settings``) validates every
section: parsing collects every problem in the file before raising, and each message names the
file, the section and the key, and says what was expected. ``docs/run-file.md`` is written from
the declarations (:func:`run_file_reference`).

Where the composition belongs (docs/design.md, "The run config"): here, in ``training.planner``,
the one reader of the whole file. The planner resolves the file into the plan, the trainer's table
and the Kubernetes manifests; every other package reads its own section back from the plan with
its own parser (``evals.settings.parse_eval_table``, ``training.config.TrainConfig.load``), so no
package but the planner imports the composition. A package of its own above training would hold
the same code under another name: the planner imports every section's package (evals, serving,
sandboxes, training.config) and nothing of training's loop, and what imports the planner
(``assets``, ``dagster_project``) stands above it either way.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from evals.settings import EvalSection
from sandboxes.files import read_regular_bytes
from sandboxes.settings import NON_NEGATIVE, SettingsError, key_name, markdown_table, parse_section, setting
from training.config import TrainConfig
from sandboxes.settings import SandboxSection
from serving.settings import InferenceSection
from training.planner.sections import AsyncSection, CurriculumSection, KubernetesSection, ModelSection, RunSection

# The run planner's name for settings that do not validate (and for a run file that cannot be
# planned): one class, so that a caller catching PlanError also catches an [eval] table's errors.
PlanError = SettingsError


def trainer_keys(config: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """The ``[trainer]`` keys of a trainer config class: run-file name -> (type, field) of each field
    declared with ``setting`` metadata, the loss's (``TrainConfig.loss``) flat under their run-file names."""
    keys: dict[str, tuple[Any, dataclasses.Field]] = {}
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "check" not in f.metadata:
            continue  # a key the planner derives (base_model, group_size, ...) or the trainer's own
        if dataclasses.is_dataclass(hints[f.name]):
            inner = typing.get_type_hints(hints[f.name])
            keys.update({key_name(g): (inner[g.name], g) for g in dataclasses.fields(hints[f.name])})
        else:
            keys[f.name] = (hints[f.name], f)
    return keys


# The keys of [trainer] that size the trainer's pod rather than configure the trainer.
TRAINER_POD_KEYS = ("gpus",)

# ``[trainer]``: the GRPO learner on a LoRA adapter. Its keys are the trainer's config's
# (``training.config.TrainConfig`` and its ``LossConfig``, where each is declared with its type, its
# choices and its default), made optional here: a key left out takes the trainer's own default.
# ``gpus`` sizes the trainer pod and is the only key of this table that is not the trainer's.
TrainerSection = dataclasses.make_dataclass(
    "TrainerSection",
    [(key, hint | None, field(default=None, metadata={**f.metadata, "key": None}))
     for key, (hint, f) in trainer_keys(TrainConfig).items()]
    + [("gpus", int, field(default=0, metadata=setting(NON_NEGATIVE, doc=(
        "GPUs of the trainer (its pod on Kubernetes): one trainer process per GPU, data parallel"))))],
    frozen=True)
TrainerSection.__module__ = __name__
TrainerSection.__doc__ = ("``[trainer]``: the GRPO learner on a LoRA adapter. Its keys are declared with the trainer's "
                          "config (``training.config.TrainConfig`` and its ``LossConfig``), each optional here: a key "
                          "left out takes the trainer's own default. ``gpus`` sizes the trainer's pod.")


def _check_trainer_keys() -> None:
    """Every ``[trainer]`` key but the pod's is a key of ``TrainConfig`` of the same type (optional
    here), so that the plan's trainer table always loads. ``TrainerSection`` is made from
    ``TrainConfig``, so this holds by construction; the test of the schema checks it still does."""
    config_types = {key: hint for key, (hint, _) in trainer_keys(TrainConfig).items()}
    for name, hint in typing.get_type_hints(TrainerSection).items():
        if name in TRAINER_POD_KEYS:
            continue
        if name not in config_types or hint != config_types[name] | None:
            raise TypeError(f"[trainer] {name}: {hint} is not an optional TrainConfig field "
                            f"({config_types.get(name, 'absent')} in training.config.TrainConfig)")


@dataclass(frozen=True)
class RunFile:
    """A parsed run file. ``source`` is the file it came from (``<dict>`` for a mapping)."""

    source: str
    run: RunSection
    model: ModelSection
    inference: InferenceSection
    trainer: TrainerSection
    async_: AsyncSection
    sandbox: SandboxSection
    curriculum: CurriculumSection
    kubernetes: KubernetesSection
    explicit: frozenset[str]  # "section.key" for every key the file sets
    eval: EvalSection = EvalSection()

    def is_set(self, section: str, key: str) -> bool:
        return f"{section}.{key}" in self.explicit


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "model": ModelSection,
    "inference": InferenceSection,
    "trainer": TrainerSection,
    "async": AsyncSection,
    "sandbox": SandboxSection,
    "curriculum": CurriculumSection,
    "kubernetes": KubernetesSection,
    "eval": EvalSection,
}


def parse_run_dict(data: Mapping[str, Any], source: str = "<dict>") -> RunFile:
    """Validate a run file already read into a mapping (the shape ``tomllib`` returns)."""
    problems: list[str] = []
    parsed: dict[str, Any] = {}
    explicit: set[str] = set()
    for key in data:
        if key not in SECTIONS:
            problems.append(
                f"{source}: [{key}]: unknown section; a run file has " + ", ".join(f"[{s}]" for s in SECTIONS)
            )
    for section, cls in SECTIONS.items():
        value, keys = parse_section(cls, data.get(section, {}), section, source, problems)
        parsed[section] = value
        explicit |= keys
    if problems:
        raise PlanError(problems)
    return RunFile(
        source=source,
        run=parsed["run"],
        model=parsed["model"],
        inference=parsed["inference"],
        trainer=parsed["trainer"],
        async_=parsed["async"],
        sandbox=parsed["sandbox"],
        curriculum=parsed["curriculum"],
        kubernetes=parsed["kubernetes"],
        explicit=frozenset(explicit),
        eval=parsed["eval"],
    )


def load_run_file(path: str | Path) -> RunFile:
    """Read and validate a run TOML file; raise ``PlanError`` naming the file and the keys."""
    return parse_run_dict(read_run_toml(path), source=str(path))


def read_run_toml(path: str | Path) -> dict[str, Any]:
    """A run file's TOML as a dict, unvalidated; ``PlanError`` naming the file when it cannot be read,
    is not UTF-8 or is not TOML."""
    path = Path(path)
    try:
        raw = read_regular_bytes(path)  # a FIFO or a device is refused at once, never waited on
    except OSError as exc:
        raise PlanError([f"{path}: cannot read the run file: {exc.strerror or exc}"]) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError([f"{path}: not UTF-8 text (byte {exc.start} is {raw[exc.start:exc.start + 1]!r}): "
                         "a run file must be UTF-8, as TOML requires"]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError([f"{path}: not valid TOML: {exc}"]) from exc
    return data


RUN_FILE_REFERENCE = "docs/run-file.md"  # from the repository root


def run_file_reference() -> str:
    """The key reference of the run file, every section, as the Markdown of ``docs/run-file.md``,
    written from the sections' declarations (defaults shown for ``[trainer]`` are the trainer's own).
    Rewrite the file after changing a section: ``posttrain keys > docs/run-file.md``."""
    defaults = TrainConfig().to_json()  # the trainer's keys flat, the loss's among them
    trainer = TrainerSection(**{key: defaults[key] for key in trainer_keys(TrainConfig)})
    parts = [("# Run file keys\n\n"
             "<!-- Written by `posttrain keys > docs/run-file.md` from the sections' declarations "
             "(tests/test_run_config.py checks it is current); edit the declarations, not this file. -->\n\n"
             "Every key of every section of the run file, with its type, default and allowed values, as declared "
             "in the package that uses it; an empty default is unset (the planner, a profile or the trainer "
             "decides it: docs/planner.md). See docs/planner.md for how the planner reads them.\n")]
    for name, cls in SECTIONS.items():
        defaults = trainer if cls is TrainerSection else None
        where = "" if cls is TrainerSection else f" Declared in `{cls.__module__}.{cls.__name__}`."
        parts.append(f"## `[{name}]`\n\n{inspect.cleandoc(cls.__doc__ or '')}{where}\n\n{markdown_table(cls, defaults)}")
    return "\n".join(parts)
