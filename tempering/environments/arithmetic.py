"""Exact-answer environment for tiny-arith: reward 1 when the first integer matches.

The completion (last assistant message) must start, after optional whitespace, with an
integer (optional sign) equal to ``metadata[i]["ground_truth"]``; anything after it is
ignored. ``" 42 because..."`` scores 1 for ground truth 42; ``"the answer is 42"`` scores 0.
Plain, fast and deterministic: used for the CPU GRPO recipe and tests.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    last_assistant_content,
)

__all__ = ["ArithmeticEnvironment", "first_integer"]

_LEADING_INT = re.compile(r"\s*([+-]?\d+)")


def first_integer(text: str) -> int | None:
    """The integer at the start of `text` after optional whitespace, or None."""
    match = _LEADING_INT.match(text)
    return int(match.group(1)) if match else None


class ArithmeticEnvironment(EnvironmentInterface):
    """Reward 1.0 when the completion's leading integer equals the ground truth, else 0.0."""

    def __init__(self) -> None:
        self._counts = {"samples": 0, "no_integer": 0}

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(
                f"ArithmeticEnvironment.step got {len(message_logs)} message logs but "
                f"{len(metadata)} metadata entries; they must match one to one."
            )
        rewards, answers = [], []
        for i, (log, meta) in enumerate(zip(message_logs, metadata, strict=True)):
            if not meta or "ground_truth" not in meta:
                raise KeyError(f"Sample {i} has no metadata['ground_truth'] (metadata={meta!r}).")
            value = first_integer(last_assistant_content(log))
            self._counts["samples"] += 1
            if value is None:
                self._counts["no_integer"] += 1
            rewards.append(1.0 if value is not None and value == int(meta["ground_truth"]) else 0.0)
            answers.append(None if value is None else str(value))
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": "correct" if r else "incorrect"} for r in rewards
            ],
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(rewards), dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Report (and reset) ``env/arithmetic_no_integer``; accuracy when ``rewards`` given."""
        metrics = {
            "env/arithmetic_samples": float(self._counts["samples"]),
            "env/arithmetic_no_integer": float(self._counts["no_integer"]),
        }
        if "rewards" in batch:
            metrics["env/arithmetic_accuracy"] = float(
                torch.as_tensor(batch["rewards"]).float().mean()
            )
        self._counts = dict.fromkeys(self._counts, 0)
        return batch, metrics
