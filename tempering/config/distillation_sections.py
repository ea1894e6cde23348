"""The config sections of on-policy distillation alone (NeMo RL's key names): the loop
(``distillation``), the loss (``loss_fn``) and the ``teacher``. `tempering.config.schemas` holds
the master config and re-exports these.

A distillation run rolls out exactly as GRPO does (same prompts, environments, generation and
checkpoints), so `as_grpo_config` restates a distillation config as the GRPO config of its
rollouts; the algorithm hands that to GRPO's set-up and validation, and nothing else of GRPO's
loop keys can be set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tempering.config import loop_keys
from tempering.config.section import Section


class DistillationConfig(Section):
    num_prompts_per_step: loop_keys.NumPromptsPerStep = 128
    num_generations_per_prompt: loop_keys.NumGenerationsPerPrompt = 1
    max_rollout_turns: loop_keys.MaxRolloutTurns = 1
    rollout_transport: Literal["in_process", "http"] = Field(
        "in_process",
        description="rollouts call the chat service directly, or over HTTP through "
        "policy.generation.http_server (which must be enabled)",
    )
    max_num_steps: loop_keys.MaxNumSteps = 1000
    max_num_epochs: loop_keys.MaxNumEpochs = 10
    val_period: loop_keys.ValPeriod = 20
    val_at_start: loop_keys.ValAtStart = True
    max_val_samples: loop_keys.MaxValSamples = 512
    val_batch_size: loop_keys.ValBatchSize = 64
    topk_logits_k: int = Field(
        64, ge=1, description="teacher log-probs kept per token (the only teacher output sent)"
    )
    max_wall_time_s: float | None = Field(None, description="stop after this many seconds")
    seed: int = Field(
        42,
        description="torch seed of student and teacher workers, prompt order and step sampling seeds",
    )


class DistillationLossConfig(Section):
    """`tempering.losses.DistillationLoss`."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "forward",
        description="forward KL(teacher || student), reverse KL(student || teacher), or mixed",
    )
    mixed_kl_weight: float = Field(
        0.5, ge=0, le=1, description="kl_type=mixed: the forward KL's weight"
    )
    zero_outside_topk: bool = Field(
        False,
        description="false: both distributions renormalised on the teacher's top-k; true: the "
        "mass outside it counts as zero (a partial sum)",
    )

    @model_validator(mode="after")
    def _weight_needs_mixed(self) -> DistillationLossConfig:
        if self.kl_type != "mixed" and self.mixed_kl_weight != 0.5:
            raise ValueError(
                f"loss_fn.mixed_kl_weight={self.mixed_kl_weight} is read only with "
                f"kl_type=mixed (kl_type is {self.kl_type!r}): set loss_fn.kl_type=mixed, or "
                "remove mixed_kl_weight"
            )
        return self


class TeacherDTensorConfig(Section):
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks splitting each teacher layer (inside a node)"
    )


class TeacherConfig(Section):
    """``teacher:``, shaped like ``policy:`` but with only what a frozen scorer reads: it
    neither trains nor generates, so optimizer, scheduler, generation and LoRA keys are
    refused (a YAML anchor copying ``policy:`` brings them: list only these)."""

    model_name: str = Field(
        "tiny-arith-grpo", description="the teacher: a registry name, a local HF folder or a hub id"
    )
    precision: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the teacher's compute dtype (bfloat16: over fp32 weights, as policy.precision)",
    )
    logprob_batch_size: int = Field(32, ge=1, description="rows per teacher forward")
    num_threads: int | None = Field(None, description="torch threads per teacher worker (CPU)")
    dtensor_cfg: TeacherDTensorConfig = TeacherDTensorConfig()


def as_grpo_config(d: DistillationConfig, policy: Any, sections: dict[str, Any]) -> dict[str, Any]:
    """The GRPO config (as a dict for `GRPOMasterConfig`) whose rollouts a distillation run
    makes: its loop keys from ``distillation``, no reward baseline (advantages are not used),
    and ``sections`` (cluster, data, env, logger, ...) as they are."""
    grpo = {
        "num_prompts_per_step": d.num_prompts_per_step,
        "num_generations_per_prompt": d.num_generations_per_prompt,
        "max_rollout_turns": d.max_rollout_turns,
        "rollout_transport": d.rollout_transport,
        "max_num_steps": d.max_num_steps,
        "max_num_epochs": d.max_num_epochs,
        "val_period": d.val_period,
        "val_at_start": d.val_at_start,
        "max_val_samples": d.max_val_samples,
        "val_batch_size": d.val_batch_size,
        "max_wall_time_s": d.max_wall_time_s,
        "seed": d.seed,
        "normalize_rewards": False,
        "use_leave_one_out_baseline": False,
    }
    return {**sections, "policy": policy, "grpo": grpo}
