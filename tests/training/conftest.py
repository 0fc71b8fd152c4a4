"""Shared fixtures: a real, randomly initialized tiny Qwen2 model saved as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def save_tiny_qwen(path: Path, vocab_size: int = 64, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"))
