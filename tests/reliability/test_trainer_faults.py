"""The trainer killed with SIGKILL mid-step and while writing a checkpoint, and a checkpoint written
to a full disk. Promises (training/__main__.py, training/checkpoint.py, DESIGN "Rollout store"): the
run resumes from the newest complete checkpoint with the rollouts unused at that checkpoint; a
half-written checkpoint is never used; a full disk leaves the previous checkpoint intact and says so."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import REPO
from training.checkpoint import CheckpointWriteError, complete_steps, write_checkpoint
from training.store import RolloutStore


def _config(tmp_path: Path, model: Path) -> Path:
    cfg = {
        "run_name": "faults", "base_model": str(model), "steps": 6, "groups_per_step": 2, "group_size": 2,
        "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 2, "lora_rank": 4, "learning_rate": 0.05,
        "max_new_tokens": 4, "seed": 5, "environment": "tests.reliability.faulty_env:make",
    }
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(cfg))
    return path


def _trainer(config: Path, run_dir: Path, kill_on: str | None = None, **fault_env: str) -> str:
    """Run the trainer; with ``kill_on``, SIGKILL it as soon as it prints that line."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **fault_env}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    proc = subprocess.Popen([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run_dir)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        out.append(line)
        if kill_on is not None and line.startswith(kill_on):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    text = "".join(out)
    if kill_on is None:
        assert proc.returncode == 0, text
    else:
        assert proc.returncode == -signal.SIGKILL, text
    return text


def _statuses(run_dir: Path) -> dict[str, tuple[str, int | None]]:
    conn = sqlite3.connect(run_dir / "store" / "rollouts.sqlite")
    try:
        return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT rollout_id, status, status_step FROM rollouts")}
    finally:
        conn.close()


