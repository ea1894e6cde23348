"""Batch tokenized examples into ``BatchedDataDict`` s (layout: docs/CONTRACTS.md).

- :func:`collate_sft`: tokenized SFT examples -> ``input_ids [B, S]`` right-padded with
  ``pad_token_id``, ``input_lengths [B]``, ``token_mask [B, S]`` (1.0 on assistant tokens,
  0.0 on prompt and padding) and ``sample_mask [B]`` (1.0, or 0.0 for an example left with
  no loss token, e.g. truncated inside its prompt).
- :func:`collate_preference`: preference pairs -> the same keys for ``2 * B`` rows with
  chosen and rejected **interleaved** (row ``2i`` = chosen of pair ``i``, ``2i + 1`` = its
  rejected), which is what the DPO and Bradley-Terry losses expect; ``token_mask`` is 1.0
  on the response tokens only, and ``sample_mask`` is 0.0 on both rows of a pair when either
  row lost all its response tokens to truncation.

Masks are float32 so a loss can multiply them with log-probs directly. ``S`` is the longest
sequence in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tempering.data.preference_datasets import PreferencePair
from tempering.data.processing import TextMemo, TokenizedExample, tokenize_message_log
from tempering.distributed.batched_data_dict import BatchedDataDict


def collate_sft(examples: Sequence[TokenizedExample], pad_token_id: int) -> BatchedDataDict:
    """Right-pad tokenized examples into one batch."""
    if not examples:
        raise ValueError("collate_sft got an empty list of examples")
    lengths = [len(e["input_ids"]) for e in examples]
    seq_len = max(max(lengths), 1)
    # numpy fills rows from lists ~10x faster than a torch.tensor per row
    input_ids = np.full((len(examples), seq_len), pad_token_id, dtype=np.int64)
    token_mask = np.zeros((len(examples), seq_len), dtype=np.float32)
    for b, example in enumerate(examples):
        n = lengths[b]
        input_ids[b, :n] = example["input_ids"]
        token_mask[b, :n] = example["token_mask"]
    mask = torch.from_numpy(token_mask)
    return BatchedDataDict(
        input_ids=torch.from_numpy(input_ids),
        input_lengths=torch.tensor(lengths, dtype=torch.long),
        token_mask=mask,
        sample_mask=(mask.sum(dim=1) > 0).to(torch.float32),
    )


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id (padding is masked out either way)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has neither pad_token nor eos_token; "
            "set tokenizer.pad_token before collating"
        )
    return int(pad)


def collate_preference(
    pairs: Sequence[PreferencePair], tokenizer: Any, max_seq_len: int
) -> BatchedDataDict:
    """Tokenize and batch preference pairs, chosen/rejected interleaved."""
    if not pairs:
        raise ValueError("collate_preference got an empty list of pairs")
    examples: list[TokenizedExample] = []
    memo = TextMemo(tokenizer)  # a pair's two rows render and encode its prompt once
    for pair in pairs:
        start = len(pair.prompt)
        for response in (pair.chosen, pair.rejected):
            examples.append(
                tokenize_message_log(
                    pair.prompt + response,
                    tokenizer,
                    max_seq_len,
                    loss_from_message=start,
                    memo=memo,
                    tools=pair.tools,
                )
            )
    batch = collate_sft(examples, pad_token_id_of(tokenizer))
    # A pair counts only if both of its rows kept a response token.
    pair_mask = batch["sample_mask"].view(-1, 2).amin(dim=1)
    batch["sample_mask"] = pair_mask.repeat_interleave(2)
    return batch
