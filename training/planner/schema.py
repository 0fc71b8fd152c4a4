"""The run file: one TOML file per RL run, parsed once into frozen dataclasses.

Every key of every section is declared here, with its type, its constraint and its default (the
defaults of the ``generic`` profile live in ``presets.GENERIC_DEFAULTS`` for the inference knobs,
which a preset may own). Parsing collects every problem in the file before raising, and each
message names the file, the section and the key, and says what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from evals.signals import ALL_SIGNALS
from sandboxes.files import read_regular_bytes
from serving.sglang import SGLANG_IMAGE
from training.config import BACKENDS, INTEGRITY_GATES, LOSS_WEIGHTINGS, REWARDS, TrainConfig

# The engine servers a replica may run (python -m serving.replica --engine vllm on CPUs, SGLang on GPUs).
ENGINES = ("sglang", "vllm")

# Constraint tags carried in field metadata.
POSITIVE = "positive"
NON_NEGATIVE = "non-negative"
FRACTION = "fraction"  # 0 < x <= 1


def _key(check: str | None = None, *, choices: tuple[str, ...] | None = None, doc: str = "") -> dict[str, Any]:
    return {"check": check, "choices": choices, "doc": doc}


class PlanError(ValueError):
    """A run file that cannot be planned. ``problems`` holds one message per offending key."""

    def __init__(self, problems: list[str], detail: str = "") -> None:
        self.problems = list(problems)
        self.detail = detail
        text = "\n".join(self.problems)
        super().__init__(text + (f"\n{detail}" if detail else ""))


@dataclass(frozen=True)
class RunSection:
    """``[run]``: the name of the run and where it writes."""

    name: str | None = field(default=None, metadata=_key(doc="run name; default: the run file's stem"))
    dir: str | None = field(default=None, metadata=_key(doc="run directory; default: $POSTTRAIN_HOME/runs/NAME"))


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: what is served and trained, and its serving geometry (for memory sizing)."""

    name: str | None = field(default=None, metadata=_key(doc="model id, e.g. a Hugging Face id"))
    path: str | None = field(default=None, metadata=_key(doc="local checkpoint folder whose config.json gives the geometry"))
    family: str | None = field(default=None, metadata=_key(doc="model family that presets are measured on, e.g. olmo35-hybrid"))
    weights_gib: float | None = field(default=None, metadata=_key(POSITIVE))
    full_attention_layers: int | None = field(default=None, metadata=_key(NON_NEGATIVE))
    kv_heads: int | None = field(default=None, metadata=_key(POSITIVE))
    head_dim: int | None = field(default=None, metadata=_key(POSITIVE))
    kv_dtype_bytes: int | None = field(default=None, metadata=_key(POSITIVE))
    recurrent_layers: int | None = field(default=None, metadata=_key(NON_NEGATIVE))
    recurrent_heads: int | None = field(default=None, metadata=_key(POSITIVE))
    recurrent_state_dims: tuple[int, ...] | None = field(default=None, metadata=_key(POSITIVE))
    recurrent_state_dtype_bytes: int | None = field(default=None, metadata=_key(POSITIVE))


@dataclass(frozen=True)
class InferenceSection:
    """``[inference]``: the engine fleet and the SGLang knobs that size it.

    ``None`` means "not set in the file": the profile (a preset, or the generic defaults) fills it.
    """

    profile: str = field(default="generic", metadata=_key(doc="generic, or a preset name"))
    engine: str | None = field(default=None, metadata=_key(choices=ENGINES, doc=(
        "the server of each replica: sglang (GPUs) or vllm (vLLM's CPU build behind the capture front, "
        "python -m serving.replica); default: vllm for gpu = \"cpu\", sglang otherwise")))
    engines: int = field(default=1, metadata=_key(POSITIVE))
    max_engines: int | None = field(default=None, metadata=_key(POSITIVE, doc=(
        "on Kubernetes, the most replicas the engines' StatefulSet may be scaled to while the run goes "
        "(kubectl scale): the router knows each one's name and a replica joins once it answers; default: engines")))
    gpu: str = field(default="cpu", metadata=_key(doc="hardware name: cpu, h100, h200, b200, b300, ..."))
    gpus_per_engine: int = field(default=1, metadata=_key(POSITIVE, doc="tensor-parallel size of one engine"))
    gpu_memory_gib: float | None = field(default=None, metadata=_key(POSITIVE, doc="memory of one device"))
    max_context_length: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_max_running_requests: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_server_concurrency: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_cuda_graph_max_bs_decode: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_max_total_tokens: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_max_mamba_cache_size: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_mem_fraction_static: float | None = field(default=None, metadata=_key(FRACTION))
    sglang_disable_radix_cache: bool | None = None
    sglang_chunked_prefill_size: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_mamba_scheduler_strategy: str | None = field(
        default=None, metadata=_key(choices=("no_buffer", "extra_buffer"))
    )
    sglang_max_loras_per_batch: int | None = field(default=None, metadata=_key(POSITIVE))
    sglang_image: str = SGLANG_IMAGE  # one release: the launch flags are checked against its parser


