"""The rollout store: groups, staleness, rewind on resume, snapshots, and SIGKILL durability."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from training.rollout import Rollout
from training.store import RolloutStore


def _rollout(group: str, i: int, adapter_step: int, reward: float) -> Rollout:
    return Rollout(
        rollout_id=f"{group}-{i}", group_id=group, task_id=f"task-{group}", adapter_step=adapter_step,
        input_ids=[1, 2, 3 + i], loss_mask=[0, 1, 1], serving_logprobs=[0.0, -0.5, -0.25], reward=reward,
        info={"turns": 1},
    )


def _fill(store: RolloutStore, group: str, adapter_step: int, size: int = 2) -> None:
    store.add_group(group, f"task-{group}", adapter_step, size)
    for i in range(size):
        store.put(_rollout(group, i, adapter_step, float(i)))


def test_round_trip_and_only_complete_groups_are_taken(tmp_path: Path):
    store = RolloutStore(tmp_path / "store.sqlite")
    _fill(store, "g1", 0)
    store.add_group("g2", "task-g2", 0, 2)
    store.put(_rollout("g2", 0, 0, 1.0))  # one of two: not complete
    take = store.take_groups(5, step=1, min_adapter_step=0)
    assert [g.group_id for g in take.groups] == ["g1"]
    assert take.groups[0].rollouts[1] == _rollout("g1", 1, 0, 1.0)
    assert store.counts() == {"ready": 1, "consumed": 2, "discarded": 0, "groups": 2}


def test_stale_groups_are_discarded_and_counted(tmp_path: Path):
    store = RolloutStore(tmp_path / "store.sqlite")
    _fill(store, "old", 0)
    _fill(store, "new", 2)
    take = store.take_groups(5, step=3, min_adapter_step=1)
    assert [g.group_id for g in take.groups] == ["new"]
    assert [g.group_id for g in take.discarded_groups] == ["old"]
    assert take.discarded_samples == 2 and take.discarded_tokens == 4


def test_rewind_makes_later_steps_rollouts_ready_again(tmp_path: Path):
    store = RolloutStore(tmp_path / "store.sqlite")
    for name in ("a", "b", "c"):
        _fill(store, name, 0)
    assert [g.group_id for g in store.take_groups(1, step=1, min_adapter_step=0).groups] == ["a"]
    assert [g.group_id for g in store.take_groups(1, step=2, min_adapter_step=0).groups] == ["b"]
    assert store.rewind_to(1) == 2
    assert [g.group_id for g in store.take_groups(5, step=2, min_adapter_step=0).groups] == ["b", "c"]


def test_snapshot_is_a_readable_copy(tmp_path: Path):
    store = RolloutStore(tmp_path / "store.sqlite")
    _fill(store, "a", 0)
    store.snapshot(tmp_path / "ckpt" / "store.sqlite")
    copy = RolloutStore(tmp_path / "ckpt" / "store.sqlite")
    assert copy.counts()["ready"] == 2


def test_put_into_unknown_group_names_it(tmp_path: Path):
    store = RolloutStore(tmp_path / "store.sqlite")
    with pytest.raises(KeyError, match="nope"):
        store.put(_rollout("nope", 0, 0, 0.0))


WRITER = textwrap.dedent(
    """
    import sys
    from training.rollout import Rollout
    from training.store import RolloutStore
    store = RolloutStore(sys.argv[1])
    n = 0
    while True:
        group = f"g{n}"
        store.add_group(group, "t", 0, 4)
        for i in range(4):
            store.put(Rollout(rollout_id=f"{group}-{i}", group_id=group, task_id="t", adapter_step=0,
                              input_ids=list(range(200)), loss_mask=[0] + [1] * 199,
                              serving_logprobs=[0.0] + [-1.0] * 199, reward=1.0))
            print(f"{group}-{i}", flush=True)
        n += 1
    """
)


def test_sigkill_loses_no_finished_rollout_and_corrupts_nothing(tmp_path: Path):
    """A writer process is SIGKILLed while writing; every rollout it reported as stored (``put``
    returned) is in the store, and the database passes SQLite's integrity check."""
    db = tmp_path / "store.sqlite"
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
        acknowledged = []
        assert proc.stdout is not None
        while len(acknowledged) < 20 + 17 * round_:  # kill at a different point each round
            acknowledged.append(proc.stdout.readline().strip())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        acknowledged += [line.strip() for line in proc.stdout.read().splitlines() if line.strip()]
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = {row[0] for row in conn.execute("SELECT rollout_id FROM rollouts")}
        conn.close()
        assert set(acknowledged) <= stored
        db_round = db.with_name(f"round{round_}.sqlite")
        db.rename(db_round)  # start each round fresh (the writer reuses group names)
        for suffix in ("-wal", "-shm"):
            side = db.with_name(db.name + suffix)
            if side.exists():
                side.unlink()
