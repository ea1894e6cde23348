"""Telling the user when a GRPO run has no learning signal.

GRPO learns only from groups whose rewards differ: when every answer to a prompt scores the
same, its advantages are 0 and so are the loss and the gradient. A run whose prompts the model
cannot answer in the expected format (a user's problems file without ``data.prompt_file``, a
scorer that parses nothing) trains for hours on zeros while every number it logs looks normal.

`SignalWatch` is fed one `StepSignal` per step. When, for `NO_SIGNAL_STEPS` steps in a row,
at least `NO_SIGNAL_FRACTION` of the step's groups had zero reward variance or at least that
fraction of its answers failed to parse, it returns a warning -- once per run -- with the
counts, one sample (prompt -> completion -> expected answer) and what to check. GRPO logs it
and repeats it in the run's summary (`warning`). A healthy step resets the count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NO_SIGNAL_FRACTION",
    "NO_SIGNAL_STEPS",
    "PARSE_FAILURE_COUNTERS",
    "SignalWatch",
    "StepSignal",
    "parse_failures",
    "step_signal",
]

NO_SIGNAL_FRACTION = 0.8  # "most": this share of groups (or answers) or more
NO_SIGNAL_STEPS = 5  # consecutive steps before the warning
# environment metric with the answers that failed to parse -> the metric with all answers
PARSE_FAILURE_COUNTERS = {
    "env/math_parse_failures": "env/math_samples",
    "env/arithmetic_no_integer": "env/arithmetic_samples",
}


@dataclass(frozen=True)
class StepSignal:
    """What one step's rollouts said about the learning signal."""

    groups: int  # prompts in the step
    zero_variance_groups: int  # prompts whose answers all scored the same
    answers: int  # answers the environments tried to parse (0: no parse counters)
    parse_failures: int  # of those, how many had no answer to extract
    mean_reward: float
    sample: str  # "prompt -> completion -> expected" of one answer, for the message


def parse_failures(metrics: Mapping[str, float]) -> tuple[int, int]:
    """``(failed, total)`` answers of a step, from its environments' counters."""
    failed = sum(int(metrics.get(k, 0)) for k in PARSE_FAILURE_COUNTERS)
    total = sum(int(metrics.get(k, 0)) for k in PARSE_FAILURE_COUNTERS.values())
    return failed, total


def step_signal(
    rewards: Any, group_size: int, metrics: Mapping[str, float], sample: Callable[[int], str]
) -> StepSignal:
    """A step's `StepSignal` from its rewards ``[groups * group_size]`` (tensor, groups
    contiguous), its metrics (the parse counters) and ``sample(i)``, the text of sample ``i``
    (one from the first zero-variance group is shown)."""
    grouped = rewards.view(-1, group_size)
    flat = grouped.amax(1) == grouped.amin(1)
    first = int(flat.nonzero()[0, 0]) * group_size if bool(flat.any()) else 0
    failed, total = parse_failures(metrics)
    return StepSignal(
        groups=len(flat),
        zero_variance_groups=int(flat.sum()),
        answers=total,
        parse_failures=failed,
        mean_reward=float(rewards.float().mean()),
        sample=sample(first),
    )


class SignalWatch:
    """Counts consecutive no-signal steps; warns once (see the module docstring)."""

    def __init__(self, fraction: float = NO_SIGNAL_FRACTION, steps: int = NO_SIGNAL_STEPS) -> None:
        if not 0 < fraction <= 1 or steps < 1:
            raise ValueError(f"SignalWatch(fraction={fraction}, steps={steps}): need 0 < "
                             "fraction <= 1 and steps >= 1")  # fmt: skip
        self.fraction, self.steps = fraction, steps
        self.observed = 0  # steps seen
        self.run_length = 0  # consecutive no-signal steps so far
        self.warning: str | None = None  # the warning, once given

    def observe(self, step: int, s: StepSignal) -> str | None:
        """Record ``step``; the warning text on the step it is first due, else None."""
        self.observed += 1
        flat = s.groups > 0 and s.zero_variance_groups >= self.fraction * s.groups
        unparsed = s.answers > 0 and s.parse_failures >= self.fraction * s.answers
        self.run_length = self.run_length + 1 if flat or unparsed else 0
        if self.warning is not None or self.run_length < self.steps:
            return None
        self.warning = (
            f"no learning signal for {self.run_length} steps in a row (to step {step}): "
            f"{s.zero_variance_groups} of {s.groups} groups had zero reward variance "
            f"(mean reward {s.mean_reward:.3g}), {s.parse_failures} of {s.answers} answers "
            f"failed to parse; loss and gradients are ~0. A sample: {s.sample}. Check the "
            "prompt format (does the model see prompts like those it was trained on? "
            "data.prompt_file wraps each problem in a template), that the completions contain "
            "an answer the scorer can read, and the scorer (env.task_name, env.reward_fn). If "
            "instead every answer scores the top reward, the problems are too easy to teach it"
        )
        return self.warning
