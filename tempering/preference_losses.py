"""Preference losses: DPO and its variants (TRL's names: sigmoid, hinge, IPO, robust, and the
reference-free SimPO and ORPO) and KTO for the policy, Bradley-Terry for reward models.

The `tempering.losses` contract (docs/CONTRACTS.md) with pairs: a batch interleaves them,
sample ``2i`` chosen and ``2i + 1`` rejected, and ``global_valid_seqs`` counts valid PAIRS
(`count_valid_pairs`). Torch only, like `tempering.losses`.
"""

from __future__ import annotations

from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from tempering.config.trainer_sections import REFERENCE_FREE_LOSSES, DPOLossType
from tempering.logits import upcast
from tempering.losses import (
    LossBatch,
    LossOutput,
    LossType,
    as_tensor_like,
    masked_mean,
    token_logprobs,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "BradleyTerryLoss",
    "DPOLoss",
    "KTOLoss",
    "count_valid_pairs",
    "dpo_preference_loss",
    "kto_losses",
    "orpo_log_odds_ratio",
]


def count_valid_pairs(sample_mask: Tensor) -> Tensor:
    """Number of valid preference pairs in an interleaved batch (chosen 2i, rejected 2i+1).

    A pair counts when both of its samples have sample_mask 1. This is the
    ``global_valid_seqs`` that `DPOLoss` and `BradleyTerryLoss` expect (summed over the
    global batch).
    """
    return _pair_mask(sample_mask).sum()


def _pair_mask(sample_mask: Tensor) -> Tensor:
    if sample_mask.shape[0] % 2 != 0:
        raise ValueError(
            f"Preference batches interleave chosen (2i) and rejected (2i+1) samples, so the "
            f"batch size must be even; got {sample_mask.shape[0]}."
        )
    return sample_mask[0::2] * sample_mask[1::2]


def _policy_logprobs(logits: Tensor, data: LossBatch) -> tuple[Tensor, Tensor, Tensor]:
    """What DPO and KTO read first: the policy's token log-probs ``[B, S]`` (at the token
    mask's rows only), that mask in their dtype ``[B, S]``, and the pair mask ``[B/2]``."""
    logprobs = token_logprobs(logits, data["input_ids"], data["token_mask"])  # [B, S]
    token_mask = data["token_mask"].to(logprobs.dtype)
    return logprobs, token_mask, _pair_mask(data["sample_mask"].to(logprobs.dtype))


DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
SIMPO_DEFAULT_GAMMA = 0.5  # TRL's simpo_gamma


