"""Resolve a run file to a plan: every engine knob, the memory fit, the async capacity, the advice.

The sizing rules (R is the admission, C the context length):

- ``sglang_max_running_requests`` = R (64 when nothing gives it); ``sglang_cuda_graph_max_bs_decode``
  = R; ``sglang_server_concurrency`` (HTTP permits, transport headroom, not GPU slots) = 2R;
  ``sglang_max_total_tokens`` = R x C (every running request at full context).
- KV bytes per token = 2 x full-attention layers x KV heads x head dim x dtype bytes; recurrent state
  per slot = recurrent layers x heads x product of state dims x dtype bytes; recurrent slots = R with
  radix caching off, 6R (more than 5R) with it on.
- Memory fit: weights + KV pool + state pool <= ``sglang_mem_fraction_static`` x device memory x
  devices per engine. It is a lower bound on the footprint (activations, graphs, LoRA buffers come on
  top), and the plan says so.
- Producer budget (samples in flight) when not given: max(collection, 2 x engines x R), rounded up
  to whole groups.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from sandboxes.k8s import PodSettings
from serving import sglang
from serving.admission import GIB, Geometry
from training.config import TrainConfig, groups_per_step
from training.planner.geometry import resolve_geometry
from training.planner.presets import (
    DATASHEET_GPU_MEMORY_GIB,
    GENERIC_ADMISSION,
    GENERIC_DEFAULTS,
    PRESETS,
    RADIX_RECURRENT_SLOTS_PER_REQUEST,
    Preset,
)
from training.planner.schema import PlanError, RunFile, load_run_file, parse_run_dict

PLAN_FORMAT_VERSION = 1

MEMORY_NOTE = (
    "lower bound: weights + KV pool + recurrent-state pool only; activations, CUDA graphs, LoRA "
    "buffers and allocator slack come on top, so a plan that fits may still need a lower "
    "sglang_mem_fraction_static or fewer tokens, and one that does not fit cannot start"
)


@dataclass(frozen=True)
class Advice:
    """A tip or a warning, with a stable ``code`` that scripts and tests can match."""

    code: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **dict(self.details)}


@dataclass(frozen=True)
class Plan:
    """A resolved run: what ``posttrain plan`` prints and ``posttrain run`` writes as resolved-plan.json."""

    run_file: RunFile
    run_name: str
    geometry: Geometry
    profile: str
    preset: Preset | None
    max_context_length: int
    gpu_memory_gib: float | None
    resolved: Mapping[str, Any]  # every inference knob, after profile and defaults
    knob_sources: Mapping[str, str]  # knob -> "run file" | "preset NAME" | "default" | "derived: ..."
    memory: Mapping[str, Any]
    async_capacity: Mapping[str, Any]
    throughput: Mapping[str, Any]
    tips: tuple[Advice, ...]
    warnings: tuple[Advice, ...]
    pods: Mapping[str, Any] = field(default_factory=dict)  # the Kubernetes requests of each workload's pod

    @property
    def engine(self) -> str:
        """The server of each replica: ``[inference] engine``, else vLLM (its CPU build) for
        ``gpu = "cpu"`` and SGLang on GPUs."""
        return engine_of(self.run_file)

    @property
    def admission(self) -> int:
        return self.resolved["sglang_max_running_requests"]

    @property
    def producer_budget_samples(self) -> int:
        return self.async_capacity["producer_budget_samples"]

    def warning_codes(self) -> list[str]:
        return [w.code for w in self.warnings]

    def tip_codes(self) -> list[str]:
        return [t.code for t in self.tips]

    def local_engine_args(self) -> list[str]:
        """``python -m serving.local_engine`` arguments that this plan sizes (CPU runs)."""
        return [
            "--max-running-requests", str(self.resolved["sglang_max_running_requests"]),
            "--max-total-tokens", str(self.resolved["sglang_max_total_tokens"]),
        ]

    def sglang_knobs(self, model_path: str | None = None) -> dict[str, Any]:
        """The knobs of one SGLang replica, in the shape ``serving.sglang`` takes them."""
        rf = self.run_file
        knobs: dict[str, Any] = {
            "model_path": model_path or rf.model.path or rf.model.name or "MODEL",
            "tp_size": rf.inference.gpus_per_engine,
            "context_length": self.max_context_length,
            "max_lora_rank": rf.trainer.lora_rank or TrainConfig().lora_rank,
        }
        # The HTTP permits are the router's and the producer's to keep, not a server argument.
        knobs.update({k: v for k, v in self.resolved.items() if k != "sglang_server_concurrency"})
        return knobs

    def sglang_server_args(self, model_path: str | None = None) -> list[str]:
        """``python -m sglang.launch_server`` arguments of one engine of this plan."""
        return sglang.sglang_server_args(self.sglang_knobs(model_path))

    def trainer_config(self) -> dict[str, Any]:
        """The ``trainer`` table: the keys of ``python -m training --config``, set or derived here.

        Keys the run file leaves out are left out, so the trainer's own defaults apply.
        """
        rf = self.run_file
        table = {k: v for k, v in _section_json(rf.trainer).items() if v is not None and k != "gpus"}
        table["run_name"] = self.run_name
        if rf.model.path:
            table["base_model"] = rf.model.path
        table["group_size"] = rf.async_.group_size
        table["groups_per_step"] = groups_per_step(rf.async_.collection_size, rf.async_.group_size)
        table["max_policy_lag"] = rf.async_.max_policy_lag
        if rf.curriculum.tasks:
            table["tasks"] = rf.curriculum.tasks
        if rf.curriculum.curriculum_file:
            table["curriculum"] = rf.curriculum.curriculum_file
        if rf.curriculum.task_stream:
            table["task_stream"] = True
        if rf.sandbox.runtime != "auto":  # the trainer's names for the sandbox runtimes
            table["sandbox_runtime"] = {"runsc": "gvisor"}.get(rf.sandbox.runtime, rf.sandbox.runtime)
        if rf.trainer.gpus:  # the trainer's processes train on the GPUs they are given
            table["device"] = "cuda"
        return table

    def to_json(self) -> dict[str, Any]:
        rf = self.run_file
        return {
            "plan_format_version": PLAN_FORMAT_VERSION,
            "run": {"name": self.run_name, "run_file": rf.source, "dir": rf.run.dir},
            "model": {"name": rf.model.name, "path": rf.model.path, "family": rf.model.family,
                      "geometry": self.geometry.to_json()},
            "inference": {
                "profile": self.profile,
                "engines": rf.inference.engines,
                "gpu": rf.inference.gpu,
                "engine": self.engine,
                "gpus_per_engine": rf.inference.gpus_per_engine,
                "gpu_memory_gib": self.gpu_memory_gib,
                "max_context_length": self.max_context_length,
                "resolved": dict(self.resolved),
                "sources": dict(self.knob_sources),
                "sglang_server_args": self.sglang_server_args() if rf.inference.gpu != "cpu" else None,
                "local_engine_args": self.local_engine_args() if rf.inference.gpu == "cpu" else None,
                "sglang_image": rf.inference.sglang_image,
            },
            "trainer": self.trainer_config(),
            "trainer_pod": {"gpus": rf.trainer.gpus},
            "async": {**_section_json(rf.async_), "async_max_concurrent_samples": self.producer_budget_samples},
            "sandbox": {**_section_json(rf.sandbox),
                        "max_sandboxes": rf.sandbox.max_sandboxes or self.producer_budget_samples},
            "curriculum": _section_json(rf.curriculum),
            "kubernetes": {**_section_json(rf.kubernetes), "pods": json.loads(json.dumps(self.pods))},
            "eval": _section_json(rf.eval),
            "runtime": {
                "memory": dict(self.memory),
                "async_capacity": dict(self.async_capacity),
                "throughput": dict(self.throughput),
            },
            "inference_profile": {
                "name": self.profile,
                "preset": None if self.preset is None else {
                    "name": self.preset.name, "model_family": self.preset.model_family, "gpu": self.preset.gpu,
                    "gpus_per_engine": self.preset.gpus_per_engine, "knobs": dict(self.preset.knobs),
                    "geometry": None if self.preset.geometry is None else dict(self.preset.geometry),
                    "decode_tokens_per_s_per_engine": self.preset.decode_tokens_per_s_per_engine,
                    "source": self.preset.source,
                },
                "tips": [t.to_json() for t in self.tips],
                "warnings": [w.to_json() for w in self.warnings],
            },
        }  # fmt: skip

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _section_json(section: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(section).items()}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def resolve(run: str | os.PathLike[str] | Mapping[str, Any] | RunFile, *, source: str | None = None) -> Plan:
    """Resolve a run file (a path, a mapping shaped like the TOML, or a parsed ``RunFile``) to a Plan.

    Raises ``PlanError`` whose ``problems`` name the file and the keys when the file cannot be planned.
    """
    if isinstance(run, RunFile):
        rf = run
    elif isinstance(run, Mapping):
        rf = parse_run_dict(run, source=source or "<dict>")
    else:
        rf = load_run_file(run)
    src = rf.source
    inf, asy = rf.inference, rf.async_
    geometry = resolve_geometry(rf.model, src)
    tips: list[Advice] = []
    warnings: list[Advice] = []
    problems: list[str] = []

    # --- the profile: a preset applied whole, or the generic defaults ------------------------------
    preset: Preset | None = None
    if inf.profile != "generic":
        preset = PRESETS.get(inf.profile)
        if preset is None:
            names = ", ".join(["generic", *sorted(PRESETS)])
            raise PlanError([f"{src}: [inference] profile: no profile {inf.profile!r}; profiles: {names}"])
        _check_preset_applies(rf, preset, geometry, warnings)

    try:
        step_groups = groups_per_step(asy.collection_size, asy.group_size)
    except ValueError as exc:
        problems.append(f"{src}: [async] {exc}")
    else:
        most = rf.trainer.max_groups_per_step
        if most and most < step_groups:
            problems.append(f"{src}: [trainer] max_groups_per_step: expected 0 (off) or at least the step's "
                            f"{step_groups} groups ([async] collection_size / group_size), got {most}")
    _trainer_replicas(rf, problems, warnings)

    # --- context length ----------------------------------------------------------------------------
    if inf.max_context_length is not None:
        context = inf.max_context_length
    elif geometry.max_position_embeddings is not None:
        context = geometry.max_position_embeddings
    else:
        problems.append(
            f"{src}: [inference] max_context_length: required (no checkpoint config.json gives "
            "max_position_embeddings); it sizes sglang_max_total_tokens = R x C"
        )
        context = 0
    if problems:
        raise PlanError(problems)

    # --- the knobs ---------------------------------------------------------------------------------
    resolved, sources = _resolve_knobs(rf, preset, geometry, context)

    # --- memory ------------------------------------------------------------------------------------
    gpu_memory = inf.gpu_memory_gib
    if gpu_memory is None and inf.gpu in DATASHEET_GPU_MEMORY_GIB:
        gpu_memory = DATASHEET_GPU_MEMORY_GIB[inf.gpu]
        tips.append(Advice(
            "inference_gpu_memory_datasheet",
            f"device memory {gpu_memory:g} GiB is the {inf.gpu} datasheet capacity; set [inference] "
            "gpu_memory_gib to what nvidia-smi reports for an exact fit",
            {"gpu_memory_gib": gpu_memory},
        ))  # fmt: skip
    memory = _memory(rf, geometry, resolved, gpu_memory, warnings)

    # --- async capacity ----------------------------------------------------------------------------
    capacity = _async_capacity(rf, resolved, warnings)

    # --- throughput --------------------------------------------------------------------------------
    per_engine = preset.decode_tokens_per_s_per_engine if preset else None
    throughput = {
        "decode_tokens_per_s_per_engine": per_engine,
        "fleet_decode_tokens_per_s": None if per_engine is None else per_engine * inf.engines,
        "source": (preset.source if preset and per_engine is not None else
                   "no measured decode rate for this model and hardware"),
        "trainer_samples_per_step": asy.collection_size,
        "samples_consumable_within_policy_lag": asy.collection_size * (asy.max_policy_lag + 1),
    }  # fmt: skip
    if per_engine is not None and inf.engines > 1:
        warnings.append(Advice(
            "inference_fleet_extrapolation",
            f"fleet decode rate is {inf.engines} x the rate measured on one engine; a router, uneven "
            "sessions and stragglers make the real fleet slower",
            {"engines": inf.engines},
        ))  # fmt: skip

    # --- advice on the knobs -----------------------------------------------------------------------
    _knob_advice(rf, preset, geometry, resolved, context, tips, warnings)
    if inf.gpu == "cpu":
        tips.append(Advice(
            "inference_local_engine",
            f"gpu = \"cpu\": CPU replicas serve this run (python -m serving.replica: here the engine "
            f"POSTTRAIN_ENGINE names, vLLM's CPU build unless it says local; on Kubernetes [inference] engine = "
            f"{engine_of(rf)!r}); of the knobs they take the admission (and the local engine the token budget): "
            "inference.local_engine_args",
        ))  # fmt: skip

    pods = pod_sizes(rf, geometry, resolved, memory, capacity)

    name = rf.run.name or (Path(src).stem if src != "<dict>" else "run")
    return Plan(
        run_file=rf,
        run_name=name,
        geometry=geometry,
        profile=inf.profile,
        preset=preset,
        max_context_length=context,
        gpu_memory_gib=gpu_memory,
        resolved=resolved,
        knob_sources=sources,
        memory=memory,
        async_capacity=capacity,
        throughput=throughput,
        tips=tuple(tips),
        warnings=tuple(warnings),
        pods=pods,
    )


def engine_of(rf: RunFile) -> str:
    """``[inference] engine``, else ``vllm`` on CPUs and ``sglang`` on GPUs."""
    return rf.inference.engine or ("vllm" if rf.inference.gpu == "cpu" else "sglang")


# --- Kubernetes requests ---------------------------------------------------------------------------
# Memory a vLLM CPU replica holds besides the weights and KV cache it is given (``[inference]
# gpu_memory_gib``): the interpreter with torch and vLLM imported, its engine core and the capture
# front in the same pod. An allowance, not a measurement of one model: docs/kubernetes.md.
VLLM_CPU_RUNTIME_GIB = 3
# The router and the sandbox pool mostly wait on sockets: a tenth of a core each, and 1 GiB (the pool
# adds about 2 MiB per sandbox it may hold: two stream threads and their buffers).
SERVICE_CPUS = 0.1
SERVICE_MEMORY_GIB = 1
POOL_MIB_PER_SANDBOX = 2
# The least a trainer or an engine replica is planned with on a sized node.
MIN_WORKLOAD_CPUS = 0.2
MIN_TRAINER_MEMORY_GIB = 4


def _cpu(cpus: float) -> str:
    return f"{max(1, int(cpus * 1000))}m"


def pod_sizes(rf: RunFile, geometry: Geometry, resolved: Mapping[str, Any], memory: Mapping[str, Any],
              capacity: Mapping[str, Any]) -> dict[str, Any]:
    """The requests of each workload's pod (``trainer``, ``engine`` per replica, ``router``,
    ``sandbox_pool``) and what the sandboxes may ask together, as ``training.planner.k8s`` sets them.

    Without ``[kubernetes] node_cpus``/``node_memory_gib`` these are a GPU cluster's fixed requests
    (4 CPUs and 32 GiB per trainer GPU or engine device, 2 CPUs for the router and the pool). With
    them, the run's pods are planned onto one node of that allocatable size: the sandboxes first
    (the pool's ``max_sandboxes``, each asking ``sandboxes.k8s.PodSettings``' share of its limits),
    then the router and the pool (a tenth of a core, 1 GiB), then each engine replica's memory
    (vLLM: ``gpu_memory_gib`` for weights and KV cache plus ``VLLM_CPU_RUNTIME_GIB``); the trainer
    and the engines split the CPUs left evenly and the trainer takes the memory left. A node too
    small for that is a ``PlanError`` with the sums. Memory limits equal the requests; CPU has no
    limit, so an idle pod's share is used by the others."""
    kube, inf, sbx = rf.kubernetes, rf.inference, rf.sandbox
    engine = engine_of(rf)
    gpus = rf.trainer.gpus
    max_sandboxes = sbx.max_sandboxes or capacity["producer_budget_samples"]
    settings = PodSettings()
    sandboxes = {"count": max_sandboxes,
                 "cpu": _cpu(max_sandboxes * sbx.cpus * settings.cpu_request_fraction),
                 "memory_gib": round(max_sandboxes * sbx.memory_gib * settings.memory_request_fraction, 3)}
    kv_cache_gib = None
    if engine == "vllm":
        # the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB): the plan's pool, at least 1
        kv = memory.get("kv_pool_gib")
        kv_cache_gib = max(1, -(-kv // 1)) if kv is not None else 1
        kv_cache_gib = int(kv_cache_gib)
        engine_memory = VLLM_CPU_RUNTIME_GIB + (inf.gpu_memory_gib if inf.gpu_memory_gib is not None
                                                 else (geometry.weights_gib or 0) + kv_cache_gib)
        engine_memory = int(-(-engine_memory // 1))
    else:
        engine_memory = max(32, 32 * inf.gpus_per_engine)
    pool_memory = max(SERVICE_MEMORY_GIB, -(-max_sandboxes * POOL_MIB_PER_SANDBOX // 1024))
    node_keys = [k for k in ("node_cpus", "node_memory_gib") if getattr(kube, k) is not None]
    if not node_keys:
        return {
            "node": None,
            "trainer": {"cpu": str(max(4, 4 * gpus)), "memory": f"{max(32, 32 * gpus)}Gi"},
            "engine": {"cpu": str(max(4, 4 * inf.gpus_per_engine)) if engine == "sglang" else "2",
                       "memory": f"{engine_memory}Gi", "kv_cache_gib": kv_cache_gib},
            "router": {"cpu": "2", "memory": "4Gi"},
            "sandbox_pool": {"cpu": "2", "memory": f"{max(2, pool_memory)}Gi"},
            "sandboxes": sandboxes,
        }
    src = rf.source
    if len(node_keys) == 1:
        other = "node_memory_gib" if node_keys == ["node_cpus"] else "node_cpus"
        raise PlanError([f"{src}: [kubernetes] {other}: required with {node_keys[0]} (the node's allocatable "
                         "CPUs and memory size every pod together)"])
    if gpus or (engine == "sglang" and inf.gpu != "cpu"):
        raise PlanError([f"{src}: [kubernetes] node_cpus: a sized node plans CPU pods only; this run asks for GPUs "
                         f"([trainer] gpus = {gpus}, [inference] engine = {engine!r}, gpu = {inf.gpu!r})"])
    cpus, mem = kube.node_cpus, kube.node_memory_gib
    sandbox_cpus = max_sandboxes * sbx.cpus * settings.cpu_request_fraction
    left_cpus = cpus - sandbox_cpus - 2 * SERVICE_CPUS
    share = left_cpus / (1 + inf.engines)
    left_memory = mem - sandboxes["memory_gib"] - SERVICE_MEMORY_GIB - pool_memory - inf.engines * engine_memory
    problems = []
    if share < MIN_WORKLOAD_CPUS:
        problems.append(
            f"{src}: [kubernetes] node_cpus: {cpus:g} CPUs leave {max(share, 0):.2f} each to the trainer and "
            f"{inf.engines} engine replica(s) (expected at least {MIN_WORKLOAD_CPUS:g}) after {sandbox_cpus:g} for "
            f"{max_sandboxes} sandboxes ([sandbox] max_sandboxes x cpus x {settings.cpu_request_fraction:g}) and "
            f"{2 * SERVICE_CPUS:g} for the router and the pool; lower [sandbox] max_sandboxes or cpus, or [inference] engines")
    if left_memory < MIN_TRAINER_MEMORY_GIB:
        problems.append(
            f"{src}: [kubernetes] node_memory_gib: {mem:g} GiB leave {left_memory:.2f} GiB to the trainer (expected at "
            f"least {MIN_TRAINER_MEMORY_GIB}) after {inf.engines} x {engine_memory} GiB for the engines, "
            f"{sandboxes['memory_gib']:g} GiB for {max_sandboxes} sandboxes, {SERVICE_MEMORY_GIB} GiB for the router "
            f"and {pool_memory} GiB for the pool; lower [inference] engines or gpu_memory_gib, or [sandbox] max_sandboxes")
    if problems:
        raise PlanError(problems)
    return {
        "node": {"cpus": cpus, "memory_gib": mem},
        "trainer": {"cpu": _cpu(share), "memory": f"{int(left_memory * 1024)}Mi"},
        "engine": {"cpu": _cpu(share), "memory": f"{engine_memory}Gi", "kv_cache_gib": kv_cache_gib},
        "router": {"cpu": _cpu(SERVICE_CPUS), "memory": f"{SERVICE_MEMORY_GIB}Gi"},
        "sandbox_pool": {"cpu": _cpu(SERVICE_CPUS), "memory": f"{pool_memory}Gi"},
        "sandboxes": sandboxes,
    }


def _trainer_replicas(rf: RunFile, problems: list[str], warnings: list[Advice]) -> None:
    """The trainer's GPUs: one process each, ``gpus / tensor_parallel_size`` data-parallel replicas that
    split each step's sequences between them (``training.backends.parallel``)."""
    src, tr, samples = rf.source, rf.trainer, rf.async_.collection_size
    backend = tr.backend or TrainConfig.backend
    processes = max(tr.gpus, 1)
    tp = tr.tensor_parallel_size or (processes if backend == "megatron" else 1)
    if tp > 1 and backend != "megatron":
        problems.append(f"{src}: [trainer] tensor_parallel_size: {tp} with backend {backend!r}, which runs one process "
                        "per model replica; expected 0 or 1 (only megatron splits a model)")
        return
    if processes % tp:
        problems.append(f"{src}: [trainer] tensor_parallel_size: {tp} does not divide the trainer's gpus ({tr.gpus}); "
                        "each data-parallel replica takes tensor_parallel_size GPUs")
        return
    replicas = processes // tp
    if replicas < 2:
        return
    split = f"{replicas} data-parallel trainer replicas ([trainer] gpus = {tr.gpus}" + (
        f", tensor_parallel_size = {tp})" if tp > 1 else ")")
    if samples < replicas:
        problems.append(f"{src}: [async] collection_size: a step's {samples} sequences cannot keep {split} busy; "
                        f"expected at least {replicas}, and a multiple of {replicas} to split them evenly")
    elif samples % replicas:
        few, extra = divmod(samples, replicas)
        warnings.append(Advice(
            "trainer_uneven_shards",
            f"a step's {samples} sequences ([async] collection_size) do not divide across {split}: {extra} train "
            f"{few + 1} sequences a step and {replicas - extra} train {few} (each shard balanced by tokens). The "
            f"step is the one a single GPU would take; the replicas with fewer sequences wait at the gradient "
            f"all-reduce. A collection_size that is a multiple of {replicas} keeps every GPU busy",
            {"sequences_per_step": samples, "replicas": replicas},
        ))  # fmt: skip


def _check_preset_applies(rf: RunFile, preset: Preset, geometry: Geometry, warnings: list[Advice]) -> None:
    src, inf = rf.source, rf.inference
    if preset.gpu != inf.gpu:
        raise PlanError([
            f"{src}: [inference] profile, gpu: preset {preset.name!r} was measured on {preset.gpu!r}, "
            f"this run's gpu is {inf.gpu!r}; a preset is never applied to other hardware. Use "
            f"profile = \"generic\"" + _other_presets(preset.model_family, inf.gpu)
        ])  # fmt: skip
    if preset.gpus_per_engine is not None and preset.gpus_per_engine != inf.gpus_per_engine:
        raise PlanError([
            f"{src}: [inference] profile, gpus_per_engine: preset {preset.name!r} was measured with "
            f"{preset.gpus_per_engine} devices per engine, this run has {inf.gpus_per_engine}"
        ])  # fmt: skip
    family = rf.model.family
    if family is not None and family != preset.model_family:
        raise PlanError([
            f"{src}: [model] family, [inference] profile: preset {preset.name!r} is for model family "
            f"{preset.model_family!r}, this run's model family is {family!r}"
        ])  # fmt: skip
    if family is None:
        warnings.append(Advice(
            "inference_model_guard_deferred",
            f"preset {preset.name!r} is for model family {preset.model_family!r}, and this run file does "
            f"not say which family its model is; the planner cannot check it. Set [model] family = "
            f"\"{preset.model_family}\" to have it checked",
            {"preset": preset.name, "model_family": preset.model_family},
        ))  # fmt: skip
    if preset.geometry:
        differ = [k for k, v in preset.geometry.items() if getattr(geometry, k) is not None and getattr(geometry, k) != v]
        if differ:
            raise PlanError([
                f"{src}: [model] {k}: {getattr(geometry, k)!r}, but preset {preset.name!r} was measured on a "
                f"model with {k} = {preset.geometry[k]!r}" for k in differ
            ])  # fmt: skip
        unknown = [k for k in preset.geometry if getattr(geometry, k) is None]
        if unknown:
            warnings.append(Advice(
                "inference_model_guard_deferred",
                f"preset {preset.name!r} was measured on a model with "
                + ", ".join(f"{k} = {preset.geometry[k]!r}" for k in unknown)
                + "; this model's values are not known here, so they are not checked",
                {"preset": preset.name, "unchecked": unknown},
            ))  # fmt: skip
    owned = [k for k in preset.knobs if rf.is_set("inference", k)]
    if owned:
        raise PlanError(
            [
                f"{src}: [inference] {k}: set, but profile {preset.name!r} owns it (a preset applies whole)"
                for k in owned
            ],
            detail=(
                f"To change a preset's values, plan with the generic profile instead: in [inference], put "
                f"these keys in place of profile and the knobs above, and edit them:\n\n{preset.as_generic_toml()}\n"
            ),
        )


def _geometry_matches(preset: Preset, g: Geometry) -> bool:
    """No pinned geometry key of the preset differs from a known value of the model."""
    return all(getattr(g, k) in (None, v) for k, v in (preset.geometry or {}).items())


def _other_presets(family: str, gpu: str) -> str:
    names = [p.name for p in PRESETS.values() if p.model_family == family and p.gpu == gpu]
    return f", or the preset measured on {gpu}: {', '.join(names)}" if names else ""


def _resolve_knobs(
    rf: RunFile, preset: Preset | None, geometry: Geometry, context: int
) -> tuple[dict[str, Any], dict[str, str]]:
    inf = rf.inference
    resolved: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(key: str, derived: Any, how: str) -> None:
        if preset is not None and key in preset.knobs:
            resolved[key], sources[key] = preset.knobs[key], f"preset {preset.name}"
        elif getattr(inf, key) is not None:
            resolved[key], sources[key] = getattr(inf, key), "run file"
        else:
            resolved[key], sources[key] = derived, how

    take("sglang_max_running_requests", GENERIC_ADMISSION, "default")
    r = resolved["sglang_max_running_requests"]
    take("sglang_cuda_graph_max_bs_decode", r, "derived: R")
    take("sglang_server_concurrency", 2 * r, "derived: 2 x R")
    take("sglang_max_total_tokens", r * context, "derived: R x max_context_length")
    for key, value in GENERIC_DEFAULTS.items():
        take(key, value, "default")
    if geometry.recurrent_layers is None:
        take("sglang_max_mamba_cache_size", None, "unknown: model metadata unavailable")
    elif geometry.recurrent_layers:
        per_request = 1 if resolved["sglang_disable_radix_cache"] else RADIX_RECURRENT_SLOTS_PER_REQUEST
        take("sglang_max_mamba_cache_size", per_request * r,
             "derived: R (radix cache off)" if per_request == 1 else "derived: 6 x R (radix cache on)")
    else:
        take("sglang_max_mamba_cache_size", None, "not applicable: no recurrent layers")
    take("sglang_mamba_scheduler_strategy", None, "engine default")
    # Rollouts keep the adapter version they started with, so up to max_policy_lag + 1 versions are in
    # flight, plus the newest one being loaded.
    take("sglang_max_loras_per_batch", rf.async_.max_policy_lag + 2, "derived: max_policy_lag + 2")
    return resolved, sources


def _memory(
    rf: RunFile, g: Geometry, resolved: Mapping[str, Any], gpu_memory: float | None, warnings: list[Advice]
) -> dict[str, Any]:
    inf = rf.inference
    kv_bytes = g.kv_bytes_per_token
    state_bytes = g.state_bytes_per_slot
    tokens = resolved["sglang_max_total_tokens"]
    slots = resolved["sglang_max_mamba_cache_size"] or 0
    # With more devices than KV heads, tensor parallelism replicates heads: each device keeps one.
    kv_replication = 1.0
    if g.kv_heads and inf.gpus_per_engine > g.kv_heads:
        kv_replication = inf.gpus_per_engine / g.kv_heads
    kv_pool = None if kv_bytes is None else tokens * kv_bytes * kv_replication / GIB
    state_pool = None if state_bytes is None else slots * state_bytes / GIB
    budget = None if gpu_memory is None else resolved["sglang_mem_fraction_static"] * gpu_memory * inf.gpus_per_engine
    total = None
    if g.weights_gib is not None and kv_pool is not None and state_pool is not None:
        total = g.weights_gib + kv_pool + state_pool
    fits = None if total is None or budget is None else total <= budget
    missing = g.missing()
    if missing or g.metadata_problem:
        why = []
        if g.metadata_problem:
            why.append(g.metadata_problem)
        if missing:
            why.append("unknown: " + ", ".join(f"[model] {k}" for k in missing))
        warnings.append(Advice(
            "inference_metadata_unavailable",
            "model metadata is incomplete (" + "; ".join(why) + "); "
            + ("the memory fit is not computed" if missing else "the run file's geometry is used"),
            {"missing": missing},
        ))  # fmt: skip
    if budget is None:
        warnings.append(Advice(
            "inference_gpu_memory_unknown",
            f"the memory fit is not computed: set [inference] gpu_memory_gib (memory of one {inf.gpu} device"
            + (", or the RAM given to the local engine)" if inf.gpu == "cpu" else ")"),
        ))  # fmt: skip
    if fits is False:
        warnings.append(Advice(
            "inference_memory_overcommitted",
            f"weights + KV pool + state pool = {total:.2f} GiB exceed sglang_mem_fraction_static x device "
            f"memory = {budget:.2f} GiB per engine; lower sglang_max_total_tokens, "
            "sglang_max_mamba_cache_size or the admission, or add devices per engine",
            {"total_gib": round(total, 4), "budget_gib": round(budget, 4)},
        ))  # fmt: skip
    return {
        "weights_gib": None if g.weights_gib is None else round(g.weights_gib, 4),
        "kv_bytes_per_token": kv_bytes,
        "kv_tokens": tokens,
        "kv_tokens_per_running_request": tokens // resolved["sglang_max_running_requests"],
        "kv_head_replication": kv_replication,
        "kv_pool_gib": None if kv_pool is None else round(kv_pool, 4),
        "state_bytes_per_slot": state_bytes,
        "state_slots": slots,
        "state_pool_gib": None if state_pool is None else round(state_pool, 4),
        "total_gib": None if total is None else round(total, 4),
        "budget_gib": None if budget is None else round(budget, 4),
        "fits": fits,
        "headroom_gib": None if fits is None else round(budget - total, 4),
        "lower_bound": True,
        "note": MEMORY_NOTE,
    }


def _async_capacity(rf: RunFile, resolved: Mapping[str, Any], warnings: list[Advice]) -> dict[str, Any]:
    inf, asy = rf.inference, rf.async_
    r = resolved["sglang_max_running_requests"]
    permits = resolved["sglang_server_concurrency"]
    engine_slots = inf.engines * r
    if asy.async_max_concurrent_samples is not None:
        budget, how = asy.async_max_concurrent_samples, "run file"
    else:
        budget = _round_up(max(asy.collection_size, 2 * engine_slots), asy.group_size)
        how = "derived: max(collection_size, 2 x engines x R), rounded up to whole groups"
    consumable = asy.collection_size * (asy.max_policy_lag + 1)
    if permits < r:
        warnings.append(Advice(
            "inference_http_permits_below_admission",
            f"sglang_server_concurrency = {permits} HTTP permits per engine is below the admission R = {r}; "
            "the engine can never fill its decode batch",
            {"http_permits": permits, "admission": r},
        ))  # fmt: skip
    if budget <= engine_slots:
        warnings.append(Advice(
            "async_budget_one_wave",
            f"producer budget {budget} samples is one wave or less of the fleet's {engine_slots} decode slots "
            f"({inf.engines} engines x R = {r}); engines idle whenever episodes wait on tools or finish. "
            "Let [async] async_max_concurrent_samples default, or raise it",
            {"producer_budget_samples": budget, "engine_slots": engine_slots},
        ))  # fmt: skip
    if budget > consumable:
        warnings.append(Advice(
            "async_budget_exceeds_policy_lag",
            f"producer budget {budget} samples exceeds what the trainer consumes within the policy lag "
            f"({asy.collection_size} per step x (max_policy_lag {asy.max_policy_lag} + 1) = {consumable}); "
            "the surplus comes back too stale and is discarded",
            {"producer_budget_samples": budget, "samples_consumable_within_policy_lag": consumable},
        ))  # fmt: skip
    if budget % asy.group_size:
        warnings.append(Advice(
            "async_budget_partial_group",
            f"async_max_concurrent_samples = {budget} is not a whole number of groups of {asy.group_size}",
        ))  # fmt: skip
    return {
        "engines": inf.engines,
        "engine_slots": engine_slots,
        "http_permits": inf.engines * permits,
        "http_permits_per_engine": permits,
        "producer_budget_samples": budget,
        "producer_budget_source": how,
        "groups_in_flight": budget // asy.group_size,
    }


def _knob_advice(
    rf: RunFile,
    preset: Preset | None,
    g: Geometry,
    resolved: Mapping[str, Any],
    context: int,
    tips: list[Advice],
    warnings: list[Advice],
) -> None:
    inf = rf.inference
    r = resolved["sglang_max_running_requests"]
    family = rf.model.family
    if preset is None and family is not None:
        same_family = [p for p in PRESETS.values() if p.model_family == family]
        matching = [
            p for p in same_family
            if p.gpu == inf.gpu and p.gpus_per_engine in (None, inf.gpus_per_engine) and _geometry_matches(p, g)
        ]  # fmt: skip
        if matching:
            names = ", ".join(p.name for p in matching)
            tips.append(Advice(
                "inference_profile_available",
                f"a measured preset matches this model family, hardware and topology: {names}. Set "
                f"[inference] profile = \"{matching[0].name}\" (and drop the knobs it owns) to use it; "
                "nothing was changed",
                {"presets": [p.name for p in matching]},
            ))  # fmt: skip
        elif same_family:
            where = ", ".join(f"{p.name} ({p.gpu})" for p in same_family)
            warnings.append(Advice(
                "inference_pool_hardware_mismatch",
                f"presets exist for model family {family!r} only on other hardware: {where}; their "
                f"numbers do not carry over to {inf.gpu!r}, so this plan uses the generic defaults",
                {"presets": [p.name for p in same_family]},
            ))  # fmt: skip
    slots = resolved["sglang_max_mamba_cache_size"]
    radix_on = not resolved["sglang_disable_radix_cache"]
    if g.recurrent_layers and slots is not None:
        if not radix_on and slots < r:
            warnings.append(Advice(
                "inference_recurrent_slots_short",
                f"sglang_max_mamba_cache_size = {slots} recurrent-state slots is below R = {r}; the engine "
                "cannot run R requests at once",
                {"slots": slots, "admission": r},
            ))  # fmt: skip
        if radix_on and slots <= 5 * r:
            warnings.append(Advice(
                "inference_recurrent_slots_short",
                f"sglang_max_mamba_cache_size = {slots} recurrent-state slots with radix caching on should "
                f"exceed 5 x R = {5 * r}: cached prefixes keep state copies beside the running requests",
                {"slots": slots, "admission": r},
            ))  # fmt: skip
    if g.recurrent_layers == 0 and (
        inf.sglang_max_mamba_cache_size is not None or inf.sglang_mamba_scheduler_strategy is not None
    ):
        warnings.append(Advice(
            "inference_knob_not_applicable",
            "sglang_max_mamba_cache_size / sglang_mamba_scheduler_strategy are set but the model has no "
            "recurrent layers; they are ignored",
        ))  # fmt: skip
    tokens = resolved["sglang_max_total_tokens"]
    if tokens < context:
        warnings.append(Advice(
            "inference_kv_pool_below_context",
            f"sglang_max_total_tokens = {tokens} is less than one request at max_context_length = {context}",
            {"kv_tokens": tokens, "max_context_length": context},
        ))  # fmt: skip
    if resolved["sglang_cuda_graph_max_bs_decode"] < r and inf.gpu != "cpu":
        warnings.append(Advice(
            "inference_cuda_graph_below_admission",
            f"sglang_cuda_graph_max_bs_decode = {resolved['sglang_cuda_graph_max_bs_decode']} is below R = {r}; "
            "decode batches larger than it run without CUDA graphs",
        ))  # fmt: skip
    if g.max_position_embeddings is not None and context > g.max_position_embeddings:
        warnings.append(Advice(
            "inference_context_beyond_model",
            f"max_context_length = {context} exceeds the model's max_position_embeddings = "
            f"{g.max_position_embeddings}",
        ))  # fmt: skip
