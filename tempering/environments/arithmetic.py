"""Exact-answer environment for tiny-arith: reward 1 when the first integer matches.

The completion (last assistant message) must start, after optional whitespace, with an
integer (optional sign) equal to ``metadata[i]["ground_truth"]``; anything after it is
ignored. ``" 42 because..."`` scores 1 for ground truth 42; ``"the answer is 42"`` scores 0.
A leading integer longer than `MAX_DIGITS` digits scores 0 and is counted
(``env/arithmetic_too_long``): Python refuses to convert one of over 4300 digits, and a model
that writes a megabyte of nines must not end the run.
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
    samples,
)

__all__ = [
    "MAX_DIGITS",
    "ArithmeticEnvironment",
    "ArithmeticRetryEnvironment",
    "first_integer",
    "leading_integer",
]

_LEADING_INT = re.compile(r"\s*([+-]?)0*(\d+)")
MAX_DIGITS = 1000  # longer leading integers are not converted (Python's own limit is 4300)


def leading_integer(text: str) -> tuple[int | None, str]:
    """``(value, why)``: the integer at the start of `text` after optional whitespace and
    ``"ok"``, or None and ``"no_integer"`` / ``"too_long"`` (over `MAX_DIGITS` digits)."""
    match = _LEADING_INT.match(text)
    if not match:
        return None, "no_integer"
    if len(match.group(2)) > MAX_DIGITS:
        return None, "too_long"
    return int(match.group(1) + match.group(2)), "ok"


def first_integer(text: str) -> int | None:
    """The integer at the start of `text` after optional whitespace, or None (also when it
    has more than `MAX_DIGITS` digits)."""
    return leading_integer(text)[0]


def _ground_truth(i: int, meta: dict[str, Any]) -> int:
    """The sample's integer ground truth (the dataset's, so a bad one is an error naming it)."""
    try:
        return int(meta["ground_truth"])
    except (TypeError, ValueError):
        raise ValueError(
            f"Sample {i}: metadata['ground_truth']={str(meta['ground_truth'])[:80]!r} is not an "
            "integer; the arithmetic environments score integer answers (use task 'math' for "
            "other answers)"
        ) from None


class ArithmeticEnvironment(EnvironmentInterface):
    """Reward 1.0 when the completion's leading integer equals the ground truth, else 0.0."""

    def __init__(self) -> None:
        self._counts = {"samples": 0, "no_integer": 0, "too_long": 0}

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        rewards, answers = [], []
        for i, log, meta in samples("ArithmeticEnvironment", message_logs, metadata):
            if not meta or "ground_truth" not in meta:
                raise KeyError(f"Sample {i} has no metadata['ground_truth'] (metadata={meta!r}).")
            value, why = leading_integer(last_assistant_content(log))
            self._counts["samples"] += 1
            if value is None:
                self._counts[why] += 1
            rewards.append(1.0 if value is not None and value == _ground_truth(i, meta) else 0.0)
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
        """Report (and reset) ``env/arithmetic_samples``, ``env/arithmetic_no_integer`` and
        ``env/arithmetic_too_long``; ``env/arithmetic_accuracy`` when ``rewards`` given."""
        metrics = {f"env/arithmetic_{k}": float(v) for k, v in self._counts.items()}
        if "rewards" in batch:
            metrics["env/arithmetic_accuracy"] = float(
                torch.as_tensor(batch["rewards"]).float().mean()
            )
        self._counts = dict.fromkeys(self._counts, 0)
        return batch, metrics


class ArithmeticRetryEnvironment(EnvironmentInterface):
    """tiny-arith with feedback, a multi-turn task: a wrong answer gets the question again.

    Attempt n (1-based) that answers correctly earns ``discount ** (n - 1)`` and ends the
    episode; a wrong one earns 0 and, while attempts remain, the observation repeats the
    question (``metadata["prompt"]``) as the next user turn — being asked again is the
    feedback. After ``max_attempts`` wrong answers the episode ends with reward 0.
    ``metadata["attempt"]`` counts the attempts made.
    """

    def __init__(self, max_attempts: int = 3, discount: float = 0.5) -> None:
        if max_attempts < 1 or not 0 < discount <= 1:
            raise ValueError(
                f"ArithmeticRetryEnvironment(max_attempts={max_attempts}, discount={discount}): "
                "max_attempts must be >= 1 and discount in (0, 1]"
            )
        self.max_attempts, self.discount = max_attempts, discount
        self._solved_at = [0] * (max_attempts + 1)  # index 0: episodes that failed

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        observations: list[dict[str, Any]] = []
        metas: list[dict[str, Any] | None] = []
        rewards, done, answers = [], [], []
        for i, log, meta in samples("ArithmeticRetryEnvironment", message_logs, metadata):
            if not meta or "ground_truth" not in meta or "prompt" not in meta:
                raise KeyError(
                    f"Sample {i} needs metadata['ground_truth'] and metadata['prompt'] "
                    f"(metadata={meta!r})."
                )
            attempt = int(meta.get("attempt", 0)) + 1
            value = first_integer(last_assistant_content(log))
            correct = value is not None and value == _ground_truth(i, meta)
            ended = correct or attempt >= self.max_attempts
            if ended:
                self._solved_at[attempt if correct else 0] += 1
            rewards.append(self.discount ** (attempt - 1) if correct else 0.0)
            done.append(ended)
            answers.append(None if value is None else str(value))
            observations.append({"role": "user", "content": meta["prompt"]})
            metas.append({**meta, "attempt": attempt})
        return EnvironmentReturn(
            observations=observations,
            metadata=metas,
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(done, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """``env/retry_solved_at_<n>`` and ``env/retry_failed`` episode counts (then reset)."""
        metrics = {f"env/retry_solved_at_{n}": float(c) for n, c in enumerate(self._solved_at)}
        metrics["env/retry_failed"] = metrics.pop("env/retry_solved_at_0")
        self._solved_at = [0] * (self.max_attempts + 1)
        return batch, metrics
