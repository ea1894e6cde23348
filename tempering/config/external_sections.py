"""``grpo.external_harness``: GRPO on episodes that a harness outside tempering runs.

With ``grpo.rollout_transport=external`` the trainer hands each step's prompts to a harness
(a command run as a confined subprocess, or an HTTP endpoint), which makes its own model calls
through the run's generation server, one base URL per episode that names a rollout id; the
server records every call under it, and the trainer reassembles each episode from those calls
when the harness reports the episode's reward (tempering/experience/external.py,
docs/agentic.md "External harnesses"). `check_external` holds the cross-section refusals the
master config runs at load, before Ray.
"""

from __future__ import annotations

import shutil
from typing import Any

from pydantic import Field

from tempering.config.section import Section

__all__ = ["ExternalHarnessConfig", "check_external"]


class ExternalHarnessConfig(Section):
    """Where the episodes come from with ``grpo.rollout_transport=external``: exactly one of
    ``command`` and ``endpoint``."""

    command: list[str] | None = Field(
        None,
        description="the harness as an argv list (e.g. [python, examples/harness_calculator.py]):"
        " run per batch as a confined subprocess (its own session, address-space and CPU-time "
        "limits, a wall-clock deadline, an environment of PATH/HOME/LANG plus `env`); it reads "
        "one task per stdin line and writes one result per stdout line (JSON)",
    )
    endpoint: str | None = Field(
        None,
        description='an http(s) URL instead of a command: POST {"tasks": [...]} answered with '
        '{"results": [...]}, the same task and result objects as the command\'s lines',
    )
    processes: int = Field(
        1, ge=1, description="harness processes (or concurrent endpoint requests) a batch is "
        "split over, each with its share of the tasks",
    )  # fmt: skip
    timeout_s: float = Field(
        300.0, gt=0, description="wall-clock limit of one harness process (or endpoint "
        "request); past it the process group is killed and its unreported episodes fail",
    )  # fmt: skip
    memory_limit_mb: int = Field(
        4096, ge=64, description="address-space limit (RLIMIT_AS) of each harness process"
    )
    cpu_limit_s: int = Field(
        600, ge=1, description="CPU-time limit (RLIMIT_CPU) of each harness process"
    )
    max_output_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="a harness's stdout (or endpoint answer) larger "
        "than this fails its episodes",
    )  # fmt: skip
    max_calls_per_episode: int = Field(
        64, ge=1, description="model calls recorded per episode at most; an episode with more "
        "is masked and counted as failed",
    )  # fmt: skip
    env: dict[str, str] = Field(
        default_factory=dict,
        description="extra environment variables of the harness process (nothing else of the "
        "trainer's environment reaches it but PATH, HOME, LANG, VIRTUAL_ENV and the server's "
        "API key as OPENAI_API_KEY)",
    )
    correct_above: float | None = Field(
        0.5, description="a reported reward above this counts as a correct answer "
        "(val/accuracy, train/accuracy); null: the rewards are scores (val/reward_mean only)",
    )  # fmt: skip


def check_external(cfg: Any) -> None:
    """Refusals of ``grpo.rollout_transport=external`` that need more than its own section
    (a ValueError naming the keys and the fix); nothing with another transport."""
    grpo, ext = cfg.grpo, cfg.grpo.external_harness
    if grpo.rollout_transport != "external":
        return
    prefix = "grpo.rollout_transport=external"
    if not cfg.policy.generation.http_server.enabled:
        raise ValueError(
            f"{prefix}: the harness calls the trainer's generation server; set "
            "policy.generation.http_server.enabled=true"
        )
    if (ext.command is None) == (ext.endpoint is None):
        raise ValueError(
            f"{prefix} needs exactly one of grpo.external_harness.command (a harness program) "
            "and grpo.external_harness.endpoint (a harness service's URL)"
        )
    if ext.command is not None and (not ext.command or shutil.which(ext.command[0]) is None):
        raise ValueError(
            f"grpo.external_harness.command={ext.command!r}: "
            + ("the argv list is empty" if not ext.command else
               f"{ext.command[0]!r} is not an executable on PATH or a path to one")
            + "; name the harness program, e.g. [python, examples/harness_calculator.py]"
        )  # fmt: skip
    if ext.endpoint is not None and not ext.endpoint.startswith(("http://", "https://")):
        raise ValueError(f"grpo.external_harness.endpoint={ext.endpoint!r} is not an http(s) URL")
    refusals = [
        (grpo.max_rollout_turns != 1, f"grpo.max_rollout_turns={grpo.max_rollout_turns}: the "
         "harness decides its own turns; leave it at 1"),
        (grpo.async_grpo.enabled, "grpo.async_grpo.enabled=true: external episodes are "
         "collected synchronously (one weight version per step); set it false"),
        (bool(cfg.env.reward_fn or cfg.env.reward_model_path), "env.reward_fn / "
         "env.reward_model_path: the harness reports each episode's reward; unset them"),
        ("nemo_gym" in (cfg.data.dataset_name, cfg.env.task_name), "NeMo Gym rows: Gym's "
         "agents are their own harness (env.nemo_gym); use rollout_transport=in_process"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{prefix} cannot run with {why}")
