"""The environment interface: how rollouts are scored (docs/CONTRACTS.md).

An environment receives a batch of conversations (message logs) and per-sample metadata and
returns, per sample, a reward, whether the episode ended, the next observation to append
(for multi-turn tasks), updated metadata, optional stop strings for the next turn, and the
answer it extracted (for logging). A message log is a list of
``{"role", "content", "token_ids"}`` dicts; the last assistant message is the one to score.

Environments are plain classes so they can be unit-tested directly; the controller runs
them as Ray actors (see each module's ``make_*_actor`` / `tempering.environments.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch stays out of import time: verifier worker processes import this module
    from torch import Tensor

__all__ = [
    "EnvironmentInterface",
    "ScoringErrorRateExceeded",
    "check_error_rate",
    "EnvironmentReturn",
    "Message",
    "MessageLog",
    "last_assistant_content",
    "prompt_messages",
    "prompt_text",
]

Message = dict[str, Any]  # {"role": str, "content": str, "token_ids": Tensor, ...}
MessageLog = list[Message]


class EnvironmentReturn(NamedTuple):
    """One `step`'s result; every field has one entry per sample, in input order."""

    observations: list[Message]  # message to append to each log (role "environment")
    metadata: list[dict[str, Any] | None]  # updated per-sample metadata
    next_stop_strings: list[list[str] | None]  # stop strings for the next turn, or None
    rewards: Tensor  # [B] float
    terminateds: Tensor  # [B] bool: True when the episode is over
    answers: list[str | None]  # what the environment extracted/judged, for logging


class EnvironmentInterface(ABC):
    """Scores a batch of conversations. Implementations must keep sample order.

    Multi-turn environments return ``terminateds`` False and an observation (a ``user`` or
    ``tool`` message) to continue an episode; tool-using ones list the OpenAI tool specs
    they answer in the class attribute `tools`, which rollouts offer to the model. The class
    attribute `correct_above` says which rewards are correct answers (None: none are).
    """

    tools: list[dict[str, Any]] | None = None
    # a reward above this counts as a correct answer (GRPO's ``val/accuracy``,
    # ``train/accuracy``, pass@k); None: the reward is a score, not correctness (a reward model,
    # custom reward functions), and GRPO reports the mean reward instead of an accuracy
    correct_above: float | None = 0.5

    @abstractmethod
    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Score the last assistant turn of each conversation."""

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Post-process the full step's batch and return ``(batch, metrics)``.

        Called once per step on the controller's whole batch (after all `step` calls).
        The default returns the batch unchanged and no metrics.
        """
        return batch, {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources (worker processes). Safe to call twice."""


def samples(
    env: str, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
) -> Iterator[tuple[int, MessageLog, dict[str, Any]]]:
    """``(i, message_log, metadata)`` of a `step` call's samples; a ValueError naming ``env``
    when the two lists do not match one to one."""
    if len(message_logs) != len(metadata):
        raise ValueError(
            f"{env}.step got {len(message_logs)} message logs but "
            f"{len(metadata)} metadata entries; they must match one to one."
        )
    for i, (log, meta) in enumerate(zip(message_logs, metadata, strict=True)):
        yield i, log, meta


class ScoringErrorRateExceeded(RuntimeError):
    """More of a step's answers failed to score than the environment's ``max_error_rate``
    allows: a broken scorer would otherwise give every sample 0 while the run trains on."""


def check_error_rate(
    env: str, errors: list[tuple[int, str, str]], n: int, max_error_rate: float, fix: str
) -> None:
    """Raise `ScoringErrorRateExceeded` when ``len(errors) / n > max_error_rate``.

    One model answer that makes a scorer raise is scored 0 and counted (it must not end the
    run); many mean the scorer itself is broken. ``errors`` holds ``(sample index, answer,
    error text)`` per failed sample; the message names the count, the rate, the first failure
    and ``fix``."""
    if not n or len(errors) / n <= max_error_rate:
        return
    i, answer, error = errors[0]
    raise ScoringErrorRateExceeded(
        f"{env} failed on sample {i} (and {len(errors) - 1} more of {n} in this step: "
        f"{len(errors) / n:.0%} > max_error_rate={max_error_rate}): {error}; the answer was "
        f"{answer[-200:]!r}. {fix}"
    )


def last_assistant_content(message_log: MessageLog) -> str:
    """Content of the last assistant message ("" when the log has none)."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")  # a tool-call turn has content None
    return ""


def prompt_messages(message_log: MessageLog) -> MessageLog:
    """The messages before the last assistant message (all of them when there is none)."""
    last = max(
        (i for i, m in enumerate(message_log) if m.get("role") == "assistant"),
        default=len(message_log),
    )
    return message_log[:last]


def prompt_text(message_log: MessageLog) -> str:
    """Contents of the messages before the last assistant message, joined by newlines."""
    return "\n".join(str(m.get("content") or "") for m in prompt_messages(message_log))
