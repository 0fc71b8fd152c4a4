"""The GRPO step both trainer backends take: micro-batches, the loss, its gradients, one optimizer step.

The loss settings (:class:`training.grpo.LossConfig`) come with each step; a backend supplies how
to score token log-probabilities under its policy (and, for the KL term,
under the reference policy: the same model with its adapter off), what to do after each
micro-batch's backward, and its optimizer step (clipping included); :func:`grpo_train_step` does
the rest the same way for every backend. Each micro-batch's loss is weighted by its share of the
batch's generated tokens, so the step does not depend on how the batch was split: into micro-batches,
nor across data-parallel ranks (``training.backends.parallel``), where each rank takes its shard of the
same batch and the gradients are summed before the optimizer step.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from training.backends.batch import StepResult, micro_batches, pad_rows
from training.backends.parallel import DataParallel, all_reduce_step, select_rows, shard_rows
from training.grpo import LossConfig, TrainBatch, grpo_loss

# (input ids, attention mask), both (rows, longest row) and right-padded -> (rows, longest row)
# log-probabilities, column t that of token t (column 0 is 0)
LogprobsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grpo_train_step(
    batch: TrainBatch,
    loss: LossConfig,
    *,
    micro_batch_tokens: int,
    device: torch.device | str,
    policy_logprobs: LogprobsFn,
    reference_logprobs: LogprobsFn,
    optimizer_step: Callable[[], torch.Tensor | float],
    after_backward: Callable[[], None] | None = None,
    data_parallel: DataParallel = DataParallel(),
    trained: Sequence[torch.Tensor] = (),
) -> StepResult:
    """Accumulate the gradients of ``batch``'s GRPO loss under ``loss`` over micro-batches of at most
    ``micro_batch_tokens`` padded tokens, then call ``optimizer_step`` (which clips, steps and
    returns the gradient norm before clipping). ``reference_logprobs`` is called only when
    ``loss.kl_coef`` is set, and must not record gradients; ``after_backward`` runs after each
    micro-batch's backward. The caller clears the gradients before.

    With ``data_parallel`` of more than one rank, every rank passes the whole step's ``batch``, trains
    on its shard of it, and the gradients of ``trained`` (the tensors the optimizer steps) are summed
    over the ranks before ``optimizer_step``; the result's statistics are the whole step's."""
    step_tokens = batch.generated_tokens  # the whole step's, on every rank
    total_tokens = max(step_tokens, 1)
    if data_parallel.size > 1:
        batch = select_rows(batch, shard_rows(batch, data_parallel.size)[data_parallel.rank])
    sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "w": 0.0, "clip": 0.0}
    for idx in micro_batches(batch.input_ids, micro_batch_tokens):
        ids = pad_rows([batch.input_ids[i] for i in idx], 0, torch.long, device)
        attn = pad_rows([[1] * len(batch.input_ids[i]) for i in idx], 0, torch.long, device)
        mask = pad_rows([batch.loss_mask[i] for i in idx], 0, torch.float32, device)
        serving = pad_rows([batch.serving_logprobs[i] for i in idx], 0.0, torch.float32, device)
        adv = torch.tensor([batch.advantages[i] for i in idx], dtype=torch.float32, device=device)
        logprobs = policy_logprobs(ids, attn)
        ref = reference_logprobs(ids, attn) if loss.kl_coef else None
        value, stats = grpo_loss(logprobs, serving, mask, adv, loss, ref_logprobs=ref)
        share = stats.tokens / total_tokens
        (value * share).backward()
        if after_backward is not None:
            after_backward()
        sums["loss"] += stats.loss * share
        sums["pg"] += stats.pg_loss * share
        sums["kl"] += stats.kl * share
        sums["w"] += stats.mean_is_weight * share
        sums["clip"] += stats.clipped_is_fraction * share
    sums = all_reduce_step(trained, sums, data_parallel)
    grad_norm = optimizer_step()
    return StepResult(
        loss=sums["loss"], pg_loss=sums["pg"], kl=sums["kl"], tokens=step_tokens,
        grad_norm=float(grad_norm), mean_is_weight=sums["w"], clipped_is_fraction=sums["clip"],
    )
