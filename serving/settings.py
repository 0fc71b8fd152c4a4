"""``[inference]``: the engine fleet of a run and the SGLang knobs that size it, declared once, here,
in the package that serves.

The run planner composes this section into the run file (``training.planner.schema``), fills the
knobs a run file leaves unset from the profile (a preset, or ``training.planner.presets``'
``GENERIC_DEFAULTS``), and turns them into the engines' launch flags and pods
(``serving.sglang``, ``training.planner.k8s``). The key reference (``docs/run-file.md``) is written
from these fields. The vocabulary (constraints, choices, validation) is ``sandboxes.settings``'s;
this module imports nothing of training (``tests/test_layering.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sandboxes.settings import FRACTION, POSITIVE, setting
from serving.sglang import SGLANG_IMAGE

# The engine servers a replica may run (python -m serving.replica --engine vllm on CPUs, SGLang on GPUs).
ENGINES = ("sglang", "vllm")


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