def dpo_preference_loss(
    margin: Tensor, beta: float, kind: str, label_smoothing: float, gamma: float = 0.0
) -> Tensor:
    """Each pair's preference loss from its implicit-reward margin ``z = beta * d``, where
    ``d = (logp_c - ref_c) - (logp_r - ref_r)`` (TRL's names and formulas; ``e`` = label
    smoothing, the assumed share of pairs whose labels are flipped):

      sigmoid  -(1 - e) logsigmoid(z) - e logsigmoid(-z)      (DPO; e > 0: conservative DPO)
      robust   (-(1 - e) logsigmoid(z) + e logsigmoid(-z)) / (1 - 2e)   (unbiased under flips)
      hinge    relu(1 - z)                                     (SLiC)
      ipo      (d - 1 / (2 beta))^2                            (IPO: d regressed to a target)
      simpo    sigmoid's of z - gamma, with no reference: d = mean logp_c - mean logp_r
      orpo     -beta logsigmoid(margin), where the caller passes the log odds ratio of the
               mean-per-token probabilities as ``margin`` (`orpo_log_odds_ratio`); beta is
               ORPO's lambda, a weight outside the sigmoid
    """
    if kind == "orpo":
        return -beta * F.logsigmoid(margin)
    if kind == "hinge":
        return torch.relu(1 - margin)
    if kind == "ipo":
        return (margin / beta - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        margin = margin - gamma
    win, lose = -F.logsigmoid(margin), -F.logsigmoid(-margin)
    if kind in ("sigmoid", "simpo"):
        return (1 - label_smoothing) * win + label_smoothing * lose
    if kind == "robust":
        return ((1 - label_smoothing) * win - label_smoothing * lose) / (1 - 2 * label_smoothing)
    raise AssertionError(kind)  # DPOLoss refuses an unknown kind


def orpo_log_odds_ratio(logp_chosen: Tensor, logp_rejected: Tensor) -> Tensor:
    """ORPO's ``log(odds_c / odds_r)`` with ``odds = p / (1 - p)`` and ``p = exp(mean token
    log-prob)``; ``log(1 - p)`` as ``log(-expm1(logp))``, with ``logp`` held below -1e-6 so a
    response the policy already finds certain gives a large, finite log odds."""

    def log_odds(logp: Tensor) -> Tensor:
        logp = logp.clamp(max=-1e-6)
        return logp - torch.log(-torch.expm1(logp))

    return log_odds(logp_chosen) - log_odds(logp_rejected)


class DPOLoss:
    """Direct Preference Optimisation with an optional SFT term on chosen.

    The batch interleaves pairs: sample ``2i`` is chosen, ``2i + 1`` rejected. `data` needs
    ``input_ids``, ``token_mask``, ``sample_mask`` and ``reference_policy_logprobs [B, S]``.
    Per sample, ``logp = sum over token_mask of token logprob`` (or the mean with
    ``preference_average_log_probs=True``); same for the reference. Per pair:

      reward_c = beta * (logp_c - ref_c),  reward_r = beta * (logp_r - ref_r)
      pref     = -logsigmoid(reward_c - reward_r)   (``preference_loss_type="sigmoid"``; the
                 others: `dpo_preference_loss`)
      sft      = -logp_c                (same sum/mean aggregation as above)
      loss     = sum over valid pairs of (pref + sft_loss_weight * sft) / global_valid_seqs

    ``preference_loss_type="simpo"`` and ``"orpo"`` are reference-free (``needs_reference``
    False: the policy is trained without ``with_reference``, and ``reference_policy_logprobs``
    is not read): ``reward = beta * logp`` (mean log-probs: the config requires them). SimPO
    shifts the margin by ``simpo_gamma``; ORPO's preference term is
    ``-beta * logsigmoid(orpo_log_odds_ratio(logp_c, logp_r))`` (TRL's ORPOTrainer; its SFT
    term is ``sft_loss_weight`` x the chosen NLL, 1 in the paper), logged as ``log_odds_ratio``.

    IMPORTANT: ``global_valid_seqs`` counts PAIRS (valid pairs in the global batch, see
    `count_valid_pairs`), not samples. ``beta`` is NeMo RL's ``reference_policy_kl_penalty``.
    Metrics: ``loss``, ``preference_loss``, ``sft_loss`` (both globally normalised),
    ``preference_accuracy``, ``rewards_chosen_mean``, ``rewards_rejected_mean``,
    ``reward_margin``, ``logprob_accuracy`` and ``reference_logprob_accuracy`` (pairs whose
    chosen answer the policy, and the reference, finds more likely by the same sum or mean of
    log-probs; means over this micro-batch's valid pairs), ``num_valid_pairs``.
    """

    loss_type: LossType = "sequence"
    pairwise: bool = True
    reads_token_mask_only: bool = True  # (the LossFunction protocol)

    def __init__(
        self,
        reference_policy_kl_penalty: float = 0.1,
        preference_average_log_probs: bool = False,
        sft_loss_weight: float = 0.0,
        preference_loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        simpo_gamma: float | None = None,
    ) -> None:
        if reference_policy_kl_penalty <= 0:
            raise ValueError(
                f"DPO reference_policy_kl_penalty (beta)={reference_policy_kl_penalty} must be > 0."
            )
        self.beta = reference_policy_kl_penalty
        self.preference_average_log_probs = preference_average_log_probs
        self.sft_loss_weight = sft_loss_weight
        self.preference_loss_type = preference_loss_type
        self.label_smoothing = label_smoothing
        self.needs_reference = preference_loss_type not in REFERENCE_FREE_LOSSES
        self.gamma = SIMPO_DEFAULT_GAMMA if simpo_gamma is None else simpo_gamma
        if preference_loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"DPO loss_type={preference_loss_type!r}: use one of {', '.join(DPO_LOSS_TYPES)}"
            )

    def _sequence_logprob(self, logprobs: Tensor, token_mask: Tensor) -> Tensor:
        total = (logprobs * token_mask).sum(-1)  # [B]
        if self.preference_average_log_probs:
            return total / token_mask.sum(-1).clamp(min=1)
        return total

    def __call__(
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        logprobs, token_mask, pair_mask = _policy_logprobs(logits, data)

        seq_lp = self._sequence_logprob(logprobs, token_mask)  # [B]
        seq_ref = None
        if self.needs_reference:
            ref = data["reference_policy_logprobs"].to(logprobs.dtype)
            seq_ref = self._sequence_logprob(ref, token_mask)  # [B]
        rewards = self.beta * (seq_lp if seq_ref is None else seq_lp - seq_ref)  # [B]
        r_chosen, r_rejected = rewards[0::2], rewards[1::2]  # [B/2]
        margin = r_chosen - r_rejected

        denom = as_tensor_like(global_valid_seqs, logprobs)
        loss_margin = margin
        if self.preference_loss_type == "orpo":
            loss_margin = orpo_log_odds_ratio(seq_lp[0::2], seq_lp[1::2])
        per_pair = dpo_preference_loss(
            loss_margin, self.beta, self.preference_loss_type, self.label_smoothing, self.gamma
        )
        pref_loss = (per_pair * pair_mask).sum() / denom
        sft_loss = (-seq_lp[0::2] * pair_mask).sum() / denom
        loss = pref_loss + self.sft_loss_weight * sft_loss

        with torch.no_grad():
            metrics = {
                "loss": float(loss.item()),
                "preference_loss": float(pref_loss.item()),
                "sft_loss": float(sft_loss.item()),
                "preference_accuracy": masked_mean((margin > 0).to(margin.dtype), pair_mask),
                "rewards_chosen_mean": masked_mean(r_chosen, pair_mask),
                "rewards_rejected_mean": masked_mean(r_rejected, pair_mask),
                "reward_margin": masked_mean(margin, pair_mask),
                "logprob_accuracy": masked_mean(
                    (seq_lp[0::2] > seq_lp[1::2]).to(margin.dtype), pair_mask
                ),
                "num_valid_pairs": float(pair_mask.sum().item()),
            }
            if self.preference_loss_type == "orpo":
                metrics["log_odds_ratio"] = masked_mean(loss_margin, pair_mask)
            if seq_ref is not None:  # pairs the frozen reference already ranks right
                metrics["reference_logprob_accuracy"] = masked_mean(
                    (seq_ref[0::2] > seq_ref[1::2]).to(margin.dtype), pair_mask
                )
        return loss, metrics


def kto_losses(
    log_ratio: Tensor,
    kl: Tensor,
    desirable: Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> Tensor:
    """Each example's KTO loss (Ethayarajh et al. 2024; TRL's KTOTrainer) from its log-ratio
    ``r = logp - logp_ref`` (summed over the response) and the reference point ``kl``:

      desirable    lambda_D * (1 - sigmoid(beta * (r - kl)))
      undesirable  lambda_U * (1 - sigmoid(beta * (kl - r)))
    """
    good = desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - log_ratio)))
    return torch.where(desirable > 0.5, good, bad)


