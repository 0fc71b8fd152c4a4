"""A run killed with SIGKILL mid-way and resumed from its newest checkpoint reaches the same
per-step losses as an uninterrupted run with the same seeds; nothing finished is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from training.checkpoint import complete_steps
from training.store import RolloutStore

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, model: Path) -> Path:
    cfg = {
        "run_name": "resume", "base_model": str(model), "steps": 6, "groups_per_step": 2, "group_size": 4,
        "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 2, "lora_rank": 4, "learning_rate": 0.05,
        "max_new_tokens": 6, "seed": 11, "environment": "tests.training.envs:make",
    }
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(cfg))
    return path


def _run(config: Path, run_dir: Path, kill_at_step: int | None = None) -> str:
    cmd = [sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if kill_at_step is not None and line.startswith(f"step {kill_at_step:4d}"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    text = "".join(out)
    if kill_at_step is None:
        assert proc.returncode == 0, text
    return text


def _losses(run_dir: Path) -> list[float]:
    frame = pd.read_parquet(run_dir / "metrics" / "steps.parquet")
    return frame.sort_values("step")["loss"].tolist()


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted(tmp_path: Path, tiny_model_dir: Path):
    config = _config(tmp_path, tiny_model_dir)
    straight = tmp_path / "straight"
    _run(config, straight)
    resumed = tmp_path / "resumed"
    _run(config, resumed, kill_at_step=5)  # checkpoint 4 is complete, step 5 is not checkpointed
    assert complete_steps(resumed) == [0, 2, 4]
    out = _run(config, resumed)
    assert "resumed from checkpoint 4" in out
    assert complete_steps(resumed) == [0, 2, 4, 6]
    want, got = _losses(straight), _losses(resumed)
    assert len(want) == len(got) == 6
    assert got == pytest.approx(want, abs=1e-6)
    assert any(abs(x) > 1e-4 for x in want)  # the losses are not trivially zero
    # every rollout either run stored is still there; the resumed run reused step 5's groups
    counts = RolloutStore(resumed / "store" / "rollouts.sqlite").counts()
    assert counts["consumed"] == 6 * 2 * 4 and counts["ready"] == 0
    ckpt = resumed / "checkpoints" / "step_000006"
    for name in ("adapter/adapter_model.safetensors", "optimizer.pt", "rng.pt", "curriculum.json", "store.sqlite", "metadata.json"):
        assert (ckpt / name).is_file(), name
