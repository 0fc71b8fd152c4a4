"""Partitions of the asset graph.

Every saved checkpoint of every run is one partition of ``checkpoints`` and of ``deepswe_eval``.
Keys are ``<run_name>-step_NNNNNN``: the run's name and its checkpoint folder's name
(:func:`training.checkpoint.checkpoint_name`, zero-padded so keys sort in step order).
Step 0 of a run is its base model (no adapter), which is what evals compare against.
"""

from __future__ import annotations

import re

import dagster as dg

from training.checkpoint import STEP_PREFIX, checkpoint_name

checkpoints_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")

_KEY = re.compile(rf"^(?P<run>[A-Za-z0-9][A-Za-z0-9_.]*(?:-[A-Za-z0-9_.]+)*)-{STEP_PREFIX}(?P<step>\d{{6}})$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def checkpoint_partition_key(run_name: str, step: int) -> str:
    """The partition key of ``run_name``'s checkpoint at ``step``."""
    if not _RUN_NAME.match(run_name):
        raise ValueError(f"run name {run_name!r}: expected letters, digits, '.', '_' or '-'")
    if not 0 <= step <= 999_999:
        raise ValueError(f"step {step}: expected 0..999999")
    return f"{run_name}-{checkpoint_name(step)}"


def parse_checkpoint_partition_key(key: str) -> tuple[str, int]:
    """Split ``<run_name>-step_NNNNNN`` into the run name and the step."""
    match = _KEY.match(key)
    if not match:
        raise ValueError(f"checkpoint partition key {key!r}: expected '<run_name>-step_NNNNNN'")
    return match["run"], int(match["step"])
