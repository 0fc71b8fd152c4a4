"""Data parallelism: one trainer process per GPU, each step's sequences split across them.

``python -m training`` started by torchrun runs one process per GPU (the trainer Job and the local
launcher do so when ``[trainer] gpus`` > 1: ``training.planner.runner.trainer_launcher``).
:func:`start_ranks` joins them into one torch.distributed world (NCCL on GPUs, each process on the GPU
of its ``LOCAL_RANK``; gloo on the CPU). Rank 0 runs the RL loop exactly as a single trainer does: the
producers and the fleet, the rollout store, checkpoints, publication. Its backend
(:func:`training.backends.load_backend` returns a :class:`LeadBackend` there) makes every call on the
other ranks too, which do nothing but :func:`follow` it. One step, then:

1. rank 0 takes the step's whole groups and builds the batch (advantages and loss weights need the
   whole step), and sends every rank the whole batch (pickled over a gloo group: a few MB);
2. every rank trains on its shard (:func:`shard_rows`: sequences balanced by tokens), weighting each
   micro-batch by its share of the *whole step's* generated tokens;
3. the LoRA gradients (float32) and the step's loss statistics are summed over the data-parallel ranks
   in one all-reduce (:func:`all_reduce_step`), so every rank holds the gradient one process would
   have computed over the same groups (the argument that makes micro-batching exact), up to the order
   of float32 additions;
4. every rank takes the same optimizer step, so the replicas stay identical.

A rank whose shard is empty (a step with fewer sequences than ranks) takes part in the sum with zero
gradients: that is the padding, and it changes nothing in the result.

Why not DDP or FSDP2: the base weights are frozen and fit on each GPU, so nothing needs sharding, and
the only tensors to reduce are the LoRA gradients, once per step after the last micro-batch (what DDP
does under ``no_sync``). The torch/peft backend computes log-probabilities through the decoder and the
LM head in chunks, not through the module's ``forward`` that DDP hooks. One flat all-reduce per step is
DDP's bucketed all-reduce without the wrapper; its cost is in ``bench/trainer_throughput.py --ranks``.

Checkpoints hold nothing per data-parallel rank: the adapter, its float32 masters and the optimizer
state are the same on every rank, so rank 0 writes them once and any number of ranks resumes from them
(the Megatron backend keeps one optimizer file per tensor-parallel rank, independent of the
data-parallel size). The data cursor (the rollout store, the curriculum, the RNG states) lives with
rank 0 alone, and each step's batch is split anew at whatever world size runs it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from training.backends.batch import StepResult
from training.grpo import LossConfig, TrainBatch

# The methods of the TrainerBackend protocol that rank 0 makes on every rank (training.backends).
LED_METHODS = ("train_step", "adapter_state_dict", "save_adapter", "save_state", "load_state")


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the data-parallel replicas: ``rank`` of ``size``, reducing over
    ``group`` (a torch.distributed process group; ``None``: the whole world)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def of_world(cls) -> "DataParallel":
        """Every process of the torch.distributed world as one replica each; one replica when the
        world is not initialized (a trainer of one process, a test, a benchmark)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()


