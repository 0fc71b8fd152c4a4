"""Checkpoints: ``<run_dir>/checkpoints/step_NNNNNN/``, written under a temporary name and renamed.

A checkpoint holds the adapter (peft folder with safetensors), the optimizer state, every RNG state
(Python, torch), the curriculum state, a snapshot of the rollout store, and ``metadata.json``, which is
written last: the Dagster sensor treats a folder as complete once that file exists, and the rename
makes the whole folder appear at once. Step 0 is the base model: only ``metadata.json``, no adapter.

:func:`check_checkpoint` reads every file of a checkpoint before a resume changes anything; a file
that does not load raises :class:`CheckpointLoadError` naming it, and the trainer falls back to the
checkpoint before (``training.loop.RunState``). Nothing is unpickled beyond tensors and plain
containers (``torch.load(..., weights_only=True)``): a checkpoint file cannot run code.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

STEP_PREFIX = "step_"


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (e.g. the disk is full); nothing of it was left behind."""


class CheckpointLoadError(ValueError):
    """A file of a checkpoint does not load; the message names the file and the reason."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


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
    """Every RNG state as plain lists and a tensor (what ``torch.load(weights_only=True)`` reads)."""
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])


def load_rng_state(path: Path) -> dict[str, Any]:
    """The RNG states saved at ``path``, checked for the shape :func:`set_rng_state` needs."""
    state = torch.load(path, weights_only=True, map_location="cpu")
    python = state.get("python") if isinstance(state, dict) else None
    if (not isinstance(python, (list, tuple)) or len(python) != 3 or not isinstance(python[1], (list, tuple))
            or not isinstance(state.get("torch"), torch.Tensor)):
        raise ValueError("expected {'python': [version, [state ints], gauss], 'torch': tensor}")
    return state


@dataclass
class LoadedCheckpoint:
    """What :func:`check_checkpoint` read: the parts the trainer applies itself."""

    metadata: dict[str, Any]
    rng: dict[str, Any] | None
    curriculum: Any


def check_checkpoint(ckpt: Path) -> LoadedCheckpoint:
    """Read every file of checkpoint ``ckpt`` (metadata, adapter safetensors, optimizer, RNG,
    curriculum, store snapshot); the first that does not load raises :class:`CheckpointLoadError`
    naming it. The adapter and optimizer are only read here (the backend loads them)."""
    from safetensors.torch import load_file

    from training.curriculum import Curriculum

    ckpt = Path(ckpt)

    def fail(path: Path, exc: BaseException) -> CheckpointLoadError:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckpointLoadError(f"checkpoint file {path} does not load ({type(exc).__name__}: {reason})", path)

    meta_path = ckpt / "metadata.json"
    try:
        metadata = json.loads(meta_path.read_bytes().decode("utf-8"))
        if not isinstance(metadata, dict):
            raise ValueError("expected a JSON object")
    except (OSError, ValueError) as exc:
        raise fail(meta_path, exc) from exc
    weights = sorted((ckpt / "adapter").glob("*.safetensors"))
    if metadata.get("adapter") and not weights:
        raise fail(ckpt / "adapter", FileNotFoundError("no *.safetensors file in the adapter folder"))
    for path in weights:
        try:
            load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError on a cut or foreign file
            raise fail(path, exc) from exc
    optimizer = ckpt / "optimizer.pt"
    if optimizer.exists():
        try:
            torch.load(optimizer, weights_only=True, map_location="cpu")
        except Exception as exc:  # UnpicklingError, EOFError, RuntimeError from the zip reader...
            raise fail(optimizer, exc) from exc
    rng = None
    if (ckpt / "rng.pt").exists() or metadata.get("adapter"):
        try:
            rng = load_rng_state(ckpt / "rng.pt")
        except Exception as exc:
            raise fail(ckpt / "rng.pt", exc) from exc
    try:
        curriculum = Curriculum.load(ckpt / "curriculum.json")
    except Exception as exc:
        raise fail(ckpt / "curriculum.json", exc) from exc
    snapshot = ckpt / "store.sqlite"
    if snapshot.exists():
        try:
            conn = sqlite3.connect(f"file:{snapshot}?mode=ro", uri=True)
            try:
                result = conn.execute("PRAGMA quick_check").fetchone()
            finally:
                conn.close()
            if result is None or result[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {result[0] if result else 'no answer'}")
        except sqlite3.Error as exc:
            raise fail(snapshot, exc) from exc
    return LoadedCheckpoint(metadata, rng, curriculum)


def read_metadata(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt}: metadata.json is missing (an incomplete checkpoint)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {ckpt}: metadata.json is not valid JSON: {exc}") from exc
