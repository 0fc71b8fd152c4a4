"""The default trainer backend: a Hugging Face causal LM with a peft LoRA adapter, on the CPU or one GPU
per process, data parallel over the processes of a trainer that torchrun started.

Only the adapter trains; the base weights stay frozen, so the reference policy for the optional KL
term is the same model with the adapter disabled (no second copy in memory). Sequences are packed
into micro-batches of at most ``micro_batch_tokens`` padded tokens; gradients accumulate across them
and the loss is normalized by the generated tokens of the whole batch, so the step does not depend on
how the batch was split.

Data parallel (``training.backends.parallel``): every process holds the whole model (the base is frozen
and fits on one GPU), takes its shard of each step's batch, and the float32 adapter gradients are summed
over the processes in one all-reduce before the optimizer step, so the replicas stay identical. At
construction every replica takes data-parallel rank 0's adapter; only rank 0 writes the adapter and
the optimizer state, which every rank loads, at any number of processes.

``recompute`` chooses what backward recomputes instead of keeping (``training.recompute``):
``"none"`` keeps every activation; ``"full"`` is Hugging Face gradient checkpointing (each decoder
layer keeps its input and is replayed whole in backward); ``"attention_output"`` keeps each layer's
input, attention output and log-sum-exp and replays everything but attention (Qwen2/Qwen3 models;
on CUDA with ``dtype="bfloat16"`` or ``"float16"``, the flash kernels' input types). Its attention
kernels are the fastest ones of the device that match a float32 reference when first used
(``training.attention.chosen_attention_kernels``: cuDNN on Hopper, flash-attn where installed).

With ``dtype="bfloat16"`` (or ``"float16"``) the LoRA factors live in the model's dtype, so no
activation is cast for an adapter, and AdamW steps float32 master copies of them: each step copies
the adapter's gradients up and its weights down once (a few MB), never an activation. Every LoRA
projection adds its rank-r product in the frozen GEMM's epilogue (``addmm``) and every RMSNorm runs
PyTorch's fused ``rms_norm``, in all three recompute modes. Token log-probabilities come from
``training.logprobs.token_logprobs``: the LM head's logits exist ``logits_chunk_tokens`` rows at a
time (float32 for the log-sum-exp), in forward and again in backward, never for the whole sequence.

``fused_kernels`` (by default on CUDA in 16-bit dtypes, never on the CPU) runs the kernels of
``training.fused_step`` behind the same ``train_step``: a frozen LM head's log-probabilities with
each chunk's logits made once, and, with ``recompute="attention_output"``, Qwen3 layers written out
by hand (fused epilogues, compiled norm/RoPE/SwiGLU kernels checked once per process); 1.32x the
tokens/s at 8K and 1.21x at 32K on one H100 (docs/benchmarks.md).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from training.backends import (DEFAULT_MAX_GRAD_NORM, DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_WEIGHT_DECAY,
                               LORA_TARGET_MODULES, StepResult)
from training.backends.parallel import DataParallel, broadcast_from_first
from training.backends.step import grpo_train_step
from training.grpo import LossConfig, TrainBatch
from training.checkpoint import adapter_dir
from training.config import TrainConfig
from training.fused_step import chosen_step_kernels, frozen_head_token_logprobs
from training.logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs
from training.recompute import RECOMPUTE_MODES, keep_attention_output_in_hf_layers, plain_lora


class TorchPeftBackend:
    def __init__(
        self,
        model_path: str | Path,
        *,
        lora_rank: int = TrainConfig.lora_rank,
        lora_alpha: int = TrainConfig.lora_alpha,
        target_modules: Sequence[str] = LORA_TARGET_MODULES,
        learning_rate: float = TrainConfig.learning_rate,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        max_grad_norm: float = DEFAULT_MAX_GRAD_NORM,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        seed: int = TrainConfig.seed,
        device: str = "cpu",
        recompute: str = TrainConfig.recompute,
        dtype: str = "float32",
        logits_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        data_parallel: DataParallel | None = None,
        fused_kernels: bool | None = None,
    ) -> None:
        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_path}: no config.json (expected a Hugging Face model folder)")
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        if dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, float64, got {dtype!r}")
        if logits_chunk_tokens < 1:
            raise ValueError(f"logits_chunk_tokens must be at least 1, got {logits_chunk_tokens}")
        torch.manual_seed(seed)  # LoRA A matrices are initialized from the global generator
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = self._wrap(base, lora_rank, lora_alpha, target_modules, recompute, device, fused_kernels)
        self._finish_init(recompute, device, max_grad_norm, micro_batch_tokens,
                          logits_chunk_tokens, learning_rate, weight_decay, data_parallel, fused_kernels)

    @classmethod
    def from_model(cls, base: torch.nn.Module, **kwargs) -> "TorchPeftBackend":
        """A backend around an already built Hugging Face causal LM (a benchmark's random-weight
        model made from a config, say); the keyword arguments are those of the constructor but
        ``model_path`` and ``dtype`` (the model's own is used), with the constructor's defaults."""
        defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "dtype"}
        unexpected = sorted(set(kwargs) - set(defaults))
        if unexpected:
            raise TypeError(f"TorchPeftBackend.from_model: unexpected arguments {unexpected}")
        args = {**defaults, **kwargs}
        self = cls.__new__(cls)
        recompute, device = args["recompute"], args["device"]
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        torch.manual_seed(args["seed"])
        self.model = cls._wrap(base, args["lora_rank"], args["lora_alpha"], args["target_modules"], recompute, device,
                               args["fused_kernels"])
        self._finish_init(recompute, device, args["max_grad_norm"], args["micro_batch_tokens"],
                          args["logits_chunk_tokens"], args["learning_rate"], args["weight_decay"], args["data_parallel"],
                          args["fused_kernels"])
        return self

    @staticmethod
    def _wrap(base, lora_rank, lora_alpha, target_modules, recompute, device, fused_kernels=None):
        lora = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM",
        )
        # autocast_adapter_dtype=False: the adapter takes the model's dtype (peft would make it
        # float32 and cast every activation that enters it, in forward and backward)
        model = get_peft_model(base, lora, autocast_adapter_dtype=False).to(device)
        fuse_lora_linears(model)
        fuse_rms_norms(model)
        if recompute == "full":
            hf = model.get_base_model()
            if hasattr(hf, "activation_checkpointing_enable"):  # the newer name of the same switch
                hf.activation_checkpointing_enable({"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif recompute == "attention_output":
            keep_attention_output_in_hf_layers(model, fused=fused_kernels)
        return model

    def _finish_init(self, recompute, device, max_grad_norm, micro_batch_tokens,
                     logits_chunk_tokens, learning_rate, weight_decay, data_parallel, fused_kernels=None) -> None:
        # one replica unless given its data-parallel place (training.backends.build_replica in a trainer
        # of several processes): a backend built on one rank alone, e.g. as a reference, steps alone
        self.data_parallel = data_parallel or DataParallel()
        self.recompute = recompute
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.logits_chunk_tokens = logits_chunk_tokens
        self.fused_kernels = fused_kernels
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        broadcast_from_first(self.params, self.data_parallel)
        # float32 master weights for 16-bit adapters; the adapter itself where it is float32 already
        self.masters = [p if p.dtype in (torch.float32, torch.float64) else p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=learning_rate, weight_decay=weight_decay)

    # -- the step -----------------------------------------------------------------------------

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log π(token_t | tokens_<t) for t >= 1, aligned so column t is token t (column 0 is 0)."""
        if self.recompute == "attention_output" and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("recompute='attention_output' needs right-padded rows (attention runs causal, unmasked)")
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: attention runs plain causal (stock SDPA's fastest kernels)
        hf = self.model.get_base_model()
        head = hf.get_output_embeddings()
        decoder = getattr(hf, "model", None)
        if decoder is None or type(head) is not torch.nn.Linear or head.bias is not None:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            logits = out.logits[:, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            if not head.weight.requires_grad and self._fused(hidden):
                kernels = chosen_step_kernels(hidden.device, hidden.dtype).kernels
                lp = frozen_head_token_logprobs(hidden[:, :-1], head.weight, input_ids[:, 1:], self.logits_chunk_tokens, kernels)
            else:
                lp = token_logprobs(hidden[:, :-1], head.weight, input_ids[:, 1:], self.logits_chunk_tokens)
        return torch.nn.functional.pad(lp, (1, 0))

    def _fused(self, hidden: torch.Tensor) -> bool:
        """Whether the fused kernels (``training.fused_step``) run: as ``fused_kernels`` says, or by
        default on CUDA in 16-bit dtypes."""
        if self.fused_kernels is None:
            return hidden.device.type == "cuda" and hidden.dtype in (torch.bfloat16, torch.float16)
        return self.fused_kernels

    def train_step(self, batch: TrainBatch, loss: LossConfig) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        return grpo_train_step(
            batch, loss, micro_batch_tokens=self.micro_batch_tokens, device=self.device,
            policy_logprobs=self.token_logprobs, reference_logprobs=self._reference_logprobs,
            after_backward=self._accumulate_master_grads, optimizer_step=self._optimizer_step,
            data_parallel=self.data_parallel, trained=self.masters,
        )

    def _reference_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token log-probabilities under the base model (the adapter disabled), for the KL term."""
        with torch.no_grad(), self.model.disable_adapter():
            return self.token_logprobs(input_ids, attention_mask)

    def _optimizer_step(self) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.optimizer.step()
        self._copy_masters_to_model()
        return grad_norm

    def refresh_masters(self) -> None:
        """Take the float32 masters from the adapter's weights; call after editing those in place
        (a 16-bit adapter's optimizer steps the masters and copies them down, overwriting edits)."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master is not p:
                    master.copy_(p)

    def _accumulate_master_grads(self) -> None:
        """Add each micro-batch's 16-bit adapter gradients into the float32 masters' (summing them
        in bf16 across micro-batches would round at every addition). One multi-tensor copy or add
        over the adapter's tensors (504 for the Qwen3-8B shape) instead of a kernel each: on a GPU
        the step sits idle while a loop of small launches runs."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p and p.grad is not None]
        fresh = [(p, m) for p, m in pairs if m.grad is None]
        summed = [(p, m) for p, m in pairs if m.grad is not None]
        if fresh:
            grads = [torch.empty_like(m) for _, m in fresh]
            torch._foreach_copy_(grads, [p.grad for p, _ in fresh])  # bf16 -> float32, as p.grad.float()
            for (_, m), g in zip(fresh, grads):
                m.grad = g
        if summed:
            torch._foreach_add_([m.grad for _, m in summed], [p.grad for p, _ in summed])
        for p, _ in pairs:
            p.grad = None

    def _copy_masters_to_model(self) -> None:
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    # -- adapter and state --------------------------------------------------------------------

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def save_adapter(self, directory: Path) -> None:
        """Write the peft folder; on data-parallel rank 0 only (the replicas are identical)."""
        if self.data_parallel.rank == 0:
            self.model.save_pretrained(str(directory))

    def save_state(self, directory: Path) -> None:
        """Write the adapter, the optimizer state and the float32 masters; on data-parallel rank 0 only."""
        if self.data_parallel.rank != 0:
            return
        directory = Path(directory)
        self.save_adapter(adapter_dir(directory))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        if any(m is not p for p, m in zip(self.params, self.masters)):
            # the adapter folder holds the 16-bit weights; resume from the float32 masters
            torch.save([m.detach().cpu() for m in self.masters], directory / "master_weights.pt")

    def load_state(self, directory: Path) -> None:
        directory = Path(directory)
        weights = adapter_dir(directory) / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: {weights.name} is missing under adapter/")
        result = set_peft_model_state_dict(self.model, load_file(str(weights), device=self.device))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"checkpoint {directory}: unexpected adapter keys {result.unexpected_keys[:3]}")
        masters_file = directory / "master_weights.pt"
        with torch.no_grad():
            if masters_file.is_file():
                saved = torch.load(masters_file, map_location=self.device, weights_only=True)
                if len(saved) != len(self.masters) or any(s.shape != m.shape for s, m in zip(saved, self.masters)):
                    raise ValueError(f"checkpoint {directory}: {masters_file.name} does not match the adapter's parameters")
                for master, value in zip(self.masters, saved):
                    master.copy_(value)
                self._copy_masters_to_model()
        if not masters_file.is_file():
            self.refresh_masters()
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True))


# -- kernels shared by every recompute mode ----------------------------------------------------


def _fused_lora_forward(module: torch.nn.Module, original):
    """``x @ W.T`` plus each active adapter's ``scaling · (x @ A.T) @ B.T`` added in the GEMM's
    epilogue (``addmm``): no separate scale and sum passes over the (tokens, out) output. Falls back
    to peft's forward where the module does more (see ``training.recompute.plain_lora``) or the
    adapter's dtype differs from the input's."""
    def forward(x, *args, **kwargs):
        parts = plain_lora(module) if not args and not kwargs else None
        if parts is None:
            return original(x, *args, **kwargs)
        weight, adapters = parts
        if any(a.weight.dtype != x.dtype or b.weight.dtype != x.dtype for a, b, _ in adapters) or weight.dtype != x.dtype:
            return original(x, *args, **kwargs)
        out = F.linear(x, weight)
        for a, b, scaling in adapters:
            xa = F.linear(x, a.weight)
            out = torch.addmm(out.reshape(-1, out.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.weight.t(),
                              alpha=scaling).view(out.shape)
        return out

    return forward


def fuse_lora_linears(model: torch.nn.Module) -> int:
    """Give every peft LoRA linear of ``model`` the fused forward above; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and type(module.base_layer) is torch.nn.Linear:
            module.forward = _fused_lora_forward(module, module.forward)
            count += 1
    return count


def _fused_rms_norm_forward(module: torch.nn.Module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(x):
        return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight, eps)

    return forward


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Run every Hugging Face ``*RMSNorm`` of ``model`` (weight times the normalized input, no
    offset) through ``torch.nn.functional.rms_norm``, one fused kernel, instead of its float32
    upcast and five elementwise passes; returns how many."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and name.startswith(("Qwen2", "Qwen3", "Llama")) and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.forward = _fused_rms_norm_forward(module)
            count += 1
    return count
