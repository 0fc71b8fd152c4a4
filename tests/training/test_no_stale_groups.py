"""Bounded policy lag without discards: the producers' window counts the groups the step in progress
has taken until its adapter is published, and the trainer takes the oldest adapter's groups first,
waiting for a group in flight whose last allowed step it is. A slow group is then trained on, not
overtaken by faster ones and thrown away; which groups train does not depend on how fast each one
finished (that selection once left a run's batches short of the slow, multi-command episodes).

The trainer here is the real one (RunState on a tiny random model, Producer threads); the groups are
made by a runner whose first group is slow."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from training.config import TrainConfig
from training.curriculum import Curriculum
from training.loop import Producer, RunState
from training.rollout import Rollout
from training.store import RolloutStore

SLOW_S = 2.0  # how long the slow group takes; the other groups are immediate


def _rollouts(group_id: str, task_id: str, adapter_step: int, size: int):
    for i in range(size):
        yield Rollout(f"{group_id}-{i}", group_id, task_id, adapter_step, [1, 2, 3, 4 + i], [0, 1, 1, 1],
                      [0.0, -1.0, -1.0, -1.0], float(i % 2))


class SlowFirstGroup:
    def __init__(self, slow: str) -> None:
        self.slow = slow
        self.started: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def run_group(self, task_id, adapter, group_id, size, seed):
        with self._lock:
            self.started.append((group_id, adapter.step))
        if group_id == self.slow:
            time.sleep(SLOW_S)
        yield from _rollouts(group_id, task_id, adapter.step, size)


@pytest.mark.parametrize("slow_announce", [False, True], ids=["fast-store", "slow-announce"])
def test_a_slow_group_is_trained_on_within_the_lag_and_nothing_is_discarded(tmp_path: Path, tiny_model_dir: Path,
                                                                             monkeypatch, slow_announce: bool):
    """``slow-announce``: the store takes a while to record one new group (a busy disk's fsync), so
    a producer that chose its adapter before the group was in the store could see steps pass in
    between and start a group already at its adapter's last step, which the trainer did not know to
    wait for."""
    if slow_announce:
        add_group = RolloutStore.add_group

        def slowly(self, group_id, *args):
            if group_id == "n0000007":
                time.sleep(SLOW_S)
            return add_group(self, group_id, *args)

        monkeypatch.setattr(RolloutStore, "add_group", slowly)
    cfg = TrainConfig.from_mapping({
        "run_name": "lag", "base_model": str(tiny_model_dir), "steps": 6, "groups_per_step": 2, "group_size": 2,
        "max_policy_lag": 1, "producer_workers": 4, "checkpoint_every": 100, "lora_rank": 4, "max_new_tokens": 4,
        "take_timeout_s": 120})
    state = RunState(cfg, tmp_path / "run", Curriculum.from_pass_rates({"t": 0.5}, seed=0))
    runner = SlowFirstGroup("n0000001")
    producer = Producer(state, runner)
    taken_by: dict[str, int] = {}
    discarded: list[str] = []
    try:
        producer.start()
        for step in range(1, cfg.steps + 1):
            taken = state.take(step, should_stop=lambda: None, producers_alive=producer.alive)
            for g in taken.groups:
                taken_by[g.group_id] = step
                # the policy age of every group trained on is within the lag
                assert step - 1 - g.adapter_step <= cfg.max_policy_lag, (g.group_id, g.adapter_step, step)
            discarded += [g.group_id for g in taken.discarded]
            state.train(step, taken)
            state.publish(step)
    finally:
        producer.stop()
        state.lock.release()
    assert not producer.errors
    assert discarded == []
    # the slow group (adapter 0) was waited for by step 2, the last step allowed to use adapter 0
    assert taken_by["n0000001"] == 2
    # no group was started that the window could not fit: each one still in the store when the run
    # stopped was sampled with an adapter the next step could use
    store = RolloutStore(state.store.path)
    left = {gid for gid, _ in runner.started} - set(taken_by)
    assert all(step >= cfg.steps - cfg.max_policy_lag for gid, step in runner.started if gid in left), runner.started
    assert store.counts()["discarded"] == 0


def test_a_stopped_trainers_unfinished_groups_are_dropped_when_producers_start(tmp_path: Path,
                                                                               tiny_model_dir: Path):
    """After a crash, a group announced but not whole has no producer: left as it is, the trainer would
    keep a place for it (its adapter's last step) and wait for it until the take timeout."""
    cfg = TrainConfig.from_mapping({
        "run_name": "lag", "base_model": str(tiny_model_dir), "steps": 2, "groups_per_step": 1, "group_size": 2,
        "max_policy_lag": 0, "producer_workers": 1, "lora_rank": 4, "max_new_tokens": 4, "take_timeout_s": 60})
    state = RunState(cfg, tmp_path / "run", Curriculum.from_pass_rates({"t": 0.5}, seed=0))
    state.store.add_group("left-half", "t", 0, 2)
    state.store.put(next(_rollouts("left-half", "t", 0, 2)))  # one of two: the trainer stopped here
    producer = Producer(state, SlowFirstGroup(slow="none"))
    try:
        producer.start()
        assert "left-half" in state.store.dropped_group_ids()
        taken = state.take(1, should_stop=lambda: None, producers_alive=producer.alive, timeout_s=30)
        assert [g.group_id for g in taken.groups] != ["left-half"] and len(taken.groups) == 1
    finally:
        producer.stop()
        state.lock.release()


def test_the_last_chance_adapter_keeps_places_and_is_taken_first(tmp_path: Path):
    store = RolloutStore(tmp_path / "s.sqlite")
    for name, version in (("new-a", 3), ("new-b", 3), ("old-done", 2), ("new-c", 3)):
        store.add_group(name, "t", version, 2)
        for r in _rollouts(name, "t", version, 2):
            store.put(r)
    store.add_group("old-running", "t", 2, 2)  # in flight
    take = store.take_groups(2, step=4, min_adapter_step=2, last_chance=2, most=4)
    # the older adapter first, and one place kept for the group of adapter 2 still running
    assert [g.group_id for g in take.groups] == ["old-done"]
    for r in _rollouts("old-running", "t", 2, 2):
        store.put(r)
    take = store.take_groups(1, step=4, min_adapter_step=2, last_chance=2, most=3)
    assert [g.group_id for g in take.groups] == ["old-running"]
    # without a last chance, the count alone decides and the older adapter still goes first
    assert [g.group_id for g in store.take_groups(2, step=5, min_adapter_step=3).groups] == ["new-a", "new-b"]
