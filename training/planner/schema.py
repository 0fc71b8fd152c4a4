"""The run file: one TOML file per RL run, parsed once into frozen dataclasses.

This module composes the run file from its sections; each section is declared once, in the package
that uses it, and composed here: ``[eval]`` is ``evals.settings.EvalSection``, ``[trainer]`` is made
from the trainer's config (``training.config.TrainConfig`` and its ``LossConfig``), and the sections
the planner alone reads (``[run]``, ``[model]``, ``[inference]``'s sizing knobs, ``[async]``,
``[sandbox]``, ``[curriculum]``, ``[kubernetes]``) are declared below, with their types,
constraints and defaults (the defaults of the ``generic`` profile live in
``presets.GENERIC_DEFAULTS`` for the inference knobs, which a preset may own). One vocabulary
(``sandboxes.settings``) validates every section: parsing collects every problem in the file before
raising, and each message names the file, the section and the key, and says what was expected.
``docs/run-file.md`` is written from these declarations (:func:`run_file_reference`).

The composition lives here, in ``training.planner``, rather than in a package above training: the
planner is what reads the whole file (it resolves it into the plan, the trainer's table and the
Kubernetes manifests, and ``training.fleet_eval`` and the trainer read the plan back), and training
is the lowest package that may import every section's package (evals, serving, sandboxes). A
package above training would have to take the planner with it, or the planner would import upward.
The layers above (``assets``, ``dagster_project``) read the plan's tables with the sections' own
parsers (``evals.settings.parse_eval_table``).
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from evals.settings import EvalSection, parse_eval_table  # noqa: F401 (parse_eval_table: the CLI imports it from here)
from sandboxes.files import read_regular_bytes
from sandboxes.settings import (
    FRACTION, NON_NEGATIVE, POSITIVE, SettingsError, key_name, markdown_table, parse_section, setting,
)
from serving.sglang import SGLANG_IMAGE
from training.config import TrainConfig

# The engine servers a replica may run (python -m serving.replica --engine vllm on CPUs, SGLang on GPUs).
ENGINES = ("sglang", "vllm")

# The run planner's name for settings that do not validate (and for a run file that cannot be
# planned): one class, so that a caller catching PlanError also catches an [eval] table's errors.
PlanError = SettingsError


@dataclass(frozen=True)
class RunSection:
    """``[run]``: the name of the run and where it writes."""

    name: str | None = field(default=None, metadata=setting(doc="run name; default: the run file's stem"))
    dir: str | None = field(default=None, metadata=setting(doc="run directory; default: $POSTTRAIN_HOME/runs/NAME"))


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: what is served and trained, and its serving geometry (for memory sizing)."""

    name: str | None = field(default=None, metadata=setting(doc="model id, e.g. a Hugging Face id"))
    path: str | None = field(default=None, metadata=setting(doc="local checkpoint folder whose config.json gives the geometry"))
    family: str | None = field(default=None, metadata=setting(doc="model family that presets are measured on, e.g. olmo35-hybrid"))
    weights_gib: float | None = field(default=None, metadata=setting(POSITIVE))
    full_attention_layers: int | None = field(default=None, metadata=setting(NON_NEGATIVE))
    kv_heads: int | None = field(default=None, metadata=setting(POSITIVE))
    head_dim: int | None = field(default=None, metadata=setting(POSITIVE))
    kv_dtype_bytes: int | None = field(default=None, metadata=setting(POSITIVE))
    recurrent_layers: int | None = field(default=None, metadata=setting(NON_NEGATIVE))
    recurrent_heads: int | None = field(default=None, metadata=setting(POSITIVE))
    recurrent_state_dims: tuple[int, ...] | None = field(default=None, metadata=setting(POSITIVE))
    recurrent_state_dtype_bytes: int | None = field(default=None, metadata=setting(POSITIVE))