def test_trainer_killed_in_a_checkpoint_then_mid_step_resumes_with_unused_rollouts(tmp_path: Path, tiny_model_dir: Path):
    config = _config(tmp_path, tiny_model_dir)
    run = tmp_path / "run"

    # 1. killed while writing checkpoint 4: the adapter and optimizer are on disk, metadata.json is not
    _trainer(config, run, kill_on="FAULT in-checkpoint 4", POSTTRAIN_FAULT_HANG_IN_CHECKPOINT="4")
    assert complete_steps(run) == [0, 2]
    half = list((run / "checkpoints").glob(".tmp-step_000004-*"))
    assert len(half) == 1 and (half[0] / "optimizer.pt").is_file() and not (half[0] / "metadata.json").exists()
    before = _statuses(run)
    assert sum(1 for s, _ in before.values() if s == "consumed") == 4 * 2 * 2  # steps 1-4 trained

    # 2. resumed from checkpoint 2 (never from the half-written 4), killed after step 5 took its groups
    out = _trainer(config, run, kill_on="FAULT in-step 5", POSTTRAIN_FAULT_HANG_IN_STEP="5")
    assert "resumed from checkpoint 2" in out
    assert complete_steps(run) == [0, 2, 4]
    assert not list((run / "checkpoints").glob(".tmp-*")), "the half-written checkpoint was cleared, not used"
    mid = _statuses(run)
    # steps 3 and 4 re-used the groups they had taken before the first kill: none generated twice
    for rid, (status, step) in before.items():
        if step in (3, 4):
            assert mid[rid] == ("consumed", step), rid
    step5 = {rid for rid, (s, st) in mid.items() if st == 5}
    assert len(step5) == 2 * 2

    # 3. resumed from checkpoint 4: step 5's groups, taken but never trained on, are used again
    out = _trainer(config, run)
    assert "resumed from checkpoint 4" in out
    assert complete_steps(run) == [0, 2, 4, 6]
    after = _statuses(run)
    assert {rid for rid, (s, st) in after.items() if st == 5} == step5
    counts = RolloutStore(run / "store" / "rollouts.sqlite").counts()
    assert counts == {"ready": 0, "consumed": 6 * 2 * 2, "discarded": 0, "groups": 6 * 2}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _payload(size_bytes: int):
    def fill(tmp: Path) -> None:
        torch.save({"state": torch.zeros(size_bytes // 4, dtype=torch.float32)}, tmp / "optimizer.pt")
        (tmp / "curriculum.json").write_text("{}")

    return fill


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path: Path, small_disk):
    """On a real 2 MiB tmpfs: checkpoint 2 fits, checkpoint 4 does not. Writing 4 raises an error
    naming the checkpoint and the cause, checkpoint 2 is byte-identical, nothing half-written is left
    (so the disk is not left full), and once there is room checkpoint 4 is written."""
    run = small_disk(2048)
    write_checkpoint(run, 2, _payload(600_000), {"loss": 1.0})
    before = _digest(run / "checkpoints" / "step_000002")
    with pytest.raises(CheckpointWriteError) as err:
        write_checkpoint(run, 4, _payload(1_800_000), {"loss": 0.5})
    message = str(err.value)
    assert "step_000004" in message and "no space left on the disk" in message and "untouched" in message
    assert complete_steps(run) == [2]
    assert _digest(run / "checkpoints" / "step_000002") == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    del err  # its traceback holds torch.save's open file (unlinked, still taking space) until freed
    gc.collect()
    write_checkpoint(run, 4, _payload(600_000), {"loss": 0.5})
    assert complete_steps(run) == [2, 4]


FSIZE_WRITER = """
import resource, signal, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from training.checkpoint import CheckpointWriteError, write_checkpoint
from tests.reliability.test_trainer_faults import _payload
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
try:
    write_checkpoint(Path(sys.argv[1]), 4, _payload(1_500_000), {})
except CheckpointWriteError as exc:
    print("ERROR", exc)
"""


def test_file_size_limit_during_a_checkpoint_keeps_the_previous_one(tmp_path: Path):
    """The same fault without root: the writing process has RLIMIT_FSIZE below the checkpoint's size
    (the kernel answers EFBIG, as a quota would)."""
    run = tmp_path / "run"
    write_checkpoint(run, 2, _payload(200_000), {})
    before = _digest(run / "checkpoints" / "step_000002")
    done = subprocess.run([sys.executable, "-c", FSIZE_WRITER, str(run), str(REPO)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.startswith("ERROR checkpoint "), done.stdout + done.stderr
    # torch.save reports EFBIG only as "unexpected pos N vs M"; the message still names the checkpoint
    assert "step_000004 could not be written" in done.stdout and "untouched" in done.stdout
    assert complete_steps(run) == [2]
    assert _digest(run / "checkpoints" / "step_000002") == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]


def test_trainer_with_async_producers_killed_and_resumed_takes_no_group_twice(tmp_path: Path, tiny_model_dir: Path):
    """Producers on worker threads (``producer_workers = 2``) live in the trainer process; SIGKILL takes
    them down mid-group. After the resume every rollout stored before the kill is still there, no group
    is trained on twice, and a group left half-written by the kill is never trained on."""
    cfg = json.loads(_config(tmp_path, tiny_model_dir).read_text())
    cfg.update(producer_workers=2, max_policy_lag=1, steps=4)
    config = tmp_path / "async.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    _trainer(config, run, kill_on="step    3")
    before = _statuses(run)
    out = _trainer(config, run)
    assert "resumed from checkpoint 2" in out
    after = _statuses(run)
    assert set(before) <= set(after)  # nothing stored was lost
    conn = sqlite3.connect(run / "store" / "rollouts.sqlite")
    sizes = dict(conn.execute("SELECT g.group_id, COUNT(r.rollout_id) FROM groups g LEFT JOIN rollouts r "
                              "ON r.group_id = g.group_id GROUP BY g.group_id").fetchall())
    steps_of = {}
    for gid, step in conn.execute("SELECT group_id, status_step FROM rollouts WHERE status='consumed'"):
        steps_of.setdefault(gid, set()).add(step)
    conn.close()
    assert all(len(s) == 1 for s in steps_of.values()), "a group was taken by two steps"
    assert all(sizes[g] == cfg["group_size"] for g in steps_of), "a half-written group was trained on"
    assert sorted(st for s in steps_of.values() for st in s) == sorted([1, 2, 3, 4] * cfg["groups_per_step"])
