"""Token log-probabilities under an LM head without materializing the full-vocabulary logits.

A 32K-token sequence of a 151,936-token vocabulary has 5·10⁹ logits: 18 GiB in float32, before
``log_softmax`` makes a second copy and autograd keeps a third for backward. The trainer needs only
one number per token, ``log p(target)``, so :func:`token_logprobs` computes the logits a chunk of
tokens at a time (in the model's dtype, then float32 for the log-sum-exp), keeps the hidden states
and the LM head weight for backward, and in backward makes each chunk's logits again to form
``d logits = g · (onehot(target) - softmax)`` and its products with the weight. Peak extra memory is
one chunk's logits (``chunk_tokens × vocab`` floats) instead of the whole sequence's.

    logprobs = token_logprobs(hidden[:, :-1], lm_head.weight, input_ids[:, 1:])   # (batch, seq) float32
    loss, stats = grpo_loss(logprobs, serving_logprobs, loss_mask, advantages)

The GRPO loss itself (``training.grpo``) works on these (batch, seq) values and needs no chunking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 4096


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] per row, chunk by chunk, recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
        acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        out = torch.empty(hidden.shape[0], dtype=acc_dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = F.linear(hidden[start:end], weight).to(acc_dtype)
            out[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            del logits
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if want_weight else None
        grad = grad.to(acc_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            h, g = hidden[start:end], grad[start:end]
            logits = F.linear(h, weight).to(acc_dtype)
            # d/d logits of g · (logits[target] - logsumexp(logits)) = g · (onehot(target) - softmax)
            probs = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()  # in place: one chunk alive
            d_logits = probs.mul_(-g[:, None])
            d_logits.scatter_add_(-1, targets[start:end, None], g[:, None])
            d_logits = d_logits.to(hidden.dtype)
            if want_hidden:
                grad_hidden[start:end] = d_logits @ weight
            if want_weight:
                grad_weight += (d_logits.t() @ h).to(acc_dtype)
            del d_logits, probs, logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T)`` at ``targets``, in float32 (float64 for float64 inputs),
    shaped like ``targets``.

    ``hidden`` (..., hidden_size) are the final hidden states (after the last norm), ``weight``
    (vocab, hidden_size) the LM head, ``targets`` (...) token ids. Gradients reach ``hidden`` and,
    if it requires one, ``weight``; the logits of at most ``chunk_tokens`` rows exist at a time.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: expected hidden = targets + (hidden_size,)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)}: expected (vocab, {hidden.shape[-1]})")
    flat = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_tokens)
    return flat.view(targets.shape)


def full_vocabulary_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same values computed the direct way (all logits in float32, ``log_softmax``, gather): the
    reference :func:`token_logprobs` is checked against."""
    logits = F.linear(hidden, weight)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


__all__ = ["DEFAULT_CHUNK_TOKENS", "full_vocabulary_token_logprobs", "token_logprobs"]
