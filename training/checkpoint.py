"""The run directory and its checkpoints: the one place their layout is written down.

Everything a run writes lives under ``$POSTTRAIN_HOME/runs/<run_name>/`` (:func:`run_path`)::

    store/rollouts.sqlite          the rollout store (:func:`store_path`)
    adapters/<version>/            published adapters, for replicas that join later (:func:`adapters_volume`)
    checkpoints/step_NNNNNN/       one folder per saved step (:func:`checkpoint_path`)
        adapter/                   the peft adapter (:func:`adapter_dir`), absent at step 0
        metadata.json              written last (:func:`read_metadata`)
    metrics/                       steps.parquet, bins.parquet (:func:`metrics_dir`)
    logs/                          engine logs, lost-episodes.jsonl (:func:`logs_dir`)
    trainer.lock                   held by the run's one trainer (:func:`lock_path`)

The trainer, the Dagster sensor and assets, and the tests all go through these functions, so a
change of layout is made here once. :func:`list_checkpoints` lists the complete checkpoints of a run.

Checkpoints are written under a temporary name and renamed (:func:`write_checkpoint`).

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
import re
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from training.curriculum import Curriculum

# torch is imported where tensors are read or written: the layout functions below are also used by
# the Dagster code location, which should load without it.

STEP_PREFIX = "step_"
METADATA_FILE = "metadata.json"
ADAPTER_DIR = "adapter"
_CHECKPOINT_NAME = re.compile(rf"^{STEP_PREFIX}(\d{{6,}})$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (e.g. the disk is full); nothing of it was left behind."""


class CheckpointLoadError(ValueError):
    """A file of a checkpoint does not load; the message names the file and what was expected."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class IncompleteCheckpointError(CheckpointLoadError, FileNotFoundError):
    """The checkpoint has no ``metadata.json`` (still being written, or not a checkpoint)."""


def _load_error(path: Path, exc: BaseException, prefix: str = "", expected: str = "") -> CheckpointLoadError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CheckpointLoadError(f"{prefix}checkpoint file {path} does not load ({type(exc).__name__}: {reason})"
                               + (f"; expected {expected}" if expected else ""), path)


# -- the run directory -----------------------------------------------------------------------------


def runs_root(home: str | os.PathLike[str]) -> Path:
    """``HOME/runs``: one folder per run."""
    return Path(home) / "runs"


def run_path(home: str | os.PathLike[str], run_name: str) -> Path:
    """``HOME/runs/RUN_NAME``: where everything of one run lives."""
    return runs_root(home) / run_name


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    """``step_NNNNNN``, zero-padded so names sort in step order."""
    return f"{STEP_PREFIX}{step:06d}"


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    return checkpoints_dir(run_dir) / checkpoint_name(step)


def adapter_dir(ckpt: str | os.PathLike[str]) -> Path:
    """The peft adapter folder inside a checkpoint folder."""
    return Path(ckpt) / ADAPTER_DIR


def store_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "store" / "rollouts.sqlite"


def adapters_volume(run_dir: str | os.PathLike[str]) -> Path:
    """Published adapter versions, one folder each, for engine replicas that join later."""
    return Path(run_dir) / "adapters"


def logs_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "logs"


def metrics_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "metrics"


def lock_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "trainer.lock"


@dataclass(frozen=True)
class SavedCheckpoint:
    """A complete checkpoint of a run: its step and folder; :meth:`metadata` reads its ``metadata.json``."""

    step: int
    path: Path

    def metadata(self) -> dict[str, Any]:
        return read_metadata(self.path)


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[SavedCheckpoint]:
    """The complete checkpoints of a run (``metadata.json`` present), in step order.

    Folders being written (temporary names) and folders whose name is not ``step_NNNNNN`` are left
    out. The metadata is read on demand, so one damaged file does not hide the other checkpoints.
    """
    found = []
    for meta in checkpoints_dir(run_dir).glob(f"{STEP_PREFIX}*/{METADATA_FILE}"):
        match = _CHECKPOINT_NAME.match(meta.parent.name)
        if match and checkpoint_name(int(match[1])) == meta.parent.name:
            found.append(SavedCheckpoint(int(match[1]), meta.parent))
    return sorted(found, key=lambda c: c.step)


def complete_steps(run_dir: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint, ascending (the steps of :func:`list_checkpoints`)."""
    return [c.step for c in list_checkpoints(run_dir)]


