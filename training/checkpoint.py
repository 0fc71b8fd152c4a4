"""Checkpoints: ``<run_dir>/checkpoints/step_NNNNNN/``, written under a temporary name and renamed.

A checkpoint holds the adapter (peft folder with safetensors), the optimizer state, every RNG state
(Python, torch), the curriculum state, a snapshot of the rollout store, and ``metadata.json``, which is
written last: the Dagster sensor treats a folder as complete once that file exists, and the rename
makes the whole folder appear at once. Step 0 is the base model: only ``metadata.json``, no adapter.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

STEP_PREFIX = "step_"


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (e.g. the disk is full); nothing of it was left behind."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{step:06d}"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (``metadata.json`` present), ascending."""
    root = Path(run_dir) / "checkpoints"
    steps = []
    for meta in root.glob(f"{STEP_PREFIX}*/metadata.json"):
        try:
            steps.append(int(meta.parent.name.removeprefix(STEP_PREFIX)))
        except ValueError:
            continue
    return sorted(steps)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def write_checkpoint(
    run_dir: Path, step: int, fill: Callable[[Path], None], metadata: dict[str, Any]
) -> Path:
    """Create checkpoint ``step``: ``fill(tmp_dir)`` writes the payload, then ``metadata.json`` is
    written and the folder renamed into place. An existing checkpoint of that step is replaced."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a trainer killed while writing it
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        meta = {"step": step, "created_s": time.time(), **metadata}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        _fsync_tree(tmp)
    except Exception as exc:
        # torch.save on a full disk says only "unexpected pos N vs M": name the cause when it is that.
        cause = f"{type(exc).__name__}: {exc}"
        free = shutil.disk_usage(tmp).free
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < 1024 * 1024:
            cause = f"no space left on the disk, {free} bytes free; {cause}"
        # A full disk (or any failure) leaves no half-written folder behind to fill it further.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(
            f"checkpoint {final} could not be written ({cause}); the earlier checkpoints in {final.parent} are untouched"
        ) from exc
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def read_metadata(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt}: metadata.json is missing (an incomplete checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {ckpt}: metadata.json is not valid JSON: {exc}") from exc