def reference_point(kl_rows: Tensor, valid: Tensor) -> Tensor:
    """KTO's reference point: the KL rows' mean log-ratio over this micro-batch of every rank
    (TRL gathers it over processes per forward pass), clamped at 0.

    Collective when torch.distributed runs several ranks: each rank calls it once per
    micro-batch, and a pairwise loss's micro-batches are fixed-size
    (`training.check_pairwise_batching` refuses token budgets), so every rank calls it as many
    times. A tensor-parallel peer adds the same rows again: the mean is unchanged."""
    stats = torch.stack([(kl_rows * valid).sum(), valid.sum()])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).clamp(min=0)


class KTOLoss:
    """Kahneman-Tversky Optimisation: unpaired rows, each desirable or not, against a KL
    reference point.

    The batch (`tempering.data.unpaired.collate_kto`) interleaves each example (row ``2i``)
    with its KL row (``2i + 1``: the example's prompt with another example's response); `data`
    needs ``input_ids``, ``token_mask``, ``sample_mask``, ``desirable`` and
    ``reference_policy_logprobs``. Per row, ``r = sum over the response of (logp - logp_ref)``;
    the reference point ``kl`` is the mean ``r`` of this micro-batch's KL rows on every rank,
    clamped at 0 and detached (no gradient flows through it: TRL's estimate, per forward pass,
    gathered over processes; `reference_point`); then
    `kto_losses` per example, summed over valid examples / ``global_valid_seqs`` (which
    counts examples with their KL rows, as `count_valid_pairs` counts pairs).

    Metrics: ``loss``, ``kl``, ``reward_accuracy`` (examples whose reward sits on their label's
    side of the reference point), ``num_valid_pairs`` (examples), and per label the sums
    ``num_desirable`` / ``rewards_desirable_sum`` (and undesirable's), which add up exactly
    over micro-batches and ranks for the caller's means (``beta * r``).
    """

    loss_type: LossType = "sequence"
    pairwise: bool = True  # an example and its KL row stay in one micro-batch
    reads_token_mask_only: bool = True  # (the LossFunction protocol)
    needs_reference: bool = True

    def __init__(
        self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
    ) -> None:
        if min(beta, desirable_weight, undesirable_weight) <= 0:
            raise ValueError(
                f"KTO beta={beta}, desirable_weight={desirable_weight} and "
                f"undesirable_weight={undesirable_weight} must all be > 0"
            )
        self.beta = beta
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight

    def __call__(
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        logprobs, token_mask, valid = _policy_logprobs(logits, data)
        ref = data["reference_policy_logprobs"].to(logprobs.dtype)
        log_ratio = ((logprobs - ref) * token_mask).sum(-1)  # [B]
        r, kl_rows = log_ratio[0::2], log_ratio[1::2]
        kl = reference_point(kl_rows.detach(), valid)
        desirable = data["desirable"][0::2].to(logprobs.dtype)
        per_example = kto_losses(r, kl, desirable, self.beta, self.desirable_weight,
                                 self.undesirable_weight)  # fmt: skip
        loss = (per_example * valid).sum() / as_tensor_like(global_valid_seqs, logprobs)
        with torch.no_grad():
            right = torch.where(desirable > 0.5, r > kl, r < kl).to(r.dtype)
            good, bad = desirable * valid, (1 - desirable) * valid
            metrics = {
                "loss": float(loss.item()),
                "kl": float(kl.item()),
                "reward_accuracy": masked_mean(right, valid),
                "num_valid_pairs": float(valid.sum().item()),
                "num_desirable": float(good.sum().item()),
                "num_undesirable": float(bad.sum().item()),
                "rewards_desirable_sum": float((self.beta * r * good).sum().item()),
                "rewards_undesirable_sum": float((self.beta * r * bad).sum().item()),
            }
        return loss, metrics


class BradleyTerryLoss:
    """Bradley-Terry pairwise loss for reward models; takes scores, not logits.

    ``scores`` is ``[B]`` (one scalar per sequence), interleaved: ``2i`` chosen, ``2i + 1``
    rejected. loss = sum over valid pairs of ``-logsigmoid(s_c - s_r)`` / global_valid_seqs,
    where ``global_valid_seqs`` counts PAIRS (see `count_valid_pairs`); `data` needs only
    ``sample_mask``. Metrics: ``loss``, ``accuracy`` (share of pairs with s_c > s_r),
    ``margin`` (mean s_c - s_r), ``num_valid_pairs``.
    """

    loss_type: LossType = "sequence"
    pairwise: bool = True

    def __call__(
        self, scores: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        if scores.dim() == 2 and scores.shape[-1] == 1:
            scores = scores.squeeze(-1)
        if scores.dim() != 1:
            raise ValueError(
                f"BradleyTerryLoss expects scores of shape [B] (or [B, 1]); got {tuple(scores.shape)}."
            )
        scores = upcast(scores)
        pair_mask = _pair_mask(data["sample_mask"].to(scores.dtype))
        margin = scores[0::2] - scores[1::2]
        loss = (-F.logsigmoid(margin) * pair_mask).sum() / as_tensor_like(global_valid_seqs, scores)
        with torch.no_grad():
            metrics = {
                "loss": float(loss.item()),
                "accuracy": masked_mean((margin > 0).to(margin.dtype), pair_mask),
                "margin": masked_mean(margin, pair_mask),
                "num_valid_pairs": float(pair_mask.sum().item()),
            }
        return loss, metrics
