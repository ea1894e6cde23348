"""The keys every training loop's section has (``sft``, ``dpo``/``kto``/``rm``, ``grpo``,
``distillation``), each typed once with its bound and its text, so that the loops' sections
differ only in their defaults: ``max_num_steps: loop_keys.MaxNumSteps = 300``.

Validation runs every ``val_period`` steps, after the last step, and (``val_at_start``) before
the first step of a fresh run; a validation reads the first held-out rows only, and the loops
log when they hold fewer than it asks for."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# the loop's length
MaxNumSteps = Annotated[int, Field(ge=1, description="training steps (the lr schedule spans them)")]
MaxNumEpochs = Annotated[int, Field(ge=1, description="passes over the training data at most")]

# validation
ValPeriod = Annotated[int, Field(ge=0, description="every N steps and after the last; 0 = never")]
ValAtStart = Annotated[bool, Field(description="validate before a fresh run's first step too")]
ValBatches = Annotated[int, Field(ge=1, description="held-out batches a validation reads at most")]
MaxValSamples = Annotated[int, Field(ge=1, description="held-out problems validated (the first N)")]
ValBatchSize = Annotated[int, Field(ge=1, description="held-out problems per greedy generation")]

# rollouts (GRPO's, and distillation's, which rolls out as GRPO does)
NumPromptsPerStep = Annotated[int, Field(ge=1, description="prompts per step (GRPO: its groups)")]
NumGenerationsPerPrompt = Annotated[int, Field(ge=1, description="samples per prompt (a group)")]
MaxRolloutTurns = Annotated[int, Field(ge=1, description="model turns per episode at most")]
