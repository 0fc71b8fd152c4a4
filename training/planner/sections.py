"""The run file's sections that the run planner declares: those it alone reads, and ``[trainer]``.

Each section of the run file is declared once, in the package that acts on it, and composed into
the run file by :mod:`training.planner.schema`: ``[eval]`` is ``evals.settings.EvalSection``, the
trainer's and the loss's keys are ``training.config.TrainConfig`` and its ``LossConfig``. The
sections here are the planner's: ``[run]`` and ``[model]`` name the run and size its memory,
``[inference]`` sizes and configures the engine fleet (its SGLang knobs become launch flags and the
engines' pods), ``[async]`` sizes the work in flight and becomes the trainer's group keys,
``[sandbox]`` and ``[kubernetes]`` become the sandbox pool's and the run's manifests, and
``[curriculum]`` the trainer's task keys and the curriculum asset's settings (``resolve``, ``k8s``).
(``[trainer]`` is composed in ``schema`` from the trainer's keys, with ``gpus``, which sizes its pod.)
Their defaults for the inference knobs are the ``generic`` profile's (``presets.GENERIC_DEFAULTS``,
which a preset may own); ``None`` means "not set in the file". The vocabulary (constraints,
choices, validation) is ``sandboxes.settings``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandboxes.settings import FRACTION, NON_NEGATIVE, POSITIVE, setting
from serving.sglang import SGLANG_IMAGE

# The engine servers a replica may run (python -m serving.replica --engine vllm on CPUs, SGLang on GPUs).
ENGINES = ("sglang", "vllm")


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
