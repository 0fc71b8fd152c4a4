"""Shared helpers of the reliability tests: a tiny model, rollouts to store, and a tmpfs of a given
size for disk-full faults (mounted for real when this process may mount, else the test says why)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from serving.adapters import version_sort_key
from training.rollout import Rollout

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def serves_newest(serving, newest: str) -> bool:
    """A replacement serves ``newest`` (the newest version published before it joined) or a later one:
    a version published while it joined may already have replaced it."""
    return any(version_sort_key(v) >= version_sort_key(newest) for v in serving)


def rollout(group_id: str, index: int, tokens: int = 64, adapter_step: int = 0, reward: float = 1.0) -> Rollout:
    return Rollout(f"{group_id}-{index}", group_id, "task", adapter_step, list(range(tokens)),
                   [0] + [1] * (tokens - 1), [0.0] + [-0.5] * (tokens - 1), reward)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.training.conftest import save_tiny_qwen

    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"))


def _can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """A factory: ``small_disk(size_kib)`` mounts a tmpfs of that size and returns its path (root only)."""
    mounts: list[Path] = []

    def make(size_kib: int) -> Path:
        if not _can_mount():
            pytest.skip("mounting a small tmpfs needs root (the RLIMIT_FSIZE variant of this test still runs)")
        path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