@dataclass(frozen=True)
class TrainerSection:
    """``[trainer]``: the GRPO learner on a LoRA adapter.

    The keys are those of the trainer's config (``training.config.TrainConfig``, which
    ``python -m training --config`` reads), of the same types and with its choice lists; a key left
    out takes the trainer's own default, which lives with the trainer. ``gpus`` sizes the trainer pod
    and is the only key of this table that is not the trainer's (``_check_trainer_keys``).
    """

    backend: str | None = field(default=None, metadata=_key(choices=tuple(BACKENDS)))
    steps: int | None = field(default=None, metadata=_key(POSITIVE))
    learning_rate: float | None = field(default=None, metadata=_key(POSITIVE))
    lora_rank: int | None = field(default=None, metadata=_key(POSITIVE))
    lora_alpha: int | None = field(default=None, metadata=_key(POSITIVE))
    kl_coef: float | None = field(default=None, metadata=_key(NON_NEGATIVE))
    tis_cap: float | None = field(default=None, metadata=_key(POSITIVE, doc="truncated importance-sampling cap"))
    scale_advantages_by_std: bool | None = None
    temperature: float | None = field(default=None, metadata=_key(POSITIVE))
    reward: str | None = field(default=None, metadata=_key(choices=REWARDS,
                                                            doc="the grading score an episode is rewarded with"))
    loss_weighting: str | None = field(default=None, metadata=_key(choices=LOSS_WEIGHTINGS,
                                                                    doc="token: every generated token alike; sequence: every episode"))
    max_groups_per_step: int | None = field(default=None, metadata=_key(
        NON_NEGATIVE, doc="dynamic sampling: groups a step may take to fill it with groups that have reward variance"))
    integrity_gate: str | None = field(default=None, metadata=_key(choices=INTEGRITY_GATES, doc=(
        "an attempt a cheating signal flagged: zero (reward 0), drop (out of its group) or off (its score)")))
    integrity_exempt_signals: tuple[str, ...] | None = field(default=None, metadata=_key(choices=ALL_SIGNALS, doc=(
        "cheating signals that do not gate (evals.signals); [] gates on every signal")))
    max_new_tokens: int | None = field(default=None, metadata=_key(POSITIVE, doc="per model turn"))
    max_turns: int | None = field(default=None, metadata=_key(POSITIVE, doc="per episode"))
    checkpoint_every: int | None = field(default=None, metadata=_key(POSITIVE, doc="steps between checkpoints"))
    seed: int | None = None
    torch_threads: int | None = field(default=None, metadata=_key(POSITIVE))
    publish_streams: int | None = field(default=None, metadata=_key(POSITIVE, doc="parallel HTTP streams"))
    producer_workers: int | None = field(default=None, metadata=_key(NON_NEGATIVE))
    episode_workers: int | None = field(default=None, metadata=_key(POSITIVE, doc="episodes in flight at once"))
    environment: str | None = field(default=None, metadata=_key(doc="harness, or module:function"))
    tensor_parallel_size: int | None = field(default=None, metadata=_key(NON_NEGATIVE, doc=(
        "megatron: GPUs that split one model replica; gpus / tensor_parallel_size replicas train data parallel")))
    gpus: int = field(default=0, metadata=_key(NON_NEGATIVE, doc=(
        "GPUs of the trainer (its pod on Kubernetes): one trainer process per GPU, data parallel")))


# The keys of [trainer] that size the trainer's pod rather than configure the trainer.
TRAINER_POD_KEYS = ("gpus",)


def _check_trainer_keys() -> None:
    """Every ``[trainer]`` key but the pod's is a ``TrainConfig`` field of the same type (optional
    here), so that the plan's trainer table always loads; a key added to one and not the other, or
    retyped, fails at import instead of in a run."""
    config_types = typing.get_type_hints(TrainConfig)
    for name, hint in typing.get_type_hints(TrainerSection).items():
        if name in TRAINER_POD_KEYS:
            continue
        if name not in config_types or hint != config_types[name] | None:
            raise TypeError(f"[trainer] {name}: {hint} is not an optional TrainConfig field "
                            f"({config_types.get(name, 'absent')} in training.config.TrainConfig)")