def shard_rows(batch: TrainBatch, size: int) -> list[list[int]]:
    """Row indices of ``batch`` for each of ``size`` ranks: at most ``ceil(rows / size)`` each, the
    longest sequence first onto the rank with the fewest tokens so far (lowest rank on a tie), each
    shard in batch order. Every rank computes the same split from the same batch."""
    n = len(batch.input_ids)
    cap = -(-n // size) if n else 0
    shards: list[list[int]] = [[] for _ in range(size)]
    tokens = [0] * size
    for i in sorted(range(n), key=lambda i: (-len(batch.input_ids[i]), i)):
        rank = min((r for r in range(size) if len(shards[r]) < cap), key=lambda r: (tokens[r], r))
        shards[rank].append(i)
        tokens[rank] += len(batch.input_ids[i])
    return [sorted(s) for s in shards]


def select_rows(batch: TrainBatch, rows: Sequence[int]) -> TrainBatch:
    return TrainBatch([batch.input_ids[i] for i in rows], [batch.loss_mask[i] for i in rows],
                      [batch.serving_logprobs[i] for i in rows], [batch.advantages[i] for i in rows])


def broadcast_from_first(tensors: Sequence[torch.Tensor], dp: DataParallel) -> None:
    """Give every replica data-parallel rank 0's values of ``tensors`` (in place), as DDP does when it
    wraps a model: the replicas start identical whatever each process's RNG did before."""
    if dp.size > 1:
        for t in tensors:
            dist.broadcast(t.data, group=dp.group, group_src=0)


def all_reduce_step(trained: Sequence[torch.Tensor], sums: dict[str, float], dp: DataParallel) -> dict[str, float]:
    """Sum the gradients of ``trained`` and the step statistics ``sums`` over the data-parallel ranks,
    in one float32 all-reduce on the gradients' device; gradients are replaced in place (a parameter
    without one gets the sum, its own share counted as zero). Returns the summed statistics."""
    if dp.size == 1:
        return sums
    grads = []
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    names = sorted(sums)
    flat = torch.cat([*(g.reshape(-1).float() for g in grads),
                      torch.tensor([sums[k] for k in names], dtype=torch.float32, device=device)])
    dist.all_reduce(flat, group=dp.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return dict(zip(names, flat[offset:].tolist()))


# -- the processes ---------------------------------------------------------------------------------


@dataclass
class Ranks:
    """The trainer's processes as :func:`start_ranks` joined them: this one is ``rank`` of ``size``;
    ``control`` is the gloo group over which rank 0 leads the others (``None`` for one process)."""

    rank: int = 0
    size: int = 1
    control: Any = None
    _lead: "Lead | None" = field(default=None, repr=False)

    @property
    def leads(self) -> bool:
        """Whether this process runs the RL loop (rank 0, or the only process)."""
        return self.rank == 0

    def close(self) -> None:
        """Rank 0: tell the other ranks the run is over (they return from :func:`follow`)."""
        global _LEADING
        if self._lead is not None:
            self._lead.send(("stop", ()))
            self._lead = None
        _LEADING = None

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # An Exception reaches here between two led calls (each gathers every rank's outcome), so the
        # followers are waiting for the next one: stop them. An interrupt may come inside a collective;
        # then torchrun, which forwards the signal to every rank, ends them.
        if exc_type is None or issubclass(exc_type, Exception):
            self.close()


# How long a follower waits for rank 0's next call beyond the wait for a step's groups: one step, a
# checkpoint, a publication, and at the start the fleet's start-up.
FOLLOWER_MARGIN_S = 3600.0


_LEADING: "Lead | None" = None  # set on rank 0 of several by start_ranks; load_backend leads through it


def start_ranks(device: str, wait_for_groups_s: float) -> Ranks:
    """Join the processes torchrun started (``WORLD_SIZE`` > 1) into one world, each on the GPU of its
    ``LOCAL_RANK`` when ``device`` is ``cuda``; a single process (no torchrun) is rank 0 of 1 and
    nothing is initialized. A follower waits for rank 0's next call at most ``wait_for_groups_s``
    (the trainer's ``take_timeout_s``) plus :data:`FOLLOWER_MARGIN_S`, then fails."""
    global _LEADING
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return Ranks()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"trainer config key 'device' = {device!r}: with {size} trainer processes each takes "
                         "the GPU of its LOCAL_RANK; expected 'cuda' (or 'cpu' for gloo)")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_for_groups_s + FOLLOWER_MARGIN_S))
    ranks = Ranks(dist.get_rank(), size, control)
    if ranks.leads:
        ranks._lead = _LEADING = Lead(control, size)
    return ranks


def leading() -> "Lead | None":
    """The channel to the other ranks when this process is rank 0 of several, else ``None``."""
    return _LEADING


class RankFailed(RuntimeError):
    """A call that rank 0 made on every rank failed on another rank; the message names the rank."""


class Lead:
    """Rank 0's side of the calls it makes on every rank: each is sent (pickled) over the gloo group,
    made here, then every rank's outcome is gathered, so that a failure anywhere raises here."""

    def __init__(self, control: Any, size: int) -> None:
        self.control, self.size = control, size

    def send(self, call: tuple[str, tuple]) -> None:
        dist.broadcast_object_list([call], group=self.control, group_src=0)

    def call(self, what: str, args: tuple, here: Callable[[], Any]) -> Any:
        self.send((what, args))
        error: BaseException | None = None
        try:
            result = here()
        except Exception as exc:  # gathered first: the other ranks are waiting to report theirs
            error, result = exc, None
        outcomes: list[Any] = [None] * self.size
        dist.gather_object(None, outcomes, group=self.control, group_dst=0)
        if error is not None:
            raise error
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed:
            raise RankFailed("; ".join(f"trainer rank {r}: {what} failed: {o}" for r, o in failed))
        return result


class LeadBackend:
    """Rank 0's backend: every protocol call (:data:`LED_METHODS`) is made on every rank, each on its
    own replica (the step on its shard of the batch; saves and loads as each backend shares them out)."""

    def __init__(self, lead: Lead, local: Any) -> None:
        self.lead, self.local = lead, local

    def train_step(self, batch: TrainBatch, loss: LossConfig) -> StepResult:
        return self.lead.call("train_step", (batch, loss), lambda: self.local.train_step(batch, loss))

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return self.lead.call("adapter_state_dict", (), self.local.adapter_state_dict)

    def save_adapter(self, directory) -> None:
        return self.lead.call("save_adapter", (directory,), lambda: self.local.save_adapter(directory))

    def save_state(self, directory) -> None:
        return self.lead.call("save_state", (directory,), lambda: self.local.save_state(directory))

    def load_state(self, directory) -> None:
        return self.lead.call("load_state", (directory,), lambda: self.local.load_state(directory))


def follow(ranks: Ranks, build: Callable[[str, dict[str, Any]], Any]) -> int:
    """A rank other than 0: make every call rank 0 makes, until it says stop. ``build(name, kwargs)``
    makes this rank's backend when rank 0 makes its own (``load_backend``). Returns 0."""
    backend = None
    while True:
        holder: list[Any] = [None]
        dist.broadcast_object_list(holder, group=ranks.control, group_src=0)
        what, args = holder[0]
        if what == "stop":
            return 0
        outcome = None
        try:
            if what == "build":
                backend = None  # free the replica being replaced before its successor is built
                backend = build(*args)
            elif what in LED_METHODS and backend is not None:
                getattr(backend, what)(*args)
            else:
                raise RuntimeError(f"unexpected call {what!r} from trainer rank 0")
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        dist.gather_object(outcome, None, group=ranks.control, group_dst=0)
