"""A finished episode as token ids, and the training batch built from episodes.

Every rollout source hands `EpisodeRecord`s to `build_batch`: the rollout loop
(`tempering.experience.rollouts`) and the NeMo Gym client (`tempering.environments.nemo_gym`).
It lives in data/ so that both import it from below, and neither imports the other.

`build_batch` gives one row per episode:
  input_ids [B, S] right-padded (the whole conversation), input_lengths [B],
  token_mask [B, S] (1 on every generated token of every turn, 0 elsewhere), sample_mask [B],
  generation_logprobs [B, S] (the sampler's log-probs on generated tokens, 0 elsewhere),
  rewards [B] (summed over turns), turns [B], truncated [B], generation_lengths [B],
  finish_reasons, message_logs; with in-flight weight updates, when every episode's turns
  carry them, generation_weight_versions [B, S] (the weight version of each generated token,
  -1 elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict, rows_tensor

__all__ = ["EpisodeRecord", "build_batch"]


@dataclass
class EpisodeRecord:
    """One finished episode as token ids: what every rollout source (the loop here, NeMo Gym)
    hands to `build_batch`."""

    ids: list[int]  # the whole conversation (the last model call's prompt + generation)
    spans: list[tuple[int, list[int], list[float]]]  # (start, generated ids, sampler log-probs)
    reward: float
    turns: int
    truncated: bool
    finish_reason: str
    messages: list[dict[str, Any]]
    masked: bool = False  # sample_mask 0: the episode counts for nothing
    versions: list[list[int]] | None = None  # per span, each token's weight version


def build_batch(episodes: Sequence[EpisodeRecord], pad_token_id: int = 0) -> BatchedDataDict:
    """Episodes -> the training BatchedDataDict described in the module docstring."""
    # Python lists first, one tensor per key: a torch.tensor call per row cost more than the
    # whole step's other bookkeeping.
    S = max(max(len(e.ids) for e in episodes), 1)
    ids_rows, mask_rows, lp_rows = [], [], []
    for ep in episodes:
        ids_rows.append(ep.ids + [pad_token_id] * (S - len(ep.ids)))
        mask, lps = [0.0] * S, [0.0] * S
        for start, gen, gen_lps in ep.spans:
            mask[start : start + len(gen)] = [1.0] * len(gen)
            lps[start : start + len(gen)] = gen_lps
        mask_rows.append(mask)
        lp_rows.append(lps)
    input_ids = rows_tensor(ids_rows, torch.long)
    token_mask = rows_tensor(mask_rows, torch.float32)
    logprobs = rows_tensor(lp_rows, torch.float32)
    batch = BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.tensor([max(len(e.ids), 1) for e in episodes], dtype=torch.long),
        token_mask=token_mask,
        sample_mask=torch.tensor([0.0 if e.masked else 1.0 for e in episodes]),
        generation_logprobs=logprobs,
        rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        turns=torch.tensor([e.turns for e in episodes], dtype=torch.long),
        truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
        generation_lengths=token_mask.sum(1).long(),
        finish_reasons=[e.finish_reason for e in episodes],
        message_logs=[e.messages for e in episodes],
    )
    if all(e.versions is not None for e in episodes):
        batch["generation_weight_versions"] = _version_rows(episodes, S)
    return batch


def _version_rows(episodes: Sequence[EpisodeRecord], S: int) -> torch.Tensor:
    rows = []
    for ep in episodes:
        row = [-1] * S
        for (start, gen, _), versions in zip(ep.spans, ep.versions or [], strict=True):
            row[start : start + len(gen)] = versions
        rows.append(row)
    return rows_tensor(rows, torch.long)
