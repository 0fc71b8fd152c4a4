"""Tiny random Qwen-style models, tokenizers and LoRA adapters built locally, for tests and CPU runs.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small built-in corpus, the
model is a randomly initialised transformers Qwen2 (or Qwen3) causal LM of a few hundred thousand to
a few million parameters, saved with ``save_pretrained`` so every loader (the local engine, peft,
the trainer) treats it like a real checkpoint.

    from serving.tiny import build_tiny_model, build_tiny_lora_adapter
    model_dir = build_tiny_model(tmp_path / "model")                 # config + weights + tokenizer
    adapter_dir = build_tiny_lora_adapter(model_dir, tmp_path / "v1")  # peft adapter, safetensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """
def add(a, b):
    return a + b

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()

import os
import sys
for i in range(10):
    print(i, os.path.join("src", str(i)))

$ git diff --stat
$ pytest -x tests/test_parser.py
FAILED tests/test_parser.py::test_empty - AssertionError: assert None == []
The test fails because parse returns None for an empty string. Fix: return an empty list.
<|im_start|>user
Fix the failing test in the repository.<|im_end|>
<|im_start|>assistant
I will read the file first.<|im_end|>
"""


def build_tiny_tokenizer(vocab_size: int = 512, corpus: Sequence[str] | None = None):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``vocab_size`` entries (any text encodes)."""
    # heavy: tokenizers and transformers; only building a tiny model needs them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(corpus) if corpus is not None else [_CORPUS] * 4
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def build_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,  # head_dim 32: vLLM's CPU attention refuses 16
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    arch: str = "qwen2",
    seed: int = 0,
) -> Path:
    """Save a random Qwen2/Qwen3 causal LM and its tokenizer under ``path``; return ``path``."""
    # heavy: torch and transformers; only building a tiny model needs them
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    path = Path(path)
    tokenizer = build_tiny_tokenizer(vocab_size)
    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(arch)
    if config_cls is None:
        raise ValueError(f"arch must be 'qwen2' or 'qwen3', got {arch!r}")
    config = config_cls(
        vocab_size=max(vocab_size, len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # A random init gives near-uniform next-token distributions; a larger output scale makes
    # sampled text (and logprobs) less flat, which tests of sampling and caching can see.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_lora_adapter(
    model_path: str | Path,
    out_path: str | Path,
    *,
    rank: int = 4,
    alpha: int = 8,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 1,
    init_scale: float = 0.5,
) -> Path:
    """Save a peft LoRA adapter for the model at ``model_path`` whose weights are random (so it
    changes the model's outputs, unlike peft's zero-initialised B); return ``out_path``."""
    # heavy: torch, peft and transformers; only building an adapter needs them
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_scale)
    out_path = Path(out_path)
    model.save_pretrained(out_path, safe_serialization=True)
    return out_path
