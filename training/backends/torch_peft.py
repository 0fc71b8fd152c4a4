"""The default trainer backend: a Hugging Face causal LM with a peft LoRA adapter, on CPU or one GPU.

Only the adapter trains; the base weights stay frozen, so the reference policy for the optional KL
term is the same model with the adapter disabled (no second copy in memory). Sequences are packed
into micro-batches of at most ``micro_batch_tokens`` padded tokens; gradients accumulate across them
and the loss is normalized by the generated tokens of the whole batch, so the step does not depend on
how the batch was split.

``recompute`` chooses what backward recomputes instead of keeping (``training.recompute``):
``"none"`` keeps every activation; ``"full"`` is Hugging Face gradient checkpointing (each decoder
layer keeps its input and is replayed whole in backward); ``"attention_output"`` keeps each layer's
input, attention output and log-sum-exp and replays everything but attention (Qwen2/Qwen3 models;
on CUDA with ``dtype="bfloat16"`` or ``"float16"``, the flash kernels' input types).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from training.backends import StepResult, TrainBatch, micro_batches, pad_rows
from training.grpo import grpo_loss
from training.recompute import RECOMPUTE_MODES, keep_attention_output_in_hf_layers

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TorchPeftBackend:
    def __init__(
        self,
        model_path: str | Path,
        *,
        lora_rank: int = 16,
        lora_alpha: int = 32,
        target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
        learning_rate: float = 2e-3,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        tis_cap: float = 2.0,
        kl_coef: float = 0.0,
        micro_batch_tokens: int = 8192,
        seed: int = 0,
        device: str = "cpu",
        recompute: str = "none",
        dtype: str = "float32",
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model_path = Path(model_path)
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_path}: no config.json (expected a Hugging Face model folder)")
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        torch.manual_seed(seed)  # LoRA A matrices are initialized from the global generator
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        lora = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, lora).to(device)
        if recompute == "full":
            hf = self.model.get_base_model()
            if hasattr(hf, "activation_checkpointing_enable"):  # the newer name of the same switch
                hf.activation_checkpointing_enable({"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif recompute == "attention_output":
            keep_attention_output_in_hf_layers(self.model)
        self.recompute = recompute
        self.device = device
        self.tis_cap = tis_cap
        self.kl_coef = kl_coef
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)

    # -- the step -----------------------------------------------------------------------------

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log π(token_t | tokens_<t) for t >= 1, aligned so column t is token t (column 0 is 0)."""
        if self.recompute == "attention_output" and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("recompute='attention_output' needs right-padded rows (attention runs causal, unmasked)")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = out.logits[:, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return torch.nn.functional.pad(lp, (1, 0))

    def train_step(self, batch: TrainBatch) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = max(batch.generated_tokens, 1)
        sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "w": 0.0, "clip": 0.0}
        for idx in micro_batches(batch.input_ids, self.micro_batch_tokens):
            ids = pad_rows([batch.input_ids[i] for i in idx], 0, torch.long, self.device)
            attn = pad_rows([[1] * len(batch.input_ids[i]) for i in idx], 0, torch.long, self.device)
            mask = pad_rows([batch.loss_mask[i] for i in idx], 0, torch.float32, self.device)
            serving = pad_rows([batch.serving_logprobs[i] for i in idx], 0.0, torch.float32, self.device)
            adv = torch.tensor([batch.advantages[i] for i in idx], dtype=torch.float32, device=self.device)
            logprobs = self.token_logprobs(ids, attn)
            ref = None
            if self.kl_coef:
                with torch.no_grad(), self.model.disable_adapter():
                    ref = self.token_logprobs(ids, attn)
            loss, stats = grpo_loss(logprobs, serving, mask, adv, tis_cap=self.tis_cap, ref_logprobs=ref, kl_coef=self.kl_coef)
            share = stats.tokens / total_tokens
            (loss * share).backward()
            sums["loss"] += stats.loss * share
            sums["pg"] += stats.pg_loss * share
            sums["kl"] += stats.kl * share
            sums["w"] += stats.mean_is_weight * share
            sums["clip"] += stats.clipped_is_fraction * share
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.optimizer.step()
        return StepResult(
            loss=sums["loss"], pg_loss=sums["pg"], kl=sums["kl"], tokens=batch.generated_tokens,
            grad_norm=float(grad_norm), mean_is_weight=sums["w"], clipped_is_fraction=sums["clip"],
        )

    # -- adapter and state --------------------------------------------------------------------

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def save_adapter(self, directory: Path) -> None:
        self.model.save_pretrained(str(directory))

    def save_state(self, directory: Path) -> None:
        directory = Path(directory)
        self.save_adapter(directory / "adapter")
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")

    def load_state(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        directory = Path(directory)
        weights = directory / "adapter" / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: {weights.name} is missing under adapter/")
        result = set_peft_model_state_dict(self.model, load_file(str(weights), device=self.device))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"checkpoint {directory}: unexpected adapter keys {result.unexpected_keys[:3]}")
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.device))
