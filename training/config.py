"""The trainer's settings: one frozen dataclass, parsed once from a mapping (the resolved run plan's
``trainer`` table, or JSON), with errors that name the key."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from evals.signals import ALL_SIGNALS


# The choice lists of the trainer's keys, spelled here only: ``TrainConfig.validate`` checks them and
# the run planner's ``[trainer]`` table (training.planner.schema) offers the same choices.
DTYPES = ("", "float32", "bfloat16", "float16")
# What an episode's reward is, from its grading (evals.grading.Scores): ``reward`` is 1 when every
# target test passes and no existing test breaks, else 0; ``strict_target_score`` is the share of
# target tests passed, 0 as soon as an existing test breaks (partial credit on multi-bug tasks).
REWARDS = ("reward", "strict_target_score")
# The trainer backends by name, and where each lives ("module:Class"); training.backends.load_backend
# imports the one a config names, lazily, so that Megatron is only needed when asked for.
BACKENDS = {
    "torch_peft": "training.backends.torch_peft:TorchPeftBackend",
    "megatron": "training.backends.megatron:MegatronBackend",
}
SANDBOX_RUNTIMES = ("bwrap", "gvisor", "k8s")
# The agent loop of an episode (evals.scaffolds; the same names as evals.harness.SCAFFOLD_NAMES):
# builtin is posttrain's own (token ids through /generate), mini-swe-agent talks the OpenAI chat API.
SCAFFOLDS = ("builtin", "mini-swe-agent")
# The trainer keys that every backend also takes as keyword arguments of the same name: the run's
# backend is built with the run's values (TrainConfig.backend_args) and each backend's defaults for
# them are TrainConfig's.
BACKEND_KEYS = ("lora_rank", "lora_alpha", "learning_rate", "seed", "recompute")
# how the policy-gradient loss weighs episodes (training.grpo.batch_from_groups)
LOSS_WEIGHTINGS = ("token", "sequence")
# What training does with an attempt that a cheating signal (evals.signals) flagged; the integrity
# gate (training.grpo.IntegrityGate) applies it before GRPO advantages: "zero", reward 0, the attempt
# stays in its group as a failure; "drop", out of its group, the others' advantages are computed
# without it; "off", it keeps its score (the signals are still counted in the step metrics).
INTEGRITY_GATES = ("zero", "drop", "off")


def groups_per_step(collection_size: int, group_size: int) -> int:
    """The trainer's ``groups_per_step`` (GRPO groups per optimizer step) from a run file's
    ``[async] collection_size`` (samples per step) and ``group_size`` (samples per group).

    The run file counts samples, the trainer counts groups; this is the one place one is derived from
    the other. A ``collection_size`` that is not whole groups is refused (the trainer takes whole groups).
    """
    groups, rest = divmod(collection_size, group_size)
    if rest:
        raise ValueError(f"collection_size: {collection_size} is not a whole number of groups of group_size = "
                         f"{group_size}; the trainer takes whole groups")
    return groups


@dataclass(frozen=True)
class TrainConfig:
    """Every trainer key, with its default written here only: the loss settings
    (training.grpo.LossConfig) and the trainer backends' keyword arguments named in
    :data:`BACKEND_KEYS` (training.backends) default to these."""

    run_name: str = "demo"
    base_model: str = ""  # a Hugging Face model folder
    backend: str = "torch_peft"
    recompute: str = "none"  # what backward recomputes: none, full, attention_output (training.recompute)
    device: str = ""  # where the backend trains (cpu, cuda, cuda:N); empty: the backend's default
    dtype: str = ""  # the backend's weight dtype (float32, bfloat16, float16); empty: the backend's default
    # megatron only: trainer processes (GPUs) that split one model replica; the processes form
    # processes / tensor_parallel_size data-parallel replicas (training.backends.parallel). 0: all of
    # them, one replica. The torch/peft backend has one process per replica.
    tensor_parallel_size: int = 0
    steps: int = 44
    groups_per_step: int = 6  # whole groups the trainer takes per step (from a run file: groups_per_step())
    # Dynamic sampling: a step goes on taking groups until groups_per_step of them have reward variance
    # (a group whose episodes all scored alike has no gradient), or it has taken this many; 0: off, a
    # step takes groups_per_step groups whatever their rewards (training.loop.RunState.take)
    max_groups_per_step: int = 0
    group_size: int = 8  # samples per task per group
    max_policy_lag: int = 1  # a group sampled by adapter version v is used at steps <= v + 1 + lag
    producer_workers: int = 2  # threads running groups; 0 = synchronous (deterministic, for tests)
    episode_workers: int = 4  # episodes in flight at once across the producers (each a model call or a sandbox)
    checkpoint_every: int = 11
    lora_rank: int = 16
    lora_alpha: int = 32
    learning_rate: float = 2e-3
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    scale_advantages_by_std: bool = False
    # how the policy-gradient loss weighs episodes (LOSS_WEIGHTINGS): "token", every
    # generated token alike; "sequence", every episode alike, however many turns it took
    loss_weighting: str = "token"
    temperature: float = 1.0
    reward: str = "reward"  # one of REWARDS: the grading score an episode is rewarded with
    # one of INTEGRITY_GATES: what happens to an attempt that a gating cheating signal flagged
    integrity_gate: str = "zero"
    # The signals (evals.signals.ALL_SIGNALS) that do not gate; every other one does, a signal added
    # to evals later included. Only spawns_processes by default: a genuine fix may well run a
    # subprocess or kill a child process (the rule matches `subprocess`, `system(`, `kill(`), while
    # every other signal names something a fix of the task's code has no reason to do (edit the
    # tests or their config, patch the test framework, sys.modules, builtins or interpreter frames,
    # end the process with os._exit, compare equal to anything, break the results stream's rules;
    # report_rewritten now means the report files disagree with what the tests reported).
    integrity_exempt_signals: tuple[str, ...] = ("spawns_processes",)
    reuse_grading: bool = True  # grade an identical patch of a task once (its tests must be deterministic)
    max_new_tokens: int = 48
    max_turns: int = 4
    seed: int = 0
    torch_threads: int = 1
    publish_streams: int = 4
    tasks: str = ""  # the bundled suite folder (or any task source evals can load)
    curriculum: str = ""  # curriculum.json from the difficulty_curriculum asset
    task_stream: bool = False  # RL draws tasks generated as the run goes (training.curriculum.TaskStream)
    environment: str = "harness"  # the group runner: harness (evals agent harness) or a registered name
    replicas: int = 1  # local engine replicas; more than 1 run behind the router, and one that dies is replaced
    engine_max_total_tokens: int = 0  # each local replica's KV token budget (0: the engine's default)
    engine_max_running_requests: int = 0  # each local replica's admission (0: the engine's default)
    # episodes in a row lost to the infrastructure (after their retries) that stop the run; fewer only
    # drop their groups (training.loop)
    max_consecutive_infra_failures: int = 20
    take_timeout_s: float = 3600.0  # how long the trainer waits for a step's groups before it stops the run
    # where episodes run: bwrap or gvisor on this machine, k8s through the cluster's sandbox pool
    # (python -m sandboxes.pool, reached at $POSTTRAIN_SANDBOX_POOL_URL)
    sandbox_runtime: str = "bwrap"
    scaffold: str = "builtin"  # one of SCAFFOLDS: the agent loop of each episode

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "trainer config") -> "TrainConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown key {unknown[0]!r}; expected one of {', '.join(sorted(fields))}")
        values: dict[str, Any] = {}
        for key, value in data.items():
            want = type(getattr(cls(), key))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if want is tuple:  # a list of names (JSON has lists)
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                    raise ValueError(f"{source}: key {key!r} must be a list of strings, got {value!r}")
                value = tuple(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{source}: key {key!r} must be {want.__name__}, got {value!r}")
            values[key] = value
        config = cls(**values)
        config.validate(source)
        return config

    def validate(self, source: str = "trainer config") -> None:
        for key in ("steps", "groups_per_step", "group_size", "checkpoint_every", "lora_rank", "max_new_tokens", "max_turns"):
            if getattr(self, key) < 1:
                raise ValueError(f"{source}: key {key!r} must be >= 1, got {getattr(self, key)}")
        if self.max_groups_per_step and self.max_groups_per_step < self.groups_per_step:
            raise ValueError(f"{source}: key 'max_groups_per_step' must be 0 (off) or at least groups_per_step "
                             f"({self.groups_per_step}), got {self.max_groups_per_step}")
        if self.episode_workers < 1:
            raise ValueError(f"{source}: key 'episode_workers' must be >= 1, got {self.episode_workers}")
        if self.replicas < 1:
            raise ValueError(f"{source}: key 'replicas' must be >= 1, got {self.replicas}")
        if self.max_consecutive_infra_failures < 1:
            raise ValueError(f"{source}: key 'max_consecutive_infra_failures' must be >= 1, "
                             f"got {self.max_consecutive_infra_failures}")
        if not self.take_timeout_s > 0:
            raise ValueError(f"{source}: key 'take_timeout_s' must be > 0 seconds, got {self.take_timeout_s}")
        for key in ("max_policy_lag", "producer_workers", "engine_max_total_tokens", "engine_max_running_requests"):
            if getattr(self, key) < 0:
                raise ValueError(f"{source}: key {key!r} must be >= 0, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ValueError(f"{source}: key 'group_size' must be >= 2 (advantages are relative within a group)")
        if not self.base_model:
            raise ValueError(f"{source}: key 'base_model' is required (a Hugging Face model folder)")
        from training.recompute import RECOMPUTE_MODES  # here: it imports torch, and the run planner reads this module

        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"{source}: key 'recompute' must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.device and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"{source}: key 'device' must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"{source}: key 'backend' must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"{source}: key 'reward' must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"{source}: key 'loss_weighting' must be one of {', '.join(LOSS_WEIGHTINGS)}, "
                             f"got {self.loss_weighting!r}")
        if self.integrity_gate not in INTEGRITY_GATES:
            raise ValueError(f"{source}: key 'integrity_gate' must be one of {', '.join(INTEGRITY_GATES)}, "
                             f"got {self.integrity_gate!r}")
        unknown = [s for s in self.integrity_exempt_signals if s not in ALL_SIGNALS]
        if unknown:
            raise ValueError(f"{source}: key 'integrity_exempt_signals': {unknown[0]!r} is not a cheating signal; "
                             f"expected names from {', '.join(ALL_SIGNALS)}")
        if self.scaffold not in SCAFFOLDS:
            raise ValueError(f"{source}: key 'scaffold' must be one of {', '.join(SCAFFOLDS)}, got {self.scaffold!r}")
        if self.sandbox_runtime not in SANDBOX_RUNTIMES:
            raise ValueError(f"{source}: key 'sandbox_runtime' must be one of {', '.join(SANDBOX_RUNTIMES)}, "
                             f"got {self.sandbox_runtime!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{source}: key 'dtype' must be one of {', '.join(d for d in DTYPES if d)}, got {self.dtype!r}")
        if self.tensor_parallel_size < 0 or (self.tensor_parallel_size > 1 and self.backend != "megatron"):
            raise ValueError(f"{source}: key 'tensor_parallel_size' must be 0 or 1 with backend {self.backend!r} (one "
                             f"process per model replica; only megatron splits a model), got {self.tensor_parallel_size}")

    def backend_args(self) -> dict[str, Any]:
        """The keyword arguments the run's backend is built with (``training.backends.load_backend``):
        the base model, the :data:`BACKEND_KEYS` and the placement the config sets."""
        return {"model_path": self.base_model, **{key: getattr(self, key) for key in BACKEND_KEYS},
                **self.backend_placement()}

    def backend_placement(self) -> dict[str, Any]:
        """The ``device``/``dtype`` (and megatron's ``tensor_parallel_size``) keyword arguments for the
        backend: only those the config sets."""
        keys = ("device", "dtype") + (("tensor_parallel_size",) if self.backend == "megatron" else ())
        return {key: getattr(self, key) for key in keys if getattr(self, key)}

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"trainer config {path} is missing")
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"trainer config {path}: not UTF-8 text (byte {exc.start}); expected a JSON object "
                             "of trainer keys (or a resolved run plan)") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"trainer config {path}: not valid JSON: {exc}; expected a JSON object of trainer "
                             "keys (or a resolved run plan)") from exc
        if not isinstance(data, dict):
            raise ValueError(f"trainer config {path}: a JSON {type(data).__name__}; expected a JSON object of "
                             "trainer keys (or a resolved run plan)")
        if "trainer" in data and isinstance(data["trainer"], dict):
            data = {**_local_engine_keys(data.get("inference")), **data["trainer"]}
        return cls.from_mapping(data, str(path))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LOCAL_ENGINE_FLAGS = {"--max-total-tokens": "engine_max_total_tokens", "--max-running-requests": "engine_max_running_requests"}


def _local_engine_keys(inference: Any) -> dict[str, Any]:
    """A resolved plan's local engines as trainer keys: ``inference.engines`` replicas, each started
    with ``inference.local_engine_args`` (set only for ``gpu = "cpu"`` plans, which the local engine serves)."""
    if not isinstance(inference, dict) or not isinstance(inference.get("local_engine_args"), list):
        return {}
    args = inference["local_engine_args"]
    keys: dict[str, Any] = {}
    for flag, value in zip(args[::2], args[1::2]):
        if flag in LOCAL_ENGINE_FLAGS and str(value).isdigit():
            keys[LOCAL_ENGINE_FLAGS[flag]] = int(value)
    if isinstance(inference.get("engines"), int) and not isinstance(inference["engines"], bool):
        keys["replicas"] = inference["engines"]
    return keys
