"""The rollout store under faults: files truncated at random bytes, writers SIGKILLed, concurrent
writers and a reader. Promise (training/store.py, DESIGN "Rollout store"): durable; a crash loses no
finished rollout; a damaged file is detected and recovered up to the last whole record."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.reliability.conftest import REPO, rollout
from training.store import RolloutStore, StoreDamagedError, salvage

WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from training.rollout import Rollout
from training.store import RolloutStore
def rollout(group, i, tokens):
    return Rollout(f"{group}-{i}", group, "task", 0, list(range(tokens)), [0] + [1] * (tokens - 1),
                   [0.0] + [-0.5] * (tokens - 1), 1.0)
store = RolloutStore(sys.argv[1])
n = 0
while True:
    group = f"g{n:05d}"
    store.add_group(group, "task", 0, 2)
    for i in range(2):
        store.put(rollout(group, i, tokens=120))
        print(f"{group}-{i}", flush=True)
    n += 1
"""


def _killed_writer(db: Path, acknowledged_at_least: int) -> list[str]:
    """Run a writer process, SIGKILL it once it has acknowledged that many rollouts; all it acknowledged."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(REPO)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = []
    while len(acked) < acknowledged_at_least:
        line = proc.stdout.readline()
        assert line, "the writer died on its own"
        acked.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked += [x.strip() for x in proc.stdout.read().splitlines() if x.strip()]
    return acked


def _stored_ids(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute("SELECT rollout_id FROM rollouts ORDER BY rowid")]
    finally:
        conn.close()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_wal_truncated_at_a_random_byte_keeps_every_whole_transaction(tmp_path: Path, seed: int):
    """The writer is SIGKILLed (its commits still in the WAL), then the WAL is cut at a random byte:
    the store opens, passes SQLite's integrity check, holds exactly a prefix of what was written (up
    to the last whole transaction) and takes new rollouts."""
    db = tmp_path / "rollouts.sqlite"
    acked = _killed_writer(db, 60 + 13 * seed)
    wal = db.with_name(db.name + "-wal")
    assert wal.stat().st_size > 0, "the killed writer left its commits in the WAL"
    cut = random.Random(seed).randrange(wal.stat().st_size)
    os.truncate(wal, cut)
    store = RolloutStore(db)  # opens: nothing to refuse
    got = _stored_ids(db)
    assert got == acked[:len(got)], "what survives is a prefix of what was written, in order"
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    store.add_group("after", "task", 0, 1)
    store.put(rollout("after", 0))
    assert store.counts()["ready"] == len(got) + 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_main_file_truncated_is_refused_with_a_clear_error_and_salvaged(tmp_path: Path, seed: int):
    """A store file (its WAL merged in) cut at a random byte: opening it raises StoreDamagedError
    naming the file; ``salvage`` recovers every whole rollout that is still readable, each one
    identical to what was written, and none that is half there."""
    db = tmp_path / "rollouts.sqlite"
    store = RolloutStore(db)
    written = {}
    for g in range(50):
        store.add_group(f"g{g:03d}", "task", 0, 2)
        for i in range(2):
            r = rollout(f"g{g:03d}", i, tokens=200 + g)
            store.put(r)
            written[r.rollout_id] = r
    store.close()
    size = db.stat().st_size
    cut = random.Random(seed).randrange(size // 8, size)
    os.truncate(db, cut)
    with pytest.raises(StoreDamagedError, match=str(db)):
        RolloutStore(db)
    counts = salvage(db, tmp_path / "salvaged.sqlite")
    recovered = RolloutStore(tmp_path / "salvaged.sqlite")
    taken = recovered.take_groups(1000, step=1, min_adapter_step=0).groups
    got = {r.rollout_id: r for g in taken for r in g.rollouts}
    assert counts["rollouts"] >= len(got) > 0
    for rid, r in got.items():
        assert r == written[rid], rid
    assert counts["groups"] == 50


def test_concurrent_writers_and_a_reader_lose_and_duplicate_nothing(tmp_path: Path):
    """Four writer threads and a trainer thread taking groups at once: every rollout is stored once,
    and every complete group is taken exactly once."""
    store = RolloutStore(tmp_path / "rollouts.sqlite")
    per_writer, size = 40, 4
    taken: list[str] = []
    done = threading.Event()

    def writer(w: int) -> None:
        for g in range(per_writer):
            gid = f"w{w}-g{g:03d}"
            store.add_group(gid, "task", 0, size)
            for i in range(size):
                store.put(rollout(gid, i, tokens=48))

    def reader() -> None:
        step = 0
        while not done.is_set() or store.ready_groups():
            step += 1
            taken.extend(g.group_id for g in store.take_groups(3, step=step, min_adapter_step=0).groups)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    trainer = threading.Thread(target=reader)
    trainer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    trainer.join(timeout=120)
    assert not trainer.is_alive()
    assert len(taken) == len(set(taken)) == 4 * per_writer
    assert store.counts() == {"ready": 0, "consumed": 4 * per_writer * size, "discarded": 0, "groups": 4 * per_writer}


def test_checkpoint_snapshot_survives_a_damaged_live_store(tmp_path: Path):
    """The copy saved with a checkpoint is independent of the live file: with the live file cut in
    half, the snapshot still opens with everything it held."""
    store = RolloutStore(tmp_path / "live.sqlite")
    for g in range(10):
        store.add_group(f"g{g}", "task", 0, 1)
        store.put(rollout(f"g{g}", 0))
    store.snapshot(tmp_path / "ckpt" / "store.sqlite")
    store.close()
    shutil.copy(tmp_path / "live.sqlite", tmp_path / "live-copy.sqlite")
    os.truncate(tmp_path / "live.sqlite", (tmp_path / "live.sqlite").stat().st_size // 2)
    with pytest.raises(StoreDamagedError):
        RolloutStore(tmp_path / "live.sqlite")
    assert RolloutStore(tmp_path / "ckpt" / "store.sqlite").counts()["ready"] == 10
