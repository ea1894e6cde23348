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


def save_tokenized_llama(folder: str | Path, seed: int = 0, **config: Any) -> int:
    """A random Llama that vLLM's CPU backend can run (hidden 128 = 2 heads of dim 64: its
    attention has no head size 16) with a small byte-level BPE tokenizer, both saved as an HF
    folder (fp32) at ``folder``; ``config`` overrides `LlamaConfig` fields. Returns the
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 12+34=46"] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    sizes = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    save_tiny_llama(folder, seed, **{**sizes, **config})
    return len(tokenizer)
