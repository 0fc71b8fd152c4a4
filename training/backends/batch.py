"""What a trainer backend reports for a step, and how it cuts a step's batch
(:class:`training.grpo.TrainBatch`) into padded micro-batches. Re-exported by
:mod:`training.backends`, where the protocol is."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepResult:
    loss: float
    pg_loss: float
    kl: float
    tokens: int
    grad_norm: float
    mean_is_weight: float
    clipped_is_fraction: float


def micro_batches(input_ids: list[list[int]], micro_batch_tokens: int) -> list[list[int]]:
    """Row indices grouped shortest first so each padded micro-batch holds at most
    ``micro_batch_tokens`` tokens (a single longer row still gets a micro-batch of its own)."""
    order = sorted(range(len(input_ids)), key=lambda i: len(input_ids[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([len(input_ids[j]) for j in current] + [len(input_ids[i])])
        if current and longest * (len(current) + 1) > micro_batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def pad_rows(rows: list[list], value: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Right-pad ``rows`` with ``value`` to the longest one, as one tensor."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype, device=device)
