"""Checkpoint folders as a run writes them, for tests of the platform wiring."""

import json
from pathlib import Path


def write_checkpoint(home: Path, run_name: str, step: int, **meta) -> Path:
    """Write ``runs/<run>/checkpoints/step_NNNNNN`` with an adapter file and ``metadata.json``."""
    ckpt = home / "runs" / run_name / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    (ckpt / "metadata.json").write_text(json.dumps({"step": step, "run_name": run_name, **meta}))
    return ckpt
