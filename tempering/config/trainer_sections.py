"""The loop sections of the supervised and preference trainers: ``sft``, ``dpo`` (with its
preference losses), ``kto`` and ``rm``. `tempering.config.schemas` holds the rest and the master
configs, and re-exports these."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tempering.config import loop_keys
from tempering.config.section import Section


class SFTConfig(Section):
    max_num_steps: loop_keys.MaxNumSteps = 300
    max_num_epochs: loop_keys.MaxNumEpochs = 100
    val_period: loop_keys.ValPeriod = 50
    val_batches: loop_keys.ValBatches = 4
    val_global_batch_size: int = Field(
        64, ge=1, description="held-out examples per validation batch"
    )
    val_micro_batch_size: int = Field(
        32, ge=1, description="held-out examples per validation forward pass"
    )
    val_at_start: loop_keys.ValAtStart = True
    seed: int = Field(
        42,
        description="torch seed of the policy workers and of the training examples' shuffle order",
    )
    stop_val_accuracy_range: tuple[float, float] | None = Field(
        None, description="stop when greedy val accuracy falls inside [lo, hi] (tiny-arith recipe)"
    )
    arithmetic_problems_per_sample: int = Field(
        1,
        ge=1,
        description="arithmetic data: chain this many problems into one training conversation "
        "(user/assistant turns), so the model answers in context (tiny-arith-chat)",
    )


class PreferenceLoopConfig(Section):
    """The keys of the preference-training loop DPO and the reward model share
    (`tempering.algorithms.preference.train_loop`)."""

    max_num_steps: loop_keys.MaxNumSteps = 100
    max_num_epochs: loop_keys.MaxNumEpochs = 100
    val_period: loop_keys.ValPeriod = 20
    val_batches: loop_keys.ValBatches = 4
    val_global_batch_size: int = Field(
        32,
        ge=2,
        description="sequences per validation batch: a pair (KTO: a row and its KL row) is two",
    )
    val_micro_batch_size: int = Field(
        16, ge=2, description="sequences per validation forward pass (even: whole pairs)"
    )
    val_at_start: loop_keys.ValAtStart = True
    seed: int = Field(
        42, description="torch seed of the model workers and of the training pairs' shuffle order"
    )


# the preference losses of `tempering.preference_losses.dpo_preference_loss`, by TRL's names
DPOLossType = Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"]
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # rewards from the policy alone: no reference model


class DPOConfig(PreferenceLoopConfig):
    reference_policy_kl_penalty: float = Field(0.1, gt=0, description="beta")
    preference_average_log_probs: bool = Field(
        False, description="mean instead of sum of token log-probs per sequence"
    )
    sft_loss_weight: float = Field(0.0, ge=0, description="weight of NLL on the chosen response")
    loss_type: DPOLossType = Field(
        "sigmoid",
        description="the preference loss of the pair's margin (TRL's names); simpo and orpo "
        "are reference-free (no reference model is built)",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="sigmoid/robust/simpo: the assumed share of flipped pairs"
    )
    simpo_gamma: float | None = Field(
        None, ge=0, description="simpo: the target reward margin gamma (unset: TRL's 0.5)"
    )
    val_greedy_accuracy: bool = Field(
        True, description="arithmetic data: also report tiny-arith greedy accuracy at validation"
    )

    @model_validator(mode="after")
    def _loss_keys_read(self) -> DPOConfig:
        """Label smoothing is a sigmoid-loss idea (cDPO, robust DPO, SimPO's); the hinge, IPO
        and ORPO losses have no such term, and only SimPO has a gamma: a key the chosen loss
        would ignore is refused. SimPO's and ORPO's rewards are mean log-probs per token, and
        ORPO is an SFT loss plus its odds-ratio term: both said explicitly."""
        if self.label_smoothing and self.loss_type in ("hinge", "ipo", "orpo"):
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing} has no effect with "
                f"dpo.loss_type={self.loss_type} (it smooths the sigmoid, robust and simpo "
                "losses): set dpo.label_smoothing=0 or dpo.loss_type=sigmoid|robust|simpo"
            )
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ValueError(
                f"dpo.simpo_gamma={self.simpo_gamma} is read by dpo.loss_type=simpo only "
                f"(this run's is {self.loss_type}): remove it or set dpo.loss_type=simpo"
            )
        if self.loss_type in REFERENCE_FREE_LOSSES and not self.preference_average_log_probs:
            raise ValueError(
                f"dpo.loss_type={self.loss_type} scores each response by its mean log-prob per "
                "token (the paper's length normalisation), and "
                "dpo.preference_average_log_probs=false asks for the sum: set "
                "dpo.preference_average_log_probs=true"
            )
        if self.loss_type == "orpo" and self.sft_loss_weight == 0:
            raise ValueError(
                "dpo.loss_type=orpo is the SFT loss on the chosen response plus beta x the "
                "odds-ratio loss, and dpo.sft_loss_weight=0 drops the SFT part: set "
                "dpo.sft_loss_weight=1 (the paper's)"
            )
        return self

    @property
    def reference_free(self) -> bool:
        """No reference model: SimPO's and ORPO's rewards are the policy's own log-probs."""
        return self.loss_type in REFERENCE_FREE_LOSSES


class KTOConfig(PreferenceLoopConfig):
    """Kahneman-Tversky Optimisation (`tempering.preference_losses.KTOLoss`; TRL's names)."""

    beta: float = Field(0.1, gt=0, description="scale of the implicit reward against the KL")
    desirable_weight: float = Field(1.0, gt=0, description="lambda_D: weight of desirable rows")
    undesirable_weight: float = Field(1.0, gt=0, description="lambda_U: weight of undesirable rows")
    val_greedy_accuracy: bool = Field(
        True, description="arithmetic data: also report tiny-arith greedy accuracy at validation"
    )


class RMConfig(PreferenceLoopConfig):
    export_dir: str | None = Field(
        None, description="HF folder for the final reward model; default <checkpoint_dir>/final_hf"
    )
