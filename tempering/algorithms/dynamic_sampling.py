"""DAPO dynamic sampling and overlong filtering for GRPO.

Dynamic sampling (DAPO, Yu et al. 2025): a group whose G rewards are all equal has zero
advantage for every sample, so it contributes no gradient. `DynamicSampler` drops such
groups and keeps collecting generation rounds until ``num_prompts_per_step`` groups are kept
or ``max_rounds`` rounds have been generated. Extra kept groups beyond the target are
discarded (counted); a shortfall after the last round is returned, counted and logged, never
silently hidden. With ``result(pad_to_target=True)`` the shortfall is filled with dropped
(zero-variance) groups whose ``sample_mask`` is 0, so the batch keeps its fixed size
(``num_prompts_per_step * G``, which data-parallel sharding may require) while contributing
nothing to the loss; ``group_is_real`` says which groups are which.

Typical use inside the GRPO loop::

    sampler = DynamicSampler(num_prompts_per_step=P, group_size=G, max_rounds=4)
    while sampler.needs_more():
        sampler.add(generate_and_score(next(dataloader)))   # [P' * G] samples, groups contiguous
    result = sampler.result()        # .batch, .shortfall, .metrics

or in one call, `dynamic_sample(next_round, ...)`. Batches are ``BatchedDataDict``-like
mappings of equal-length tensors (batch dim 0) and lists; the result has the type of the
first batch added.

`mask_overlong_samples` implements DAPO's overlong filtering: samples whose generation stopped
because it hit the length limit (``finish_reason == "length"``) get ``sample_mask = 0``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DynamicSampler",
    "DynamicSamplingResult",
    "concat_batches",
    "dynamic_sample",
    "mask_overlong_samples",
    "nonconstant_group_mask",
    "select_samples",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Small batch helpers over BatchedDataDict-like mappings
# --------------------------------------------------------------------------------------------


def _batch_size(batch: Mapping[str, Any]) -> int:
    sizes = {k: (v.shape[0] if isinstance(v, Tensor) else len(v)) for k, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Batch entries have different batch sizes: {sizes}.")
    return next(iter(sizes.values()), 0)


def _rebuild(template: Mapping[str, Any], data: dict[str, Any]) -> Any:
    """Return `data` as the same mapping type as `template` (e.g. BatchedDataDict)."""
    cls = type(template)
    return data if cls is dict else cls(data)


def select_samples(batch: Mapping[str, Any], indices: Sequence[int]) -> Any:
    """Rows `indices` of every entry (tensors indexed on dim 0, lists by position)."""
    idx = list(indices)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor):
            out[key] = value[torch.as_tensor(idx, dtype=torch.long, device=value.device)]
        elif isinstance(value, Sequence) and not isinstance(value, str):
            out[key] = [value[i] for i in idx]
        else:
            raise TypeError(
                f"Batch entry '{key}' is a {type(value).__name__}; batches hold only tensors "
                f"(batch dim 0) and lists."
            )
    return _rebuild(batch, out)


def concat_batches(batches: Sequence[Mapping[str, Any]]) -> Any:
    """Concatenate along dim 0; tensors with different dim-1 lengths are right-padded with 0."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch.")
    keys = list(batches[0].keys())
    for b in batches[1:]:
        if set(b.keys()) != set(keys):
            raise ValueError(
                f"Cannot concatenate batches with different keys: {sorted(keys)} vs {sorted(b)}."
            )
    out: dict[str, Any] = {}
    for key in keys:
        values = [b[key] for b in batches]
        if isinstance(values[0], Tensor):
            if values[0].dim() >= 2:
                width = max(v.shape[1] for v in values)
                values = [
                    F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1])) for v in values
                ]
            out[key] = torch.cat(values, dim=0)
        else:
            out[key] = [item for v in values for item in v]
    return _rebuild(batches[0], out)


# --------------------------------------------------------------------------------------------
# Dynamic sampling
# --------------------------------------------------------------------------------------------


