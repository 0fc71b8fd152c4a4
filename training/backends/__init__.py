"""Trainer backends: what steps the policy, as a small protocol.

The loop (``training.loop``) owns everything around a step: which rollouts form the batch, their
advantages, checkpoints and publication. A backend owns the model and optimizer (and its own
engineering knobs: micro-batch size, recompute, device): it turns one :class:`training.grpo.TrainBatch`
and the run's :class:`training.grpo.LossConfig` into one optimizer step and can save, load and export
its adapter. The loss settings are not the backend's: each step is given them.

Two implementations: ``training.backends.torch_peft`` (the default: a Hugging Face causal LM with a
peft LoRA adapter, on the CPU or one GPU per process) and a Megatron-core backend for large models
(``training.backends.megatron``, tensor parallel). Both train data parallel over the processes of a
trainer started by torchrun (``training.backends.parallel``). :func:`load_backend` picks one by name,
importing lazily so that the Megatron dependency is only needed when asked for.

A backend's settings that are trainer config keys (:data:`training.config.BACKEND_KEYS`: ``lora_rank``,
``lora_alpha``, ``learning_rate``, ``seed``, ``recompute``) default to :class:`training.config.TrainConfig`'s;
those that are not (the LoRA target modules, weight decay, gradient clip, micro-batch size) are written
once below, for every backend.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from training.backends import parallel
from training.backends.batch import StepResult, micro_batches, pad_rows
from training.backends.parallel import DataParallel
from training.config import BACKENDS
from training.grpo import LossConfig, TrainBatch  # for the type hints only; TrainBatch lives in training.grpo

__all__ = ["DEFAULT_MAX_GRAD_NORM", "DEFAULT_MICRO_BATCH_TOKENS", "DEFAULT_WEIGHT_DECAY", "LORA_TARGET_MODULES",
           "StepResult", "TrainerBackend", "backend_class", "backend_default_device", "build_replica",
           "load_backend", "micro_batches", "pad_rows"]

# The defaults of every backend's keyword arguments that are not trainer config keys: target_modules
# (the adapter's LoRA projections, every linear layer of a decoder layer; megatron takes only these),
# weight_decay, max_grad_norm and micro_batch_tokens.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_WEIGHT_DECAY = 0.0  # AdamW's, on the adapter
DEFAULT_MAX_GRAD_NORM = 1.0  # the gradient-norm clip of each optimizer step
DEFAULT_MICRO_BATCH_TOKENS = 8192  # padded tokens per forward/backward; gradients accumulate across them


@runtime_checkable
class TrainerBackend(Protocol):
    """What the RL loop needs from a trainer."""

    def train_step(self, batch: TrainBatch, loss: LossConfig) -> StepResult:
        """Compute the GRPO loss of ``batch`` under the current policy with the settings ``loss`` and
        take one optimizer step."""
        ...

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights as published to engines (peft names, CPU tensors)."""
        ...

    def save_adapter(self, directory: Path) -> None:
        """Write the adapter as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        ...

    def save_state(self, directory: Path) -> None:
        """Write everything needed to resume: adapter and optimizer state."""
        ...

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        ...


def load_backend(name: str, **kwargs: Any) -> TrainerBackend:
    """Build the backend called ``name`` (one of :data:`BACKENDS`) with ``kwargs``.

    On rank 0 of a trainer of several processes (``training.backends.parallel.start_ranks``) every
    other rank builds its own replica with the same arguments, and the backend returned here makes
    each call on all of them (:class:`training.backends.parallel.LeadBackend`)."""
    backend_class(name)  # a wrong name fails here, before any other rank is asked to build it
    lead = parallel.leading()
    if lead is None:
        return backend_class(name)(**kwargs)
    return parallel.LeadBackend(lead, lead.call("build", (name, kwargs), lambda: build_replica(name, kwargs)))


def build_replica(name: str, kwargs: dict[str, Any]) -> TrainerBackend:
    """This process's replica of the backend called ``name`` in a trainer of several processes: a
    backend that takes ``data_parallel`` (torch/peft) gets every process of the world as a replica;
    one that derives its replicas itself (Megatron, from its tensor-parallel size) is built as asked."""
    cls = backend_class(name)
    if "data_parallel" in inspect.signature(cls).parameters:
        kwargs = {**kwargs, "data_parallel": DataParallel.of_world()}
    return cls(**kwargs)


def backend_default_device(name: str) -> str:
    """Where the backend called ``name`` trains when the trainer config names no ``device``: its
    constructor's default (``cpu`` for torch_peft, ``cuda`` for megatron)."""
    return inspect.signature(backend_class(name)).parameters["device"].default


def backend_class(name: str) -> type:
    """The class of the backend called ``name``, imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"trainer backend {name!r}: expected one of {', '.join(sorted(BACKENDS))}")
    module_name, _, cls_name = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
