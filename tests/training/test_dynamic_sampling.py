"""Dynamic sampling (trainer key ``max_groups_per_step``): a step goes on taking whole groups until
``groups_per_step`` of them have reward variance, or it has taken ``max_groups_per_step``; the groups
without variance are consumed (the curriculum learns from them) but not trained on. Off (0), a step
takes ``groups_per_step`` groups whatever their rewards."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.config import TrainConfig
from training.curriculum import Curriculum
from training.grpo import has_reward_variance
from training.loop import RunState
from training.rollout import Rollout


def _state(tmp_path: Path, model: Path, **overrides) -> RunState:
    cfg = TrainConfig.from_mapping({
        "run_name": "dyn", "base_model": str(model), "steps": 2, "groups_per_step": 2, "group_size": 2,
        "max_policy_lag": 0, "producer_workers": 0, "lora_rank": 4, "max_new_tokens": 4, **overrides})
    return RunState(cfg, tmp_path / "run", Curriculum.from_pass_rates({"t": 0.5}, seed=0))


def _group(state: RunState, name: str, rewards: tuple[float, float]) -> None:
    state.store.add_group(name, "t", 0, len(rewards))
    for i, reward in enumerate(rewards):
        state.store.put(Rollout(f"{name}-{i}", name, "t", 0, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], reward))


def test_groups_without_variance_do_not_count_towards_the_step(tmp_path: Path, tiny_model_dir: Path):
    state = _state(tmp_path, tiny_model_dir, max_groups_per_step=4)
    try:
        for name, rewards in (("a", (1.0, 1.0)), ("b", (0.0, 1.0)), ("c", (0.0, 0.0)), ("d", (0.5, 0.0)),
                              ("e", (0.0, 1.0))):
            _group(state, name, rewards)
        taken = state.take(1, timeout_s=5)
        assert [g.group_id for g in taken.groups] == ["a", "b", "c", "d"]  # two with variance: b and d
        row = state.train(1, taken)
        assert (row["groups"], row["zero_variance_groups"]) == (4, 2)
        assert state.store.ready_groups() == 1  # e waits for the next step
    finally:
        state.lock.release()


def test_a_step_stops_at_max_groups_per_step(tmp_path: Path, tiny_model_dir: Path):
    state = _state(tmp_path, tiny_model_dir, max_groups_per_step=3)
    try:
        for name in "abcd":
            _group(state, name, (1.0, 1.0))
        taken = state.take(1, timeout_s=5)
        assert len(taken.groups) == 3 and not any(has_reward_variance([r.reward for r in g.rollouts])
                                                  for g in taken.groups)
    finally:
        state.lock.release()


def test_off_a_step_takes_groups_per_step_whatever_their_rewards(tmp_path: Path, tiny_model_dir: Path):
    state = _state(tmp_path, tiny_model_dir)
    try:
        for name in "abc":
            _group(state, name, (1.0, 1.0))
        assert [g.group_id for g in state.take(1, timeout_s=5).groups] == ["a", "b"]
    finally:
        state.lock.release()


def test_synchronous_mode_produces_rounds_until_the_step_is_full(tmp_path: Path, tiny_model_dir: Path):
    """``produce(round, count)``: round 0 makes groups_per_step groups, each later round as many as
    the step still lacks; here every group of round 0 and 1 is flat, round 2's vary."""
    state = _state(tmp_path, tiny_model_dir, max_groups_per_step=6)
    calls = []

    def produce(round: int, count: int) -> None:
        calls.append((round, count))
        for i in range(count):
            _group(state, f"r{round}-{i}", (1.0, 1.0) if round < 2 else (0.0, 1.0))

    try:
        taken = state.take(1, produce=produce, timeout_s=5)
        assert calls == [(0, 2), (1, 2), (2, 2)]
        assert len(taken.groups) == 6
    finally:
        state.lock.release()


def test_the_key_is_checked_against_groups_per_step():
    with pytest.raises(ValueError, match="'max_groups_per_step' must be 0 \\(off\\) or at least groups_per_step \\(6\\)"):
        TrainConfig.from_mapping({"base_model": "m", "max_groups_per_step": 3})
