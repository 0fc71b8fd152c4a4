"""The pieces of an RL run that ``training.__main__`` strings together.

- :class:`GroupRunner`: what produces one group of rollouts (the evals agent harness against the
  engine fleet, in :mod:`training.episodes`), as a protocol.
- :class:`Producer`: threads that keep ``groups_per_step * (max_policy_lag + 1)`` groups in flight,
  ready, or taken by the step whose adapter is not published yet, always sampling with the newest
  published adapter, writing each rollout to the store as soon as it finishes. With that admission and
  the trainer taking the oldest adapter's groups first (waiting for those in flight whose last step it
  is), no group outlives the policy lag: nothing sampled is discarded, and which groups train does not
  depend on how fast each one finished. With ``producer_workers = 0`` the trainer produces each step's groups itself,
  synchronously and deterministically (group ids and seeds depend only on the step).
- :class:`RunState`: the trainer side: backend, curriculum, store, metrics; opened fresh or resumed
  from the newest complete checkpoint that loads (a damaged one is reported and the one before it is
  used); takes batches within the policy lag, steps, checkpoints.

No single episode stops a run. An episode that fails in the infrastructure through its retries
(:class:`EpisodeInfraError`) is written to ``logs/lost-episodes.jsonl`` (task, group, episode, error)
and its group is dropped from the store (never trained on) and replaced by another group. The run
stops only on failures that are not one episode's: ``max_consecutive_infra_failures`` episodes in a
row lost that way (:class:`InfraCircuitOpen`), the store unwritable, the engine gone for good.

One trainer per run directory: :class:`RunLock` holds ``RUN_DIR/trainer.lock`` (``flock``, released
by the OS when the process dies) from before the resume to the end; a second trainer is refused.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import random
import sys
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import torch

from training.backends import StepResult, TrainerBackend, load_backend
from training.checkpoint import (ADAPTER_DIR, CheckpointLoadError, adapter_dir, adapters_volume, check_checkpoint,
                                 checkpoint_path, complete_steps, lock_path, logs_dir, metrics_dir, rng_state,
                                 set_rng_state, store_path, write_checkpoint)
from training.config import TrainConfig
from training.curriculum import Curriculum
from training.grpo import IntegrityGate, TrainBatch, batch_from_groups, has_reward_variance, is_canary_group
from training.metrics import MetricsWriter, bin_rows
from training.publish import AdapterPublisher, version_name
from training.rollout import Rollout
from training.store import Group, RolloutStore


@dataclass(frozen=True)
class AdapterRef:
    """The policy a group is sampled with: the adapter of training step ``step`` (0: the base model,
    ``name`` None), served under ``name`` (its adapter version, ``step_000012``) from ``path``."""

    step: int
    name: str | None
    path: Path | None


class GroupRunner(Protocol):
    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterable[Rollout]:
        """Run ``size`` episodes of ``task_id`` with ``adapter``; yield each rollout as it finishes.
        An episode lost to the infrastructure raises :class:`EpisodeInfraError` (after the others)."""
        ...


class EpisodeInfraError(RuntimeError):
    """One episode failed in the infrastructure (sandbox, model server) on every retry; the message
    names the task, the group, the episode and the last error. ``lost`` lists every episode of the
    group that was lost so (this one first)."""

    def __init__(self, task_id: str, group_id: str, index: int, attempts: int, error: str) -> None:
        super().__init__(f"task {task_id}, group {group_id}, episode {index}: {attempts} attempts failed "
                         f"in the infrastructure; last error: {error}")
        self.task_id, self.group_id, self.index, self.error = task_id, group_id, index, error
        self.lost: list[EpisodeInfraError] = [self]


class InfraCircuitOpen(RuntimeError):
    """Too many episodes in a row failed in the infrastructure: the sandboxes or the engine are down,
    not one episode. Stops the run."""


class RunDirInUse(RuntimeError):
    """Another live trainer holds the run directory's lock."""