def nonconstant_group_mask(rewards: Tensor, group_size: int) -> Tensor:
    """``[P]`` bool: True where a group's rewards are not all equal (exact comparison)."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
            f"{group_size}; expected flat [P * G] with groups contiguous."
        )
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


@dataclass
class DynamicSamplingResult:
    """What dynamic sampling kept. ``batch`` holds ``num_groups_kept * group_size`` samples."""

    batch: Any
    num_groups_kept: int
    shortfall: int  # groups missing to reach num_prompts_per_step (0 when full)
    metrics: dict[str, float] = field(default_factory=dict)
    # [groups in batch] bool: False for padding groups (pad_to_target), which have sample_mask 0
    group_is_real: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))


class DynamicSampler:
    """Collects groups with non-zero reward variance across generation rounds (DAPO).

    Each added batch holds whole groups: ``[P' * group_size]`` samples with each prompt's
    generations contiguous, and a reward entry ``reward_key`` of shape ``[P' * group_size]``.
    """

    def __init__(
        self,
        num_prompts_per_step: int,
        group_size: int,
        max_rounds: int,
        reward_key: str = "rewards",
    ) -> None:
        if num_prompts_per_step < 1 or group_size < 1 or max_rounds < 1:
            raise ValueError(
                f"num_prompts_per_step={num_prompts_per_step}, group_size={group_size} and "
                f"max_rounds={max_rounds} must all be >= 1."
            )
        self.num_prompts_per_step = num_prompts_per_step
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.reward_key = reward_key
        self._kept: list[Any] = []
        self._num_kept = 0
        self._dropped: list[Any] = []  # zero-variance groups, kept only for padding
        self._num_dropped_stored = 0
        self._rounds = 0
        self._groups_seen = 0
        self._groups_filtered = 0

    @property
    def rounds(self) -> int:
        return self._rounds

    @property
    def num_groups_kept(self) -> int:
        return self._num_kept

    def is_full(self) -> bool:
        return self._num_kept >= self.num_prompts_per_step

    def needs_more(self) -> bool:
        """True while the target is not met and another round is allowed."""
        return not self.is_full() and self._rounds < self.max_rounds

    def add(self, batch: Mapping[str, Any]) -> int:
        """Filter one round's batch and keep its non-constant groups; returns how many kept."""
        if self._rounds >= self.max_rounds:
            raise RuntimeError(
                f"DynamicSampler already ran max_rounds={self.max_rounds} rounds; call result()."
            )
        if self.reward_key not in batch:
            raise KeyError(
                f"Dynamic sampling needs rewards under '{self.reward_key}'; batch keys: "
                f"{sorted(batch)}."
            )
        rewards = torch.as_tensor(batch[self.reward_key]).reshape(-1)
        if _batch_size(batch) != rewards.numel():
            raise ValueError(
                f"'{self.reward_key}' has {rewards.numel()} entries but the batch has "
                f"{_batch_size(batch)} samples."
            )
        keep = nonconstant_group_mask(rewards, self.group_size)  # [P']
        self._rounds += 1
        self._groups_seen += int(keep.numel())
        self._groups_filtered += int((~keep).sum().item())
        g = self.group_size
        groups = keep.nonzero().flatten().tolist()
        if groups:
            self._kept.append(select_samples(batch, [i * g + j for i in groups for j in range(g)]))
            self._num_kept += len(groups)
        room = self.num_prompts_per_step - self._num_dropped_stored
        dropped = (~keep).nonzero().flatten().tolist()[: max(room, 0)]
        if dropped:
            self._dropped.append(
                select_samples(batch, [i * g + j for i in dropped for j in range(g)])
            )
            self._num_dropped_stored += len(dropped)
        return len(groups)

    def result(self, pad_to_target: bool = False) -> DynamicSamplingResult:
        """The kept groups, truncated to num_prompts_per_step; shortfall counted and logged.

        With `pad_to_target`, a shortfall is filled with dropped groups masked out
        (``sample_mask = 0``); ``batch`` is None only when nothing at all was generated/kept.
        """
        target = self.num_prompts_per_step
        kept = min(self._num_kept, target)
        shortfall = target - kept
        discarded = self._num_kept - kept
        parts = []
        if self._kept:
            batch = concat_batches(self._kept)
            parts.append(select_samples(batch, range(kept * self.group_size)))
        padded = 0
        if pad_to_target and shortfall and self._dropped:
            pad = concat_batches(self._dropped)
            padded = min(shortfall, self._num_dropped_stored)
            pad = select_samples(pad, range(padded * self.group_size))
            mask = pad.get("sample_mask")
            zeros = (
                torch.zeros(padded * self.group_size) if mask is None else torch.zeros_like(mask)
            )
            pad = _rebuild(pad, {**pad, "sample_mask": zeros})
            parts.append(pad)
            if parts[0] is not pad and "sample_mask" not in parts[0]:  # real groups count fully
                real = parts[0]
                parts[0] = _rebuild(real, {**real, "sample_mask": torch.ones(_batch_size(real))})
        batch = concat_batches(parts) if parts else None
        group_is_real = torch.tensor([True] * kept + [False] * padded)
        if shortfall:
            logger.warning(
                "Dynamic sampling kept %d of %d groups after %d rounds (max_rounds=%d): %d groups "
                "short. Allow more rounds (grpo.dynamic_sampling_max_gen_batches) or fewer prompts.",
                kept,
                target,
                self._rounds,
                self.max_rounds,
                shortfall,
            )
        metrics = {
            "dynamic_sampling/rounds": float(self._rounds),
            "dynamic_sampling/groups_seen": float(self._groups_seen),
            "dynamic_sampling/groups_filtered": float(self._groups_filtered),
            "dynamic_sampling/groups_kept": float(kept),
            "dynamic_sampling/groups_discarded_extra": float(discarded),
            "dynamic_sampling/shortfall": float(shortfall),
            "dynamic_sampling/padded_groups": float(padded),
        }
        return DynamicSamplingResult(batch, kept, shortfall, metrics, group_is_real)


def dynamic_sample(
    next_round: Callable[[int], Mapping[str, Any]],
    num_prompts_per_step: int,
    group_size: int,
    max_rounds: int,
    reward_key: str = "rewards",
    pad_to_target: bool = False,
) -> DynamicSamplingResult:
    """Call ``next_round(round_index)`` until enough non-constant groups are kept or the round
    budget is spent; each call returns one generated-and-scored batch of whole groups."""
    sampler = DynamicSampler(num_prompts_per_step, group_size, max_rounds, reward_key)
    while sampler.needs_more():
        sampler.add(next_round(sampler.rounds))
    return sampler.result(pad_to_target=pad_to_target)


# --------------------------------------------------------------------------------------------
# Overlong filtering
# --------------------------------------------------------------------------------------------


def mask_overlong_samples(
    batch: Mapping[str, Any], finish_reasons_key: str = "finish_reasons"
) -> tuple[Any, int]:
    """Set ``sample_mask = 0`` for samples whose finish reason is ``"length"``.

    Returns a shallow copy of the batch (same type) with a new ``sample_mask`` (created as ones
    if absent) and the number of samples newly masked out.
    """
    if finish_reasons_key not in batch:
        raise KeyError(
            f"Overlong filtering needs '{finish_reasons_key}' (from generation); batch keys: "
            f"{sorted(batch)}."
        )
    reasons = list(batch[finish_reasons_key])
    overlong = torch.tensor([r == "length" for r in reasons], dtype=torch.bool)
    old = batch.get("sample_mask")
    if old is None:
        old = torch.ones(len(reasons))
    new_mask = old.clone()
    new_mask[overlong.to(new_mask.device)] = 0
    newly_masked = int(((old != 0) & overlong.to(old.device)).sum().item())
    out = dict(batch)
    out["sample_mask"] = new_mask
    return _rebuild(batch, out), newly_masked
