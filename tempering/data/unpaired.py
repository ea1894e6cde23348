"""Unpaired preference data for KTO: a prompt, one response and a label (desirable or not).

    {"prompt": str | messages, "completion": str | messages, "label": true | false}

(TRL's unpaired format; ``data.dataset_name=unpaired``, the prompt column named by
``data.prompt_key``). A bad row -- a missing or mistyped field, an empty completion, a label
that is not a JSON boolean -- raises `DataFormatError` naming file, line and field, or is
skipped and counted with ``data.on_bad_row=skip``. Preference pairs (every DPO dataset) are
unpaired as TRL's ``unpair_preference_dataset`` does: each pair gives its chosen response as a
desirable row and its rejected one as an undesirable row of the same prompt.

`collate_kto` batches rows for `tempering.preference_losses.KTOLoss`: row ``2i`` is example
``i``, row ``2i + 1`` its *KL row* -- example ``i``'s prompt with the response of the next
example (cyclically) whose prompt differs, the mismatched pair whose log-ratio estimates
KL(policy || reference) -- and ``desirable [2B]`` holds each example's label on both rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tempering.data.messages import as_prompt, as_response, check_tool_turns, row_tools
from tempering.data.preference_datasets import PreferencePair
from tempering.data.records import LoadedData, MessageLog, OnBadRow, load_rows, require
from tempering.distributed.batched_data_dict import BatchedDataDict

__all__ = ["UnpairedExample", "collate_kto", "load_unpaired_jsonl", "unpair"]


@dataclass(frozen=True)
class UnpairedExample:
    prompt: MessageLog
    completion: MessageLog
    desirable: bool
    tools: list[dict[str, Any]] | None = None


def unpair(pairs: Sequence[PreferencePair]) -> list[UnpairedExample]:
    """Each pair as two rows: its chosen response desirable, its rejected one not."""
    return [
        UnpairedExample(pair.prompt, response, desirable, pair.tools)
        for pair in pairs
        for response, desirable in ((pair.chosen, True), (pair.rejected, False))
    ]


def load_unpaired_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    label_key: str = "label",
    on_bad_row: OnBadRow = "error",
) -> LoadedData:
    """``{prompt, completion, label}`` rows; prompt and completion a string or messages."""
    keys = [prompt_key, completion_key, label_key]

    def convert(row: dict[str, Any]) -> UnpairedExample:
        prompt = as_prompt(require(row, prompt_key, keys, (str, list)), prompt_key)
        completion = as_response(require(row, completion_key, keys, (str, list)), completion_key)
        label = require(row, label_key, keys, bool)  # 1/0 or "yes" would be a guess: refused
        check_tool_turns(prompt + completion, "prompt + completion")
        return UnpairedExample(prompt, completion, label, row_tools(row) or None)

    return load_rows(path, on_bad_row, convert)


def kl_partners(examples: Sequence[UnpairedExample]) -> list[int]:
    """For each example, the next one (cyclically) with another prompt; itself when every
    prompt in the batch is the same (then the KL rows are the examples themselves)."""
    n = len(examples)
    partners = []
    for i, example in enumerate(examples):
        j = next(
            ((i + k) % n for k in range(1, n) if examples[(i + k) % n].prompt != example.prompt),
            i,
        )
        partners.append(j)
    return partners


def collate_kto(
    examples: Sequence[UnpairedExample], tokenizer: Any, max_seq_len: int
) -> BatchedDataDict:
    """``2 * len(examples)`` rows: each example, then its KL row (module docstring)."""
    from tempering.data.collate import collate_preference

    if not examples:
        raise ValueError("collate_kto got an empty list of examples")
    rows = [
        PreferencePair(e.prompt, e.completion, examples[j].completion, e.tools)
        for e, j in zip(examples, kl_partners(examples), strict=True)
    ]
    batch = collate_preference(rows, tokenizer, max_seq_len)
    labels = torch.tensor([float(e.desirable) for e in examples], dtype=torch.float32)
    batch["desirable"] = labels.repeat_interleave(2)
    return batch