def read_metadata(ckpt: str | os.PathLike[str], *, name: str | None = None) -> dict[str, Any]:
    """The ``metadata.json`` of checkpoint folder ``ckpt`` as a dict.

    Every problem raises :class:`CheckpointLoadError` naming the file and what was expected; a
    missing file raises :class:`IncompleteCheckpointError` (also a ``FileNotFoundError``). ``name``
    (e.g. a partition key) prefixes the message, as the caller knows the checkpoint.
    """
    path = Path(ckpt) / METADATA_FILE
    prefix = f"checkpoint {name}: " if name else ""
    if not path.is_file():
        raise IncompleteCheckpointError(
            f"{prefix}checkpoint file {path} is missing; a checkpoint is complete only once its "
            f"{METADATA_FILE} is written", path)
    try:
        metadata = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(metadata, dict):
            raise ValueError(f"a JSON {type(metadata).__name__}")
    except (OSError, ValueError) as exc:
        raise _load_error(path, exc, prefix, "a JSON object") from exc
    return metadata


@dataclass(frozen=True)
class CheckpointPolicy:
    """What serves a checkpoint: the base model folder and the adapter on it (none at step 0)."""

    base_model: Path
    adapter: Path | None
    adapter_version: str | None


def checkpoint_policy(ckpt: str | os.PathLike[str], *, name: str) -> CheckpointPolicy:
    """The policy of checkpoint folder ``ckpt`` from its metadata; ``name`` labels errors and is the
    adapter version when the metadata gives none."""
    meta = read_metadata(ckpt, name=name)
    base_model = meta.get("base_model")
    if not base_model or not Path(base_model).is_dir():
        raise FileNotFoundError(f"checkpoint {name}: metadata key 'base_model' ({base_model!r}) is not a model folder")
    if not meta.get("adapter"):
        return CheckpointPolicy(Path(base_model), None, None)
    return CheckpointPolicy(Path(base_model), adapter_dir(ckpt), meta.get("adapter_version") or name)


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
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
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
    # heavy: torch (see the note at the top)
    import torch

    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    # heavy: torch (see the note at the top)
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])


def load_rng_state(path: Path) -> dict[str, Any]:
    """The RNG states saved at ``path``, checked for the shape :func:`set_rng_state` needs."""
    # heavy: torch (see the note at the top)
    import torch

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
    # heavy: torch and safetensors (see the note at the top)
    import torch
    from safetensors.torch import load_file


    ckpt = Path(ckpt)
    metadata = read_metadata(ckpt)
    weights = sorted(adapter_dir(ckpt).glob("*.safetensors"))
    if metadata.get("adapter") and not weights:
        raise _load_error(adapter_dir(ckpt), FileNotFoundError("no *.safetensors file in the adapter folder"))
    for path in weights:
        try:
            load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError on a cut or foreign file
            raise _load_error(path, exc) from exc
    optimizer = ckpt / "optimizer.pt"
    if optimizer.exists():
        try:
            torch.load(optimizer, weights_only=True, map_location="cpu")
        except Exception as exc:  # UnpicklingError, EOFError, RuntimeError from the zip reader...
            raise _load_error(optimizer, exc) from exc
    rng = None
    if (ckpt / "rng.pt").exists() or metadata.get("adapter"):
        try:
            rng = load_rng_state(ckpt / "rng.pt")
        except Exception as exc:
            raise _load_error(ckpt / "rng.pt", exc) from exc
    try:
        curriculum = Curriculum.load(ckpt / "curriculum.json")
    except Exception as exc:
        raise _load_error(ckpt / "curriculum.json", exc) from exc
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
            raise _load_error(snapshot, exc) from exc
    return LoadedCheckpoint(metadata, rng, curriculum)