_check_trainer_keys()


@dataclass(frozen=True)
class AsyncSection:
    """``[async]``: how much work is in flight and how stale it may be when trained on."""

    group_size: int = field(default=8, metadata=_key(POSITIVE, doc="samples per prompt (GRPO group)"))
    # samples per trainer step; the trainer counts groups: groups_per_step = collection_size / group_size
    # (training.config.groups_per_step, the one place the two are related)
    collection_size: int = field(default=48, metadata=_key(POSITIVE, doc="samples per trainer step (whole groups)"))
    async_max_concurrent_samples: int | None = field(default=None, metadata=_key(POSITIVE))
    max_policy_lag: int = field(default=1, metadata=_key(NON_NEGATIVE, doc="adapter versions a sample may lag"))


@dataclass(frozen=True)
class SandboxSection:
    """``[sandbox]``: one sandbox per episode."""

    runtime: str = field(default="auto", metadata=_key(choices=("auto", "runsc", "bwrap", "k8s")))
    cpus: float = field(default=1.0, metadata=_key(POSITIVE, doc="CPUs per sandbox"))
    memory_gib: float = field(default=2.0, metadata=_key(POSITIVE, doc="memory per sandbox"))
    max_sandboxes: int | None = field(default=None, metadata=_key(POSITIVE, doc="default: the producer budget"))
    command_timeout_s: float = field(default=120.0, metadata=_key(POSITIVE))
    image: str | None = field(default=None, metadata=_key(doc=(
        "on Kubernetes, the sandbox pod image of a task that is a folder (the bundled suite, the task stream): "
        "python3, git, tar, pxd at /opt/pxd/pxd.py; its repository is copied in at start")))


@dataclass(frozen=True)
class CurriculumSection:
    """``[curriculum]``: the tasks and their order from the base model's pass rates."""

    tasks: str | None = field(default=None, metadata=_key(doc="task source folder or file (default: the bundled suite)"))
    curriculum_file: str | None = field(default=None, metadata=_key(doc="curriculum.json of difficulty_curriculum"))
    attempts_per_task: int | None = field(default=None, metadata=_key(POSITIVE, doc="k base-model attempts per task"))
    retry_after_steps: int | None = field(default=None, metadata=_key(POSITIVE))
    open_hard_after_steps: int | None = field(default=None, metadata=_key(NON_NEGATIVE))
    task_stream: bool | None = field(default=None, metadata=_key(
        doc="RL draws tasks generated and validated as the run goes, each new to it (bundled suite only)"))


