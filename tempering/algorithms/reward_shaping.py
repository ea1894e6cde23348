"""The rewards GRPO's advantages read: each episode's environment reward, scaled and then
shaped (``grpo.reward_scaling``, ``grpo.reward_shaping``; NeMo RL's keys and order).

- **Scaling** clamps a reward to ``[source_min, source_max]`` and maps that range linearly
  onto ``[target_min, target_max]``; a clamped reward is counted (``train/rewards_clamped``).
- **Shaping** is DAPO's soft overlong punishment: an episode that generated L tokens, past
  ``start = max_response_length - overlong_buffer_length``, gets
  ``-(L - start) / overlong_buffer_length * overlong_buffer_penalty`` added (0 up to
  ``start``, ``-penalty`` at the limit). Or, with ``stop_properly_penalty_coef``, a truncated
  episode's reward is multiplied by the coefficient.

The environment's own rewards stay under ``rewards`` (train/reward_mean, train/accuracy and
dynamic sampling read them, as NeMo RL's read the unshaped ones); the shaped ones go under
``shaped_rewards`` with ``reward_penalty`` (what shaping added) and ``reward_clamped``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["shape_rewards", "shaping_metrics"]


def shape_rewards(
    rewards: Tensor, generated: Tensor, truncated: Tensor, scaling: Any, shaping: Any, limit: int
) -> dict[str, Tensor]:
    """``shaped_rewards``, ``reward_penalty`` and ``reward_clamped`` ([B] each) of episodes
    with environment ``rewards``, ``generated`` tokens and ``truncated`` flags; ``scaling``
    and ``shaping`` are the config sections, ``limit`` the overlong penalty's end."""
    out = rewards.float()
    clamped = torch.zeros_like(out, dtype=torch.bool)
    if scaling.enabled:
        lo, hi = scaling.source_min, scaling.source_max
        clamped = (out < lo) | (out > hi)
        out = out.clamp(lo, hi)
        out = scaling.target_min + (out - lo) / (hi - lo) * (
            scaling.target_max - scaling.target_min
        )
    scaled = out
    if shaping.enabled and shaping.stop_properly_penalty_coef is not None:
        out = torch.where(truncated.bool(), out * shaping.stop_properly_penalty_coef, out)
    elif shaping.enabled:
        buffer = shaping.overlong_buffer_length
        past = generated.float() - (limit - buffer)
        out = out + (-past / buffer * shaping.overlong_buffer_penalty).clamp(max=0.0)
    return {"shaped_rewards": out, "reward_penalty": out - scaled, "reward_clamped": clamped}


def shaping_metrics(batch: Any) -> dict[str, float]:
    """``train/*`` of a step's shaped rewards (none when neither section is enabled)."""
    if "shaped_rewards" not in batch:
        return {}
    penalty = batch["reward_penalty"]
    return {
        "train/shaped_reward_mean": float(batch["shaped_rewards"].mean()),
        "train/reward_penalized_fraction": float((penalty < 0).float().mean()),
        "train/reward_penalty_mean": float(penalty.mean()),
        "train/rewards_clamped": float(batch["reward_clamped"].sum()),
    }
