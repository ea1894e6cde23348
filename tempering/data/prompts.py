"""Prompts -> right-padded token ids for generation (GRPO rollouts, greedy evaluation).

With ``use_chat_template`` the prompt becomes one user turn rendered by the tokenizer's chat
template with the generation prompt appended; otherwise it is encoded as plain text (with the
tokenizer's BOS if it adds one), which is how tiny-arith's "Q: 23+45=? A:" prompts work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tempering.data.collate import pad_token_id_of
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.hf import text_encoder


def prompt_token_ids(
    prompt: str, tokenizer: Any, use_chat_template: bool, system: str | None = None
) -> list[int]:
    if use_chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        text = tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return text_encoder(tokenizer)(text)
    if system:
        raise ValueError("a system prompt needs the chat template (data.use_chat_template=true)")
    return text_encoder(tokenizer, special_tokens=True)(prompt)


def encode_prompts(
    prompts: Sequence[str], tokenizer: Any, use_chat_template: bool
) -> BatchedDataDict:
    """``{input_ids [B, S] right-padded, input_lengths [B]}`` for the generation contract."""
    ids = [prompt_token_ids(p, tokenizer, use_chat_template) for p in prompts]
    if not ids:
        raise ValueError("encode_prompts got no prompts")
    lengths = [len(x) for x in ids]
    out = np.full((len(ids), max(lengths)), pad_token_id_of(tokenizer), dtype=np.int64)
    for i, x in enumerate(ids):
        out[i, : len(x)] = x
    return BatchedDataDict(
        input_ids=torch.from_numpy(out), input_lengths=torch.tensor(lengths, dtype=torch.long)
    )