class TakeTimeout(TimeoutError):
    """The trainer waited longer than ``take_timeout_s`` for a step's groups."""


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/trainer.lock``, which holds the owner's pid. The OS
    releases it when the process dies (SIGKILL included), so a stale file never blocks a resume."""

    def __init__(self, run_dir: Path) -> None:
        self.path = lock_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(f"run directory {Path(run_dir)} is in use by another trainer (pid {holder} holds "
                              f"{self.path}); stop that trainer first, or give this one another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


CHANGE_WAIT_S = 0.25  # the longest a waiting trainer or producer goes without looking at the store


def group_seed(seed: int, group_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{group_id}".encode()).digest()[:4], "little")


class Producer:
    """Keeps groups in flight on worker threads; see the module docstring."""

    def __init__(self, state: "RunState", runner: GroupRunner) -> None:
        self.state = state
        self.runner = runner
        self.cfg = state.cfg
        self._stop = threading.Event()
        self._inflight = 0
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._seq = state.store.counts()["groups"]
        self.errors: list[BaseException] = []
        self._failures_lock = threading.Lock()
        self._consecutive_failures: list[EpisodeInfraError] = []
        self.lost_log = logs_dir(self.state.run_dir) / "lost-episodes.jsonl"

    def produce(self, task_id: str, group_id: str, adapter: AdapterRef) -> bool:
        """Run and store one group; False when it lost an episode to the infrastructure and was dropped."""
        store = self.state.store
        store.add_group(group_id, task_id, adapter.step, self.cfg.group_size)
        seed = group_seed(self.cfg.seed, group_id)
        try:
            with self.state.sampling_with(adapter):
                for rollout in self.runner.run_group(task_id, adapter, group_id, self.cfg.group_size, seed):
                    store.put(rollout)
                    with self._failures_lock:
                        self._consecutive_failures.clear()
        except EpisodeInfraError as exc:
            self._group_lost(task_id, group_id, exc)
            return False
        finally:
            self.state.groups_changed()  # a trainer waiting for this group looks again
        return True

    def _group_lost(self, task_id: str, group_id: str, exc: EpisodeInfraError) -> None:
        """Record the lost episodes, drop their group, and open the circuit after too many in a row."""
        self.state.store.drop_group(group_id, str(exc))
        self.lost_log.parent.mkdir(parents=True, exist_ok=True)
        with self._failures_lock, open(self.lost_log, "a") as log:
            for lost in exc.lost:
                log.write(json.dumps({"time_s": time.time(), "task_id": lost.task_id, "group_id": lost.group_id,
                                      "episode": lost.index, "error": lost.error}) + "\n")
                print(f"episode lost, group {group_id} dropped: {lost}", file=sys.stderr, flush=True)
            self._consecutive_failures.extend(exc.lost)
            failures = list(self._consecutive_failures)
        if len(failures) >= self.cfg.max_consecutive_infra_failures:
            tasks = sorted({f.task_id for f in failures})
            raise InfraCircuitOpen(self._circuit_message(f"{len(failures)} episodes in a row (tasks {', '.join(tasks)})",
                                                         str(failures[-1])))

    def _circuit_message(self, what: str, last: str) -> str:
        return (f"{what} failed in the infrastructure (trainer config key 'max_consecutive_infra_failures' = "
                f"{self.cfg.max_consecutive_infra_failures}): the sandboxes or the engine are failing, not one "
                f"episode; see {self.lost_log}. Last: {last}")

    def produce_step(self, step: int, round: int = 0, count: int | None = None) -> None:
        """Synchronous mode: this step's groups, named by step, skipping any already stored. A group
        dropped for a lost episode is replaced by a group of the curriculum's next task (``-rN``).
        Rounds after the first (dynamic sampling: ``count`` more groups, since some had no reward
        variance) are named ``-xR``."""
        tasks = self.state.next_tasks(self.cfg.groups_per_step if count is None else count)
        adapter = self.state.current_adapter()
        done = self.state.store.complete_group_ids()
        dropped = self.state.store.dropped_group_ids()
        for i, task in enumerate(tasks):
            for attempt in range(self.cfg.max_consecutive_infra_failures + 1):
                if attempt:  # drawn on a resume too, so the curriculum's draws are the same
                    task = self.state.next_tasks(1)[0]
                group_id = (f"s{step:06d}" + (f"-x{round}" if round else "") + f"-g{i:02d}"
                            + (f"-r{attempt}" if attempt else ""))
                if group_id in done or (group_id not in dropped and self.produce(task, group_id, adapter)):
                    break
            else:
                raise InfraCircuitOpen(self._circuit_message(
                    f"step {step}: group {i} was dropped {self.cfg.max_consecutive_infra_failures + 1} times, each "
                    "time because an episode", f"group {group_id} of task {task}"))

    def alive(self) -> int:
        """How many producer threads are running."""
        return sum(t.is_alive() for t in self._threads)

    def start(self) -> None:
        if self.cfg.producer_workers:  # a stopped trainer's unfinished groups have no producer: never wait for them
            if dropped := self.state.store.drop_unfinished("unfinished when the trainer stopped; not resumed"):
                self.state.log(f"{dropped} groups left unfinished by the trainer that stopped are dropped")
        for i in range(self.cfg.producer_workers):
            t = threading.Thread(target=self._work, name=f"producer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _work(self) -> None:
        target = self.cfg.groups_per_step * (self.cfg.max_policy_lag + 1)
        while not self._stop.is_set():
            seen = self.state.changes()
            with self._cond:
                full = self._inflight + self.state.occupied() >= target
                if not full:
                    self._inflight += 1
                    self._seq += 1
                    group_id = f"n{self._seq:07d}"
            if full:  # until a group finishes or the trainer takes some
                self.state.wait_for_change(seen)
                continue
            try:
                task = self.state.next_tasks(1)[0]
                self.produce(task, group_id, self.state.start_group(group_id, task))
            except BaseException as exc:  # surfaced to the trainer, which stops the run
                self.errors.append(exc)
                self._stop.set()
            finally:
                with self._cond:
                    self._inflight -= 1
                self.state.groups_changed()

    def stop(self) -> None:
        self._stop.set()
        self.state.groups_changed()
        for t in self._threads:
            t.join(timeout=600)


@dataclass
class TakenBatch:
    groups: list[Group]
    discarded: list[Group]
    wait_s: float


class RunState:
    """The trainer's state, opened from ``run_dir`` (fresh, or resumed from its newest checkpoint)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, curriculum: Curriculum, receivers: list[str] = (),
                 lock: RunLock | None = None, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = lock or RunLock(self.run_dir)  # before anything reads or rewinds the run's state
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.backend = self._new_backend()
        self.gate = IntegrityGate.from_config(cfg)  # what a flagged attempt counts for (training.grpo)
        self.loss = cfg.loss  # every loss setting (training.config.LossConfig), for the batch and each step
        self.store = RolloutStore(store_path(self.run_dir))
        self._lock = threading.Lock()
        self._versions_in_flight: collections.Counter[str] = collections.Counter()
        # of the groups_per_step the step in progress needs, how many it has taken: their places in the
        # producers' window stay held until its adapter is published (see occupied)
        self._taken_unpublished = 0
        # bumped when a group finishes or is dropped and when the trainer takes groups: the trainer
        # and the producers wait on it rather than polling the store
        self._changes = 0
        self._changed = threading.Condition()
        self.publisher = AdapterPublisher(adapters_volume(self.run_dir), receivers, streams=cfg.publish_streams,
                                          in_use=self.versions_in_flight)
        self.curriculum = curriculum
        self.step = 0
        self.resumed_from: int | None = None
        done = complete_steps(self.run_dir)
        if done:
            self._resume_newest(done)
        else:
            self._write_base_checkpoint()
        self.metrics = MetricsWriter(metrics_dir(self.run_dir), resume_step=self.step)
        (self.run_dir / "trainer-config.json").write_text(json.dumps(cfg.to_json(), indent=1))
        self._adapter = AdapterRef(0, None, None) if self.step == 0 else self._adapter_on_volume(self.step)

    # -- resume ---------------------------------------------------------------------------------

    def _new_backend(self) -> TrainerBackend:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        return load_backend(cfg.backend, **cfg.backend_args())

    def _resume_newest(self, steps: list[int]) -> None:
        """Resume from the newest of ``steps`` whose checkpoint loads; each one that does not is
        reported (file and reason) and the one before it is tried. Step 0 (the base model) means
        starting over with every stored rollout unused."""
        failures: list[str] = []
        for step in reversed(steps):
            try:
                if step == 0:
                    check_checkpoint(checkpoint_path(self.run_dir, 0))
                    if failures:
                        self.store.rewind_to(0)
                else:
                    self._resume(step)
            except CheckpointLoadError as exc:
                failures.append(str(exc))
                self.log(f"warning: {exc}; trying the checkpoint before it")
                continue
            if failures:
                self.log(f"warning: resuming from checkpoint {step}, the newest that loads")
            return
        raise CheckpointLoadError(f"no checkpoint of {self.run_dir} loads:\n  " + "\n  ".join(failures))

    def _resume(self, step: int) -> None:
        ckpt = checkpoint_path(self.run_dir, step)
        loaded = check_checkpoint(ckpt)  # every file, before anything is changed
        try:
            self.backend.load_state(ckpt)
        except Exception as exc:
            self.backend = self._new_backend()  # half-loaded: start the next try from a clean one
            raise CheckpointLoadError(f"checkpoint {ckpt}: the backend could not load it ({type(exc).__name__}: {exc})",
                                      ckpt) from exc
        self.curriculum = loaded.curriculum
        set_rng_state(loaded.rng)
        self.step = step
        self.resumed_from = step
        self.store.rewind_to(step)

    def _adapter_on_volume(self, step: int) -> AdapterRef:
        """Resume: versions published after the checkpoint belong to steps being redone, so they leave
        the volume; the checkpoint's adapter goes to every replica (and the volume, if missing)."""
        for path in adapters_volume(self.run_dir).glob("step_*"):
            if int(path.name.removeprefix("step_")) > step:
                shutil.rmtree(path)
        result = self.publisher.publish(step, adapter_dir(checkpoint_path(self.run_dir, step)))
        return AdapterRef(step, result.version, adapters_volume(self.run_dir) / result.version)

    def _write_base_checkpoint(self) -> None:
        def fill(tmp: Path) -> None:
            self.curriculum.save(tmp / "curriculum.json")

        write_checkpoint(self.run_dir, 0, fill, self._metadata(0, base_only=True))

    def _metadata(self, step: int, base_only: bool = False, **extra: Any) -> dict[str, Any]:
        return {
            "run_name": self.cfg.run_name, "base_model": str(Path(self.cfg.base_model).resolve()),
            "adapter": None if base_only else ADAPTER_DIR, "adapter_version": version_name(step) if step else None,
            **extra,
        }

    # -- the producer's view ------------------------------------------------------------------------

    def current_adapter(self) -> AdapterRef:
        with self._lock:
            return self._adapter

    def start_group(self, group_id: str, task_id: str) -> AdapterRef:
        """Announce a group in the store and return the adapter it samples with, at once as the trainer
        sees it: a take either sees the group (and keeps its place on its adapter's last step) or
        happens before it, when that adapter was not yet one a step could be the last to use."""
        with self._lock:
            self.store.add_group(group_id, task_id, self._adapter.step, self.cfg.group_size)
            return self._adapter

    @contextlib.contextmanager
    def sampling_with(self, adapter: AdapterRef):
        """Marks ``adapter`` in use by a group while the block runs: the publisher does not unload it."""
        if adapter.name is None:  # the base model is never unloaded
            yield
            return
        with self._lock:
            self._versions_in_flight[adapter.name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._versions_in_flight[adapter.name] -= 1
                if not self._versions_in_flight[adapter.name]:
                    del self._versions_in_flight[adapter.name]

    def versions_in_flight(self) -> set[str]:
        """The adapter versions groups in flight sample with (their episodes finish on them)."""
        with self._lock:
            return set(self._versions_in_flight)

    def changes(self) -> int:
        with self._changed:
            return self._changes

    def groups_changed(self) -> None:
        with self._changed:
            self._changes += 1
            self._changed.notify_all()

    def wait_for_change(self, seen: int, timeout_s: float | None = None) -> None:
        """Until :meth:`groups_changed` is called after :meth:`changes` returned ``seen``, or
        ``timeout_s`` (default :data:`CHANGE_WAIT_S`: rollouts stored by anything else are seen then)."""
        with self._changed:
            self._changed.wait_for(lambda: self._changes != seen, timeout=CHANGE_WAIT_S if timeout_s is None else timeout_s)

    def occupied(self) -> int:
        """Places in the producers' window held by groups that are not in flight: complete and ready,
        or taken by the step in progress (up to its ``groups_per_step``) until its adapter is published.

        A group started now samples with the newest published adapter ``v``; the steps from ``v + 1``
        on take at least ``groups_per_step`` each, oldest adapter first, so with fewer than
        ``groups_per_step * (max_policy_lag + 1)`` places held or in flight it is taken by step
        ``v + 1 + max_policy_lag`` at the latest, the last step its adapter is within the lag."""
        with self._lock:
            return self.store.ready_groups() + self._taken_unpublished

    def next_tasks(self, n: int) -> list[str]:
        with self._lock:
            return self.curriculum.next_tasks(n)

    # -- the step ---------------------------------------------------------------------------------

    def take(self, step: int, produce: Callable[[], None] | None = None, should_stop: Callable[[], None] = lambda: None,
             *, timeout_s: float | None = None, producers_alive: Callable[[], int] | None = None) -> TakenBatch:
        """Whole groups for ``step``, waiting until enough are complete; stale ones are discarded.

        The trainer at ``step`` updates the adapter of step ``step - 1``; a group sampled with the
        adapter of step ``v`` has policy age ``step - 1 - v`` and is usable while the age is at most ``max_policy_lag``.
        Groups are taken oldest adapter first, and those whose last usable step this is are all taken,
        waited for while in flight (:meth:`RolloutStore.take_groups`): with the producers' window
        (:meth:`occupied`) only a resumed run's leftovers can be stale.
        With ``max_groups_per_step`` set (dynamic sampling), groups without reward variance do not count
        towards ``groups_per_step``: the step takes more, up to ``max_groups_per_step`` in all (the
        curriculum still learns from every one; the loss drops them). In synchronous mode
        ``produce(round, count)`` makes the groups: round 0 the step's ``groups_per_step``, and with
        dynamic sampling each later round as many as the step still lacks. Waiting longer than
        ``timeout_s`` (default: the config's ``take_timeout_s``) raises :class:`TakeTimeout`, saying
        what was waited for (``producers_alive`` counts the producers).
        """
        dynamic = self.cfg.max_groups_per_step > 0
        rounds = 0
        if produce is not None:
            produce(rounds, self.cfg.groups_per_step)
        timeout_s = self.cfg.take_timeout_s if timeout_s is None else timeout_s
        min_adapter_step = max(0, step - 1 - self.cfg.max_policy_lag)
        # with producers, the adapter step whose groups this step is the last to be allowed to use
        last_chance = min_adapter_step if self.cfg.producer_workers and step > self.cfg.max_policy_lag else None
        most = self.cfg.max_groups_per_step or self.cfg.groups_per_step
        groups: list[Group] = []
        discarded: list[Group] = []
        useful = 0  # the groups taken that count towards groups_per_step
        started = time.perf_counter()
        while True:
            wanted = min(self.cfg.groups_per_step - useful, most - len(groups))
            if wanted <= 0:
                return TakenBatch(groups, discarded, time.perf_counter() - started)
            seen = self.changes()
            with self._lock:  # with the count of what it took, so that the producers see their window whole
                take = self.store.take_groups(wanted, step=step, min_adapter_step=min_adapter_step,
                                              last_chance=last_chance, most=most - len(groups))
                useful += sum(has_reward_variance(self.gate.rewards(g.rollouts)) for g in take.groups) \
                    if dynamic else len(take.groups)
                self._taken_unpublished = min(useful, self.cfg.groups_per_step)
            groups += take.groups
            discarded += take.discarded_groups
            if take.groups or take.discarded_groups:
                self.groups_changed()  # the producers refill what was taken
            if take.groups:
                continue
            if dynamic and produce is not None and not self.store.ready_groups():  # this round is spent
                rounds += 1
                produce(rounds, wanted)
                continue
            should_stop()
            if time.perf_counter() - started > timeout_s:
                alive = "unknown" if producers_alive is None else producers_alive()
                raise TakeTimeout(
                    f"step {step}: waited {timeout_s:g} s for {self.cfg.groups_per_step} whole groups sampled at "
                    f"adapter step >= {min_adapter_step}; {len(groups)} taken, {self.store.ready_groups()} more "
                    f"complete in the store {self.store.path}; producers alive: {alive} "
                    f"(trainer config key 'take_timeout_s')")
            self.wait_for_change(seen)

    def build_batch(self, groups: list[Group]) -> tuple[TrainBatch | None, int]:
        """The batch of the groups with reward variance once the integrity gate has decided what each
        flagged attempt counts for, and how many groups were dropped."""
        return batch_from_groups(groups, self.loss, gate=self.gate)

    def train(self, step: int, taken: TakenBatch) -> dict[str, Any]:
        started = time.perf_counter()
        batch, dropped = self.build_batch(taken.groups)
        result = self.backend.train_step(batch, self.loss) if batch is not None else None
        train_s = time.perf_counter() - started
        with self._lock:
            for g in taken.groups:
                self.curriculum.record(g.task_id, [r.reward for r in g.rollouts])
            self.curriculum.advance(step)
        self.step = step
        row = self._step_row(step, taken, batch, dropped, result, train_s)
        self.metrics.record(row, bin_rows(step, taken.groups, taken.discarded, step - 1))
        return row

    def _step_row(self, step: int, taken: TakenBatch, batch: TrainBatch | None, dropped: int,
                  result: StepResult | None, train_s: float) -> dict[str, Any]:
        rollouts = [r for g in taken.groups if not is_canary_group(g) for r in g.rollouts]
        canaries = [r for g in taken.groups if is_canary_group(g) for r in g.rollouts]
        ages = [step - 1 - r.adapter_step for r in rollouts]
        used_tokens = batch.generated_tokens if batch is not None else 0
        consumed_tokens = sum(g.generated_tokens for g in taken.groups)
        discarded_tokens = sum(g.generated_tokens for g in taken.discarded)
        solved = [1.0 if r.reward >= 1.0 else 0.0 for r in rollouts]
        return {
            "step": step, "time_s": time.time(),
            "loss": result.loss if result else 0.0, "pg_loss": result.pg_loss if result else 0.0,
            "kl": result.kl if result else 0.0, "grad_norm": result.grad_norm if result else 0.0,
            "mean_is_weight": result.mean_is_weight if result else 1.0,
            "clipped_is_fraction": result.clipped_is_fraction if result else 0.0,
            "reward_mean": sum(r.reward for r in rollouts) / max(len(rollouts), 1),
            "solve_rate": sum(solved) / max(len(solved), 1),
            "groups": len(taken.groups), "zero_variance_groups": dropped,
            "samples": len(rollouts), "useful_tokens": used_tokens, "consumed_tokens": consumed_tokens,
            "discarded_groups": len(taken.discarded), "discarded_samples": sum(len(g.rollouts) for g in taken.discarded),
            "discarded_tokens": discarded_tokens,
            "discarded_token_fraction": discarded_tokens / max(discarded_tokens + consumed_tokens, 1),
            "policy_age_mean": sum(ages) / max(len(ages), 1), "policy_age_max": max(ages, default=0),
            "wait_s": taken.wait_s, "train_s": train_s,
            "useful_tokens_per_s": used_tokens / max(taken.wait_s + train_s, 1e-9),
            # the task stream's canaries (never trained on): their pass rate is the measured cheating rate
            "canary_samples": len(canaries),
            "canary_pass_rate": (sum(1.0 for r in canaries if float(r.info.get("score", r.reward)) >= 1.0)
                                 / len(canaries)) if canaries else 0.0,
            # attempts the integrity gate caught, in all and per cheating signal
            **self.gate.counts(taken.groups),
        }

    def checkpoint(self, step: int, extra: dict[str, Any]) -> Path:
        def fill(tmp: Path) -> None:
            self.backend.save_state(tmp)
            torch.save(rng_state(), tmp / "rng.pt")  # plain lists and a tensor: loads with weights_only
            with self._lock:
                self.curriculum.save(tmp / "curriculum.json")
            self.store.snapshot(tmp / "store.sqlite")

        return write_checkpoint(self.run_dir, step, fill, self._metadata(step, **extra))

    def publish(self, step: int) -> Any:
        tmp = adapters_volume(self.run_dir) / f".out-{version_name(step)}"
        if tmp.exists():
            shutil.rmtree(tmp)
        self.backend.save_adapter(tmp)
        result = self.publisher.publish(step, tmp)
        shutil.rmtree(tmp)
        with self._lock:
            self._adapter = AdapterRef(step, result.version, adapters_volume(self.run_dir) / result.version)
            self._taken_unpublished = 0
        self.groups_changed()  # the producers' window opens again
        return result
