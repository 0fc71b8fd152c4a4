"""The run file's sections that only the run planner reads: ``[run]``, ``[model]``, ``[async]``,
``[curriculum]`` and ``[kubernetes]``.

Each section of the run file is declared once, in the package that acts on it, and composed into
the run file by :mod:`training.planner.schema`: ``[eval]`` is ``evals.settings.EvalSection``,
``[inference]`` ``serving.settings.InferenceSection``, ``[sandbox]``
``sandboxes.settings.SandboxSection``, the trainer's and the loss's keys are
``training.config.TrainConfig`` and its ``LossConfig``. The sections here are the planner's own:
``[run]`` and ``[model]`` name the run and size its memory, ``[async]`` sizes the work in flight
and becomes the trainer's group keys, ``[kubernetes]`` becomes the run's manifests, and
``[curriculum]`` the trainer's task keys and the curriculum asset's settings (``resolve``, ``k8s``).
(``[trainer]`` is composed in ``schema`` from the trainer's keys, with ``gpus``, which sizes its pod.)
``None`` means "not set in the file". The vocabulary (constraints, choices, validation) is
``sandboxes.settings``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandboxes.settings import NON_NEGATIVE, POSITIVE, setting

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
class AsyncSection:
    """``[async]``: how much work is in flight and how stale it may be when trained on."""

    group_size: int = field(default=8, metadata=setting(POSITIVE, doc="samples per prompt (GRPO group)"))
    # samples per trainer step; the trainer counts groups: groups_per_step = collection_size / group_size
    # (training.config.groups_per_step, the one place the two are related)
    collection_size: int = field(default=48, metadata=setting(POSITIVE, doc="samples per trainer step (whole groups)"))
    async_max_concurrent_samples: int | None = field(default=None, metadata=setting(POSITIVE))
    max_policy_lag: int = field(default=1, metadata=setting(NON_NEGATIVE, doc="adapter versions a sample may lag"))


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