@dataclass(frozen=True)
class InferenceSection:
    """``[inference]``: the engine fleet and the SGLang knobs that size it.

    ``None`` means "not set in the file": the profile (a preset, or the generic defaults) fills it.
    """

    profile: str = field(default="generic", metadata=setting(doc="generic, or a preset name"))
    engine: str | None = field(default=None, metadata=setting(choices=ENGINES, doc=(
        "the server of each replica: sglang (GPUs) or vllm (vLLM's CPU build behind the capture front, "
        "python -m serving.replica); default: vllm for gpu = \"cpu\", sglang otherwise")))
    engines: int = field(default=1, metadata=setting(POSITIVE))
    max_engines: int | None = field(default=None, metadata=setting(POSITIVE, doc=(
        "on Kubernetes, the most replicas the engines' StatefulSet may be scaled to while the run goes "
        "(kubectl scale): the router knows each one's name and a replica joins once it answers; default: engines")))
    gpu: str = field(default="cpu", metadata=setting(doc="hardware name: cpu, h100, h200, b200, b300, ..."))
    gpus_per_engine: int = field(default=1, metadata=setting(POSITIVE, doc="tensor-parallel size of one engine"))
    gpu_memory_gib: float | None = field(default=None, metadata=setting(POSITIVE, doc="memory of one device"))
    max_context_length: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_max_running_requests: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_server_concurrency: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_cuda_graph_max_bs_decode: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_max_total_tokens: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_max_mamba_cache_size: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_mem_fraction_static: float | None = field(default=None, metadata=setting(FRACTION))
    sglang_disable_radix_cache: bool | None = None
    sglang_chunked_prefill_size: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_mamba_scheduler_strategy: str | None = field(
        default=None, metadata=setting(choices=("no_buffer", "extra_buffer"))
    )
    sglang_max_loras_per_batch: int | None = field(default=None, metadata=setting(POSITIVE))
    sglang_image: str = SGLANG_IMAGE  # one release: the launch flags are checked against its parser


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
class AsyncSection:
    """``[async]``: how much work is in flight and how stale it may be when trained on."""

    group_size: int = field(default=8, metadata=setting(POSITIVE, doc="samples per prompt (GRPO group)"))
    # samples per trainer step; the trainer counts groups: groups_per_step = collection_size / group_size
    # (training.config.groups_per_step, the one place the two are related)
    collection_size: int = field(default=48, metadata=setting(POSITIVE, doc="samples per trainer step (whole groups)"))
    async_max_concurrent_samples: int | None = field(default=None, metadata=setting(POSITIVE))
    max_policy_lag: int = field(default=1, metadata=setting(NON_NEGATIVE, doc="adapter versions a sample may lag"))


@dataclass(frozen=True)
class SandboxSection:
    """``[sandbox]``: one sandbox per episode."""

    runtime: str = field(default="auto", metadata=setting(choices=("auto", "runsc", "bwrap", "k8s")))
    cpus: float = field(default=1.0, metadata=setting(POSITIVE, doc="CPUs per sandbox"))
    memory_gib: float = field(default=2.0, metadata=setting(POSITIVE, doc="memory per sandbox"))
    max_sandboxes: int | None = field(default=None, metadata=setting(POSITIVE, doc="default: the producer budget"))
    command_timeout_s: float = field(default=120.0, metadata=setting(POSITIVE))
    image: str | None = field(default=None, metadata=setting(doc=(
        "on Kubernetes, the sandbox pod image of a task that is a folder (the bundled suite, the task stream): "
        "python3, git, tar, pxd at /opt/pxd/pxd.py; its repository is copied in at start")))


@dataclass(frozen=True)
class CurriculumSection:
    """``[curriculum]``: the tasks and their order from the base model's pass rates."""

    tasks: str | None = field(default=None, metadata=setting(doc="task source folder or file (default: the bundled suite)"))
    curriculum_file: str | None = field(default=None, metadata=setting(doc="curriculum.json of difficulty_curriculum"))
    attempts_per_task: int | None = field(default=None, metadata=setting(POSITIVE, doc="k base-model attempts per task"))
    retry_after_steps: int | None = field(default=None, metadata=setting(POSITIVE))
    open_hard_after_steps: int | None = field(default=None, metadata=setting(NON_NEGATIVE))
    task_stream: bool | None = field(default=None, metadata=setting(
        doc="RL draws tasks generated and validated as the run goes, each new to it (bundled suite only)"))


@dataclass(frozen=True)
class KubernetesSection:
    """``[kubernetes]``: where ``posttrain run --target k8s`` puts the run."""

    namespace: str = "posttrain"
    image: str = field(default="posttrain:latest", metadata=setting(doc="image with this package installed"))
    volume_gib: int = field(default=200, metadata=setting(POSITIVE, doc="size of the shared run volume"))
    storage_class: str | None = None
    volume_claim: str | None = field(default=None, metadata=setting(doc=(
        "an existing ReadWriteMany claim the run's pods mount instead of a volume of the run's own: several "
        "runs, and the Dagster storage root (a mount of it), on one volume")))
    service_account: str | None = None
    priority_class: str | None = field(default=None, metadata=setting(doc="priorityClassName of every pod of the run"))
    keep_fleet: bool = field(default=False, metadata=setting(
        doc="rl_run leaves the engines, router and sandbox pool running when the trainer ends (false: deleted with it)"))
    node_cpus: float | None = field(default=None, metadata=setting(POSITIVE, doc=(
        "allocatable CPUs of the node the run's pods share: the planner sizes every pod's requests to fit it "
        "(with node_memory_gib; unset: the fixed requests of a GPU cluster's pods)")))
    node_memory_gib: float | None = field(default=None, metadata=setting(POSITIVE, doc=(
        "allocatable memory of that node, GiB")))


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
    trainer = TrainerSection(**{key: getattr(TrainConfig(), key) for key in trainer_keys(TrainConfig)})
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
