"""A custom reward function for GRPO, plugged in by import path.

Any function ``fn(prompt: str, completion: str, metadata: dict) -> float`` can be a reward.
Give its path to the ``reward_fn`` environment (task name ``"reward_fn"`` in
`tempering.environments.registry`), running from the repository root:

    from tempering.environments.reward_fn import RewardFunctionEnvironment
    env = RewardFunctionEnvironment("examples.custom_reward:length_penalty")

A file path works too: ``"examples/custom_reward.py:length_penalty"``. ``metadata`` is the
dataset row's metadata dict, so a reward can read e.g. ``metadata["ground_truth"]``.
"""

from __future__ import annotations

from typing import Any


def length_penalty(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 for an answer within ``metadata["target_words"]`` words (default 50), decreasing
    linearly to 0.0 at twice that length; an empty completion scores 0.0."""
    words = len(completion.split())
    if words == 0:
        return 0.0
    target = int(metadata.get("target_words", 50))
    if words <= target:
        return 1.0
    return max(0.0, 1.0 - (words - target) / target)


def closeness(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """A graded score for integer answers (the blend example's custom reward,
    examples/configs/grpo_blend_tiny.yaml): ``1 / (1 + |answer - ground truth|)`` for the
    integer the completion starts with, 0.0 when it starts with none. A near miss earns
    something, so a group's rewards differ even before any answer is exact."""
    import re

    match = re.match(r"\s*([+-]?\d{1,12})", completion)
    if not match:
        return 0.0
    return 1.0 / (1.0 + abs(int(match.group(1)) - int(metadata["ground_truth"])))
