"""The seeded tiny Llama that most unit tests build: 2 layers, hidden 64, 4 query heads over 2
key/value heads, a vocabulary of 100. One definition, so a test's model is every other test's
unless its call says how it differs (tied embeddings, a shorter context, an attention)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def tiny_llama(seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """The tiny Llama with weights drawn after ``torch.manual_seed(seed)``; ``config`` overrides
    or adds `LlamaConfig` fields."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config}))


def save_tiny_llama(path: str | Path, seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """`tiny_llama` saved as an HF folder at ``path``; the model is returned too."""
    model = tiny_llama(seed, **config)
    model.save_pretrained(path)
    return model
