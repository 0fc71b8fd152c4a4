"""The trainer's settings: one frozen dataclass, parsed once from a mapping (the resolved run plan's
``trainer`` table, or JSON), with errors that name the key.

Each key is declared once, here: :class:`TrainConfig` and the loss settings it holds whole
(:class:`LossConfig`, handed to the loss as one object). A field declared with
``sandboxes.settings.setting`` (its constraint, choices and meaning) is a key of the run file's
``[trainer]`` table, which the run planner makes from these fields (``training.planner.schema``);
the loss's keys sit in ``[trainer]`` and in the trainer's JSON flat, under their run-file names
(``tis_cap``, ``kl_coef``, ``loss_weighting``, ``scale_advantages_by_std``)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from evals.signals import ALL_SIGNALS
from sandboxes.settings import NON_NEGATIVE, POSITIVE, check, key_name, setting


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
class LossConfig:
    """Every setting of the GRPO objective (``training.grpo``), declared here only, as one object:
    the trainer config holds it whole (``TrainConfig.loss``), the loop hands it to
    ``training.grpo.batch_from_groups`` and to each backend's ``train_step``, which passes it to
    ``training.grpo.grpo_loss``. A backend holds the model and optimizer only. It lives in this
    module, not beside the loss, because the run planner reads these fields and must not import torch.

    ``tis_cap``: the truncated importance weight's cap; ``kl_coef``: beta of the KL term to the
    reference policy (0: none, and the reference is not computed); ``weighting`` (run-file key
    ``loss_weighting``, one of :data:`LOSS_WEIGHTINGS`): how the loss weighs episodes, see
    ``training.grpo.batch_from_groups``; ``scale_advantages_by_std``: divide each group's advantages
    by its reward std."""

    tis_cap: float = field(default=2.0, metadata=setting(POSITIVE, doc="truncated importance-sampling cap"))
    kl_coef: float = field(default=0.0, metadata=setting(NON_NEGATIVE, doc=(
        "beta of the k3 KL term to the base model (0: none, and the reference is not computed)")))
    # how the policy-gradient loss weighs episodes (LOSS_WEIGHTINGS): "token", every
    # generated token alike; "sequence", every episode alike, however many turns it took
    weighting: str = field(default="token", metadata=setting(
        choices=LOSS_WEIGHTINGS, key="loss_weighting", doc="token: every generated token alike; sequence: every episode"))
    scale_advantages_by_std: bool = field(default=False, metadata=setting(
        doc="divide each group's advantages by its reward std"))

    def __post_init__(self) -> None:
        if self.weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss weighting {self.weighting!r}: expected one of {', '.join(LOSS_WEIGHTINGS)}")


# The loss's keys in [trainer] and in the trainer's JSON -> the LossConfig field each sets.
LOSS_FIELDS = {key_name(f): f for f in dataclasses.fields(LossConfig)}
LOSS_KEYS = {key: f.name for key, f in LOSS_FIELDS.items()}


@dataclass(frozen=True)
class TrainConfig:
    """Every trainer key, with its default written here only: the trainer backends' keyword
    arguments named in :data:`BACKEND_KEYS` (training.backends) default to these. A field with
    ``setting`` metadata is a ``[trainer]`` key of the run file; ``loss`` is the loss's settings,
    read as ``cfg.loss.<field>`` only; their keys sit flat in ``[trainer]`` and in the trainer's JSON
    (:data:`LOSS_KEYS`), parsed by :meth:`from_mapping` and written by :meth:`to_json`."""

    run_name: str = "demo"
    base_model: str = ""  # a Hugging Face model folder
    backend: str = field(default="torch_peft", metadata=setting(choices=tuple(BACKENDS)))
    recompute: str = "none"  # what backward recomputes: none, full, attention_output (training.recompute)
    device: str = ""  # where the backend trains (cpu, cuda, cuda:N); empty: the backend's default
    dtype: str = ""  # the backend's weight dtype (float32, bfloat16, float16); empty: the backend's default
    # megatron only: trainer processes (GPUs) that split one model replica; the processes form
    # processes / tensor_parallel_size data-parallel replicas (training.backends.parallel). 0: all of
    # them, one replica. The torch/peft backend has one process per replica.
    tensor_parallel_size: int = field(default=0, metadata=setting(NON_NEGATIVE, doc=(
        "megatron: GPUs that split one model replica; gpus / tensor_parallel_size replicas train data parallel")))
    steps: int = field(default=44, metadata=setting(POSITIVE))
    groups_per_step: int = 6  # whole groups the trainer takes per step (from a run file: groups_per_step())
    # Dynamic sampling: a step goes on taking groups until groups_per_step of them have reward variance
    # (a group whose episodes all scored alike has no gradient), or it has taken this many; 0: off, a
    # step takes groups_per_step groups whatever their rewards (training.loop.RunState.take)
    max_groups_per_step: int = field(default=0, metadata=setting(NON_NEGATIVE, doc=(
        "dynamic sampling: groups a step may take to fill it with groups that have reward variance")))
    group_size: int = 8  # samples per task per group
    max_policy_lag: int = 1  # a group sampled by adapter version v is used at steps <= v + 1 + lag
    # threads running groups; 0 = synchronous (deterministic, for tests)
    producer_workers: int = field(default=2, metadata=setting(NON_NEGATIVE))
    # episodes in flight at once across the producers (each a model call or a sandbox)
    episode_workers: int = field(default=4, metadata=setting(POSITIVE, doc="episodes in flight at once"))
    checkpoint_every: int = field(default=11, metadata=setting(POSITIVE, doc="steps between checkpoints"))
    lora_rank: int = field(default=16, metadata=setting(POSITIVE))
    lora_alpha: int = field(default=32, metadata=setting(POSITIVE))
    learning_rate: float = field(default=2e-3, metadata=setting(POSITIVE))
    loss: LossConfig = field(default=LossConfig(), metadata=setting(doc="the loss's settings, flat in [trainer]"))
    temperature: float = field(default=1.0, metadata=setting(POSITIVE))
    reward: str = field(default="reward", metadata=setting(choices=REWARDS, doc="the grading score an episode is rewarded with"))
    # one of INTEGRITY_GATES: what happens to an attempt that a gating cheating signal flagged
    integrity_gate: str = field(default="zero", metadata=setting(choices=INTEGRITY_GATES, doc=(
        "an attempt a cheating signal flagged: zero (reward 0), drop (out of its group) or off (its score)")))
    # The signals (evals.signals.ALL_SIGNALS) that do not gate; every other one does, a signal added
    # to evals later included. Only spawns_processes by default: a genuine fix may well run a
    # subprocess or kill a child process (the rule matches `subprocess`, `system(`, `kill(`), while
    # every other signal names something a fix of the task's code has no reason to do (edit the
    # tests or their config, patch the test framework, sys.modules, builtins or interpreter frames,
    # end the process with os._exit, compare equal to anything, break the results stream's rules;
    # report_rewritten now means the report files disagree with what the tests reported).
    integrity_exempt_signals: tuple[str, ...] = field(default=("spawns_processes",), metadata=setting(choices=ALL_SIGNALS, doc=(
        "cheating signals that do not gate (evals.signals); [] gates on every signal")))
    reuse_grading: bool = True  # grade an identical patch of a task once (its tests must be deterministic)
    max_new_tokens: int = field(default=48, metadata=setting(POSITIVE, doc="per model turn"))
    max_turns: int = field(default=4, metadata=setting(POSITIVE, doc="per episode"))
    seed: int = field(default=0, metadata=setting())
    torch_threads: int = field(default=1, metadata=setting(POSITIVE))
    publish_streams: int = field(default=4, metadata=setting(POSITIVE, doc="parallel HTTP streams"))
    tasks: str = ""  # the bundled suite folder (or any task source evals can load)
    curriculum: str = ""  # curriculum.json from the difficulty_curriculum asset
    task_stream: bool = False  # RL draws tasks generated as the run goes (training.curriculum.TaskStream)
    # the group runner: harness (evals agent harness) or a registered name
    environment: str = field(default="harness", metadata=setting(doc="harness, or module:function"))
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
    def keys(cls) -> set[str]:
        """Every key of the trainer's JSON (what :meth:`from_mapping` takes): the fields, the loss's flat."""
        return {f.name for f in dataclasses.fields(cls) if f.name != "loss"} | set(LOSS_KEYS)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "trainer config") -> "TrainConfig":
        """A config from flat trainer keys (the loss's among them, :data:`LOSS_KEYS`), each checked."""
        fields = cls.keys()
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"{source}: unknown key {unknown[0]!r}; expected one of {', '.join(sorted(fields))}")
        values: dict[str, Any] = {}
        loss: dict[str, Any] = {}
        default, default_loss = cls(), LossConfig()
        for key, value in data.items():
            want = type(getattr(default_loss, LOSS_KEYS[key]) if key in LOSS_KEYS else getattr(default, key))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if want is tuple:  # a list of names (JSON has lists)
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                    raise ValueError(f"{source}: key {key!r} must be a list of strings, got {value!r}")
                value = tuple(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{source}: key {key!r} must be {want.__name__}, got {value!r}")
            if key in LOSS_KEYS:  # checked as the loss declares it, as the planner checks [trainer]
                choices = LOSS_FIELDS[key].metadata["choices"]  # LOSS_WEIGHTINGS
                if choices and value not in choices:
                    raise ValueError(f"{source}: key {key!r} must be one of {', '.join(choices)}, got {value!r}")
                expected = check(value, LOSS_FIELDS[key].metadata)  # tis_cap > 0, kl_coef >= 0
                if expected is not None:
                    raise ValueError(f"{source}: key {key!r} must be {expected}, got {value!r}")
                loss[LOSS_KEYS[key]] = value
            else:
                values[key] = value
        config = cls(**values, loss=LossConfig(**loss))
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
        """The config as the flat JSON :meth:`load` reads (the loss's keys beside the others)."""
        data = {key: value for key, value in dataclasses.asdict(self).items() if key != "loss"}
        return {**data, **{key: getattr(self.loss, name) for key, name in LOSS_KEYS.items()}}


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
