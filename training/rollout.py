"""One finished rollout: the exact tokens an engine produced for one episode, and its reward.

``input_ids`` is the whole token sequence of the episode as the engine saw it (prompt, then every
model turn and every tool observation in order). ``loss_mask`` is 1 exactly on the tokens the model
generated; ``serving_logprobs`` holds the engine's log-probability of each of those tokens (0 where
the mask is 0). ``adapter_step`` is the training step whose adapter sampled the rollout (0 is the
base model): the trainer uses it to measure policy lag. The adapter's name, ``step_000012``, is its
``adapter_version`` (the harness's, the eval rows'); the rollout store keeps the step in a column
that existing stores call ``adapter_version`` (:mod:`training.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rollout:
    rollout_id: str
    group_id: str
    task_id: str
    adapter_step: int
    input_ids: list[int]
    loss_mask: list[int]
    serving_logprobs: list[float]
    reward: float
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.serving_logprobs) != n:
            raise ValueError(
                f"rollout {self.rollout_id}: input_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"serving_logprobs ({len(self.serving_logprobs)}) must have one length"
            )
        if n and self.loss_mask[0]:
            raise ValueError(f"rollout {self.rollout_id}: the first token cannot be model-generated")

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)
