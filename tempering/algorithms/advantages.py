"""Group-relative advantages for GRPO.

Rewards arrive flat, ``[P * G]``, with the G generations of each prompt contiguous (the
layout that ``BatchedDataDict.repeat_interleave(G)`` produces). Each sample's advantage is its
reward minus a baseline computed inside its group, optionally divided by the group's std:

- ``group_advantages(leave_one_out=True)``: baseline = mean of the OTHER G - 1 rewards of the
  group (NeMo RL's ``use_leave_one_out_baseline=True``; an unbiased REINFORCE baseline).
- ``group_advantages(leave_one_out=False)``: baseline = mean of all G rewards (classic GRPO).

With ``normalize_std=True`` the advantage is divided by ``std + eps`` where std is the
**sample** standard deviation of the whole group (Bessel-corrected, ``torch.std`` default,
``unbiased=True``). A group whose rewards are all equal has std 0: its advantages are set to
exactly 0 either way (not left to float rounding), and dynamic sampling drops such groups.

``valid`` (``[P * G]`` bool, optional) drops samples from their group: a dropped sample (e.g.
NeMo Gym's ``mask_sample``) takes no part in any baseline or std and gets advantage 0; the
others are computed as if the group had only its valid members.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Advantages",
    "gae_advantages",
    "group_advantages",
    "group_std",
    "whiten",
]


class Advantages(NamedTuple):
    advantages: Tensor  # [P * G], same dtype as the rewards (float)
    baselines: Tensor  # [P * G], the baseline subtracted from each sample
    group_std: Tensor  # [P], sample std of each group's rewards


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be flat [P * G]; got shape {tuple(rewards.shape)}.")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of group_size={group_size}; "
            f"the batch must be num_prompts * num_generations_per_prompt."
        )
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r.view(-1, group_size)  # [P, G]


def group_std(rewards: Tensor, group_size: int) -> Tensor:
    """Sample (Bessel-corrected) std of each group, ``[P]``; 0 for groups of size 1."""
    grouped = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros(grouped.shape[0], dtype=grouped.dtype, device=grouped.device)
    return grouped.std(dim=1, unbiased=True)


def _valid(valid: Tensor | None, grouped: Tensor) -> Tensor:
    if valid is None:
        return torch.ones_like(grouped, dtype=torch.bool)
    if valid.numel() != grouped.numel():
        raise ValueError(f"valid has {valid.numel()} entries for {grouped.numel()} rewards")
    return valid.reshape(grouped.shape).bool()


def _finish(
    grouped: Tensor, baseline: Tensor, normalize_std: bool, eps: float, valid: Tensor
) -> Advantages:
    v = valid.to(grouped.dtype)
    n = v.sum(dim=1)  # [P] valid samples per group
    mean = (grouped * v).sum(dim=1) / n.clamp(min=1)
    var = (((grouped - mean[:, None]) * v) ** 2).sum(dim=1) / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), torch.zeros_like(var))  # [P], Bessel-corrected
    adv = grouped - baseline  # [P, G]
    if normalize_std:
        adv = adv / (std.unsqueeze(-1) + eps)
    # A constant group must give exactly 0: the leave-one-out mean of equal floats can differ
    # from them by rounding, which / (0 + eps) would blow up to a spurious advantage.
    big = torch.finfo(grouped.dtype).max
    hi = torch.where(valid, grouped, -big).amax(dim=1, keepdim=True)
    lo = torch.where(valid, grouped, big).amin(dim=1, keepdim=True)
    adv = torch.where((hi <= lo) | ~valid, torch.zeros_like(adv), adv)
    return Advantages(adv.reshape(-1), baseline.reshape(-1), std)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    leave_one_out: bool = True,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Advantages:
    """Advantage = reward - a baseline from its group (optionally / the group's std): with
    ``leave_one_out`` the mean of the OTHER G - 1 valid rewards (needs ``group_size >= 2``),
    else the mean of all G.

    rewards: ``[P * G]`` with groups contiguous.
    """
    if leave_one_out and group_size < 2:
        raise ValueError(
            f"leave-one-out baseline needs group_size >= 2 (got {group_size}); raise "
            f"grpo.num_generations_per_prompt or set grpo.use_leave_one_out_baseline=false."
        )
    grouped = _grouped(rewards, group_size)  # [P, G]
    ok = _valid(valid, grouped)
    v = ok.to(grouped.dtype)
    total, n = (grouped * v).sum(dim=1, keepdim=True), v.sum(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (total - grouped * v) / (n - v).clamp(min=1)  # [P, G]: the other valid ones
    else:
        baseline = (total / n.clamp(min=1)).expand_as(grouped)
    return _finish(grouped, baseline, normalize_std, eps, ok)


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's generalised advantage estimate over each episode's own tokens: ``(advantages,
    returns)``, ``[B, S]``, 0 where ``mask`` is 0.

    rewards: ``[B]``, each episode's reward, given at its last token where ``mask`` is 1 (every
    other token's reward 0). values: ``[B, S]``, the critic's value of the state before each
    token. mask: ``[B, S]``, the tokens the policy generated; the others (prompt, padding, a
    tool's reply between turns) are skipped, so a multi-turn episode is one trajectory of its
    generated tokens. With ``delta_t = r_t + gamma * V_next - V_t`` (``V_next`` = 0 after the
    last token): ``A_t = delta_t + gamma * lam * A_next`` and ``returns = A + V``. With
    gamma = lam = 1 (the default, as verl's), ``A_t = reward - V_t``. ``token_rewards``
    (``[B, S]``, optional): a reward on every token besides (PPO-RLHF's KL penalty)."""
    if values.shape != mask.shape or rewards.shape != values.shape[:1]:
        raise ValueError(
            f"gae_advantages: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)} must be [B], [B, S] and [B, S]"
        )
    m = mask.to(values.dtype)
    width = m.shape[1]
    last = width - 1 - torch.flip(m, dims=[1]).argmax(dim=1)  # [B] each row's last token
    token_rewards = (token_rewards.to(values.dtype) * m if token_rewards is not None
                     else torch.zeros_like(values))  # fmt: skip
    token_rewards[torch.arange(m.shape[0]), last] += rewards.to(values.dtype) * m.amax(dim=1)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in range(width - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        on = m[:, t] > 0
        advantages[:, t] = torch.where(on, adv, 0.0)
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv, next_adv)
    returns = (advantages + values) * m
    return advantages, returns


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``values`` shifted and scaled to mean 0 and std 1 over the tokens where ``mask`` is 1
    (PPO's advantage normalisation across the batch); 0 elsewhere."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / n
    return (values - mean) * torch.rsqrt(var + eps) * m
