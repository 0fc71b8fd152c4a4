"""The trainer takes whole groups within the policy lag; older ones are discarded and counted in
samples and tokens, per step and in the length/age bins."""

from __future__ import annotations

from pathlib import Path

from training.metrics import bin_rows, length_bin
from training.rollout import Rollout
from training.store import RolloutStore


def _group(store: RolloutStore, name: str, adapter_step: int, tokens: int) -> None:
    store.add_group(name, "t", adapter_step, 2)
    for i in range(2):
        store.put(Rollout(f"{name}-{i}", name, "t", adapter_step, [1] + [2] * tokens, [0] + [1] * tokens,
                          [0.0] + [-1.0] * tokens, float(i)))


def test_lag_window_and_bins(tmp_path: Path):
    store = RolloutStore(tmp_path / "s.sqlite")
    _group(store, "v0", 0, 10)
    _group(store, "v1", 1, 40)
    _group(store, "v2", 2, 100)
    # step 4 updates the adapter of step 3; with max_policy_lag 1 the oldest usable one is step 2's
    take = store.take_groups(2, step=4, min_adapter_step=2)
    assert [g.group_id for g in take.groups] == ["v2"]
    assert sorted(g.group_id for g in take.discarded_groups) == ["v0", "v1"]
    assert take.discarded_samples == 4 and take.discarded_tokens == 2 * 10 + 2 * 40
    rows = {(r["kind"], r["bin"]): r for r in bin_rows(4, take.groups, take.discarded_groups, trainer_step=3)}
    assert rows[("age", "1")]["used_samples"] == 2
    assert rows[("age", "3")]["discarded_tokens"] == 20 and rows[("age", "2")]["discarded_tokens"] == 80
    assert rows[(("length", length_bin(100)))]["used_tokens"] == 200
    assert length_bin(10) == "0-31" and length_bin(40) == "32-63"
