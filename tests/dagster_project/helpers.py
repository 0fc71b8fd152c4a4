"""Checkpoint folders as a run writes them, for tests of the platform wiring."""

from pathlib import Path

from training.checkpoint import ADAPTER_DIR, adapter_dir, run_path, write_checkpoint as write_run_checkpoint


def write_checkpoint(home: Path, run_name: str, step: int, **meta) -> Path:
    """Checkpoint ``step`` of run ``run_name`` under ``home``, written by the trainer's own
    :func:`training.checkpoint.write_checkpoint`: an adapter file (none at step 0, the base model)
    and ``metadata.json`` with ``meta``."""

    def fill(tmp: Path) -> None:
        if step:
            adapter_dir(tmp).mkdir()
            (adapter_dir(tmp) / "adapter_model.safetensors").write_bytes(b"\0" * 64)

    metadata = {"run_name": run_name, "adapter": ADAPTER_DIR if step else None, **meta}
    return write_run_checkpoint(run_path(home, run_name), step, fill, metadata)