@dataclass(frozen=True)
class KubernetesSection:
    """``[kubernetes]``: where ``posttrain run --target k8s`` puts the run."""

    namespace: str = "posttrain"
    image: str = field(default="posttrain:latest", metadata=_key(doc="image with this package installed"))
    volume_gib: int = field(default=200, metadata=_key(POSITIVE, doc="size of the shared run volume"))
    storage_class: str | None = None
    volume_claim: str | None = field(default=None, metadata=_key(doc=(
        "an existing ReadWriteMany claim the run's pods mount instead of a volume of the run's own: several "
        "runs, and the Dagster storage root (a mount of it), on one volume")))
    service_account: str | None = None
    priority_class: str | None = field(default=None, metadata=_key(doc="priorityClassName of every pod of the run"))
    keep_fleet: bool = field(default=False, metadata=_key(
        doc="rl_run leaves the engines, router and sandbox pool running when the trainer ends (false: deleted with it)"))
    node_cpus: float | None = field(default=None, metadata=_key(POSITIVE, doc=(
        "allocatable CPUs of the node the run's pods share: the planner sizes every pod's requests to fit it "
        "(with node_memory_gib; unset: the fixed requests of a GPU cluster's pods)")))
    node_memory_gib: float | None = field(default=None, metadata=_key(POSITIVE, doc=(
        "allocatable memory of that node, GiB")))


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: how each checkpoint of the run is evaluated. The checkpoint sensor's evaluations,
    the demo's, ``posttrain backfill`` and ``posttrain eval`` read it; the ``deepswe_eval`` asset's
    config has the same keys and these defaults (``assets.evals.DeepSWEEvalConfig``)."""

    dataset: str = field(default="bundled", metadata=_key(doc=(
        "bundled (the generated suite), a task source, or a Harbor dataset folder such as DeepSWE's tasks/")))
    sources: str | None = field(default=None, metadata=_key(doc=(
        "folder of repository sources a Harbor dataset's images are built from (git folders or bundles)")))
    task_ids: tuple[str, ...] = field(default=(), metadata=_key(doc="task ids to evaluate; [] evaluates every one"))
    split: str = field(default="eval", metadata=_key(doc=(
        "the split evaluated: eval (held out), train, or all; a Harbor task without a split counts as held out")))
    attempts: int = field(default=8, metadata=_key(POSITIVE, doc="attempts per task (the k of pass@k)"))
    max_turns: int = field(default=4, metadata=_key(POSITIVE, doc="model turns per attempt"))
    max_new_tokens: int = field(default=48, metadata=_key(POSITIVE, doc="tokens per model turn"))
    temperature: float = field(default=1.0, metadata=_key(NON_NEGATIVE))
    seed: int = field(default=0, metadata=_key(NON_NEGATIVE))
    workers: int = field(default=2, metadata=_key(POSITIVE, doc="attempts run at once"))
    sandbox_runtime: str = field(default="bwrap", metadata=_key(choices=("bwrap", "gvisor")))
    network: bool = field(default=True, metadata=_key(doc=(
        "a Harbor image built for the eval may reach the package registries (with the benchmark's date cutoff)")))
    environment_check: bool = field(default=True, metadata=_key(doc=(
        "run each Harbor task's reference solution once per image, so that strict credit spares the "
        "existing tests it fails here")))
    max_infra_error_share: float = field(default=0.1, metadata=_key(FRACTION, doc=(
        "share of attempts lost to the infrastructure above which the eval's check fails")))


def parse_eval_table(table: Any, source: str) -> EvalSection:
    """An ``[eval]`` table (from a run file, a plan, or command-line options) validated into an
    :class:`EvalSection`; ``PlanError`` naming ``source`` and each offending key."""
    problems: list[str] = []
    if isinstance(table, Mapping):  # a plan writes the keys left unset as null
        table = {key: value for key, value in table.items() if value is not None}
    section, _ = _parse_section(EvalSection, table, "eval", source, problems)
    if problems:
        raise PlanError(problems)
    return section


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


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _convert(value: Any, hint: Any) -> tuple[Any, str | None]:
    """Convert a TOML value to ``hint``; return (value, None) or (None, what was expected)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0])
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, "true or false")
    if hint is int:
        return (value, None) if isinstance(value, int) and not isinstance(value, bool) else (None, "an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value), None
        return None, "a number"
    if hint is str:
        return (value, None) if isinstance(value, str) and value else (None, "a non-empty string")
    if typing.get_origin(hint) is tuple and args[0] is str:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            return None, "a list of names"
        return tuple(value), None
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not value:
            return None, "a non-empty list of integers"
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return None, "a non-empty list of integers"
        return tuple(value), None
    raise TypeError(f"unsupported field type {hint!r}")  # a bug in this module, not in the file


def _check(value: Any, meta: Mapping[str, Any]) -> str | None:
    check, choices = meta.get("check"), meta.get("choices")
    values = value if isinstance(value, tuple) else (value,)
    if check == POSITIVE and any(v <= 0 for v in values):
        return "a positive value" if len(values) == 1 else "positive values"
    if check == NON_NEGATIVE and any(v < 0 for v in values):
        return "a value of 0 or more"
    if check == FRACTION and not 0 < value <= 1:
        return "a fraction in (0, 1]"
    if choices and any(v not in choices for v in values):
        return ("names among " if isinstance(value, tuple) else "one of ") + ", ".join(repr(c) for c in choices)
    return None


def _parse_section(cls: type, table: Any, section: str, source: str, problems: list[str]) -> tuple[Any, set[str]]:
    explicit: set[str] = set()
    if not isinstance(table, dict):
        problems.append(f"{source}: [{section}] must be a table, got {_describe(table)}")
        return cls(), explicit
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{source}: [{section}] {key}: unknown key; [{section}] takes: {known}")
            continue
        value, expected = _convert(raw, hints[key])
        if expected is None:
            expected = _check(value, fields[key].metadata)
        if expected is not None:
            problems.append(f"{source}: [{section}] {key}: expected {expected}, got {_describe(raw)}")
            continue
        values[key] = value
        explicit.add(f"{section}.{key}")
    return cls(**values), explicit


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
        value, keys = _parse_section(cls, data.get(section, {}), section, source, problems)
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
