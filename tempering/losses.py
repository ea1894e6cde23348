"""Loss functions for SFT, DPO, reward models, GRPO/PPO and on-policy distillation.

A layer below the models: the policy worker receives a loss object and calls it; it never
imports the algorithms. Only torch here, and the GRPO loss's option rules it shares with the
config (`tempering.config.schemas.off_policy_loss_problems`).

Every loss follows the `LossFunction` contract in docs/CONTRACTS.md:

    loss, metrics = loss_fn(logits, data, global_valid_toks, global_valid_seqs)

`logits` is ``[B, S, V]`` from the policy forward pass (already divided by the sampling
temperature where that matters), `data` is a ``BatchedDataDict`` (any mapping works) with
``input_ids [B, S]``, ``token_mask [B, S]``, ``sample_mask [B]`` and the algorithm's own keys.
The returned loss is already divided by the GLOBAL count of valid tokens (``loss_type ==
"token"``) or valid sequences (``loss_type == "sequence"``), so summing the losses of all
micro-batches (and all data-parallel ranks) gives exactly the loss of one big batch, and the
same gradient.

Metrics are plain floats for this micro-batch. Those named ``loss`` and ``kl_penalty`` are
already globally normalised (sum them over micro-batches); the others are means over this
micro-batch's valid tokens / pairs, reported with ``num_valid_tokens`` / ``num_valid_pairs``
so a caller can weight them.

Log-prob layout (the contract): ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
for ``t >= 1`` and ``logprobs[b, 0] = 0``; `token_logprobs` computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from tempering.config.schemas import off_policy_loss_problems
from tempering.config.trainer_sections import REFERENCE_FREE_LOSSES, DPOLossType
from tempering.logits import (
    HiddenLogits,
    NextTokenLogprob,
    as_logits,
    needed_rows,
    next_token_entropy,
    next_token_logprobs,
    topk_next_token,
    upcast,
)

LossType = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
DistillationKL = Literal["forward", "reverse", "mixed"]
TruncatedISType = Literal["tis", "icepop", "seq-mask-tis"]

__all__ = [
    "BradleyTerryLoss",
    "ClippedPGLoss",
    "DPOLoss",
    "DistillationLoss",
    "KLEstimator",
    "LossFunction",
    "LossType",
    "NLLLoss",
    "TruncatedISType",
    "count_valid_pairs",
    "dpo_preference_loss",
    "kl_estimate",
    "token_entropy",
    "token_logprobs",
    "topk_logprobs",
]


class LossFunction(Protocol):
    """What the policy worker calls on each micro-batch (docs/CONTRACTS.md).

    ``pairwise``: the batch interleaves chosen/rejected pairs (``2i`` chosen, ``2i + 1``
    rejected) and ``global_valid_seqs`` counts PAIRS; the worker then keeps pairs together
    in one micro-batch. ``reads_token_mask_only`` (optional, False when absent): the loss
    reads the logits only at the rows ``token_mask`` needs (row ``t`` where token ``t + 1``
    counts, `tempering.logits.needed_rows`), so the worker may compute the last layer there
    alone (`read_rows.py`; a read elsewhere raises). ``temperature`` (optional, 1.0 when
    absent): the temperature the samples were drawn at; the worker divides the policy's and
    the reference's logits by it before the loss sees them, so the trainer's log-probs are
    those of the distribution the sampler drew from (docs/CONTRACTS.md). The worker reads
    only these attributes and calls the loss.
    """

    loss_type: LossType
    pairwise: bool

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]: ...


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def token_logprobs(
    logits: Tensor | HiddenLogits, input_ids: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Log-prob of each token under the logits that predict it, in the contract's layout.

    logits: ``[B, S, V]`` (a tensor, or `HiddenLogits`: computed chunk by chunk, never whole);
    input_ids: ``[B, S]``. Returns ``[B, S]`` where position ``t >= 1`` is
    ``log_softmax(logits[:, t - 1])[input_ids[:, t]]`` and position 0 is 0. Computed as
    ``logit - logsumexp`` in at least fp32 (stable for large logits), on the whole contiguous
    logits (the last position scores a dummy target and is dropped; its gradient is zero).
    ``mask`` (``[B, S]``): only the positions where it is non-zero are wanted, the others are
    0 -- with `HiddenLogits` only their rows are projected (a loss passes its token mask).
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs expects logits [B, S, V] and input_ids [B, S]; got logits "
            f"{tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}."
        )
    targets = F.pad(input_ids[:, 1:].long(), (0, 1), value=0)  # [B, S]: next token; last: dummy
    rows = needed_rows(mask)
    if isinstance(logits, HiddenLogits):
        picked = next_token_logprobs(logits, targets, rows)
    else:  # [B, S]: picked[:, t] scores token t+1
        picked = NextTokenLogprob.apply(logits, targets)
        if rows is not None:
            picked = picked * rows
    return F.pad(picked[:, :-1], (1, 0), value=0.0)


def token_entropy(logits: Tensor | HiddenLogits, mask: Tensor | None = None) -> Tensor:
    """Entropy of the next-token distribution, aligned like `token_logprobs` (position 0 = 0).

    Returns ``[B, S]``; entry ``t`` is the entropy of the distribution that scored token ``t``.
    With ``mask`` (``[B, S]``) only the entries where it is non-zero are computed (the others
    are 0): a loss's metric needs its valid tokens, not the prompt's. Not differentiated.
    """
    if isinstance(logits, HiddenLogits):  # the training pass's, or computed at the mask now
        rows = needed_rows(mask)
        ent = next_token_entropy(logits, rows)
        ent = ent if rows is None else ent * rows
        return F.pad(ent[:, :-1], (1, 0))
    with torch.no_grad():
        work = logits[:, :-1]
        if mask is None:
            keep = torch.ones(work.shape[:2], dtype=torch.bool, device=logits.device)
        else:
            keep = mask[:, 1:] != 0
        logp = torch.log_softmax(upcast(work[keep]), dim=-1)  # [N, V]: only the kept rows
        ent = torch.zeros(logits.shape[:2], dtype=logp.dtype, device=logits.device)
        ent[:, 1:][keep] = -(logp.exp() * logp).sum(-1)
    return ent


def _valid_token_mask(data: Mapping[str, Any], like: Tensor) -> Tensor:
    """token_mask * sample_mask as ``[B, S]`` in the dtype of `like`."""
    for key in ("token_mask", "sample_mask"):
        if key not in data:
            raise KeyError(f"Loss input is missing '{key}'; keys present: {sorted(data)}.")
    token_mask = data["token_mask"].to(like.dtype)
    sample_mask = data["sample_mask"].to(like.dtype)
    return token_mask * sample_mask.unsqueeze(-1)


def _as_tensor(x: Tensor | float, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` where mask is 1 (a float; 0.0 when nothing is valid)."""
    denom = mask.sum()
    if denom.item() == 0:
        return 0.0
    return float(((values * mask).sum() / denom).item())


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples drawn from pi.

    With ``log r = logprobs - ref_logprobs`` (r = pi / pi_ref at the sampled token):

    - ``k1 = log r``
    - ``k2 = 0.5 * (log r) ** 2``
    - ``k3 = exp(-log r) - 1 + log r`` (Schulman 2020; unbiased and always >= 0)
    """
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(-log_r) - 1.0 + log_r
    raise ValueError(f"kl estimator '{estimator}' is unknown; use one of 'k1', 'k2', 'k3'.")


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


# --------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------


class NLLLoss:
    """Token-level negative log-likelihood (SFT).

    loss = sum over tokens with token_mask * sample_mask of -logprob, / global_valid_toks.
    Metrics: ``loss``, ``num_valid_tokens``.
    """

    loss_type: LossType = "token"
    pairwise: bool = False
    reads_token_mask_only: bool = True  # (the LossFunction protocol)

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        logprobs = token_logprobs(logits, data["input_ids"], data.get("token_mask"))  # [B, S]
        mask = _valid_token_mask(data, logprobs)
        loss = -(logprobs * mask).sum() / _as_tensor(global_valid_toks, logprobs)
        return loss, {"loss": float(loss.item()), "num_valid_tokens": float(mask.sum().item())}


# --------------------------------------------------------------------------------------------
# GRPO / PPO
# --------------------------------------------------------------------------------------------


class ClippedPGLoss:
    """Clipped policy-gradient loss (PPO / GRPO / DAPO / GSPO) with an optional KL penalty and
    off-policy importance-sampling correction (NeMo RL's ``ClippedPGLossFn`` semantics).

    Inputs in `data` (all aligned like `token_logprobs`):
      ``advantages`` ``[B, S]`` or ``[B]`` (broadcast over tokens), ``prev_logprobs`` ``[B, S]``
      (behaviour policy, recomputed by the trainer; when absent, the batch is on-policy and
      the current log-probs, detached, stand in: ratio 1, the same gradient, one forward
      pass fewer), ``generation_logprobs`` ``[B, S]`` (from
      the generator; needed for the mismatch metrics and for importance-sampling correction),
      ``reference_policy_logprobs`` ``[B, S]`` (needed when ``reference_policy_kl_penalty > 0``).

    ``temperature``: the sampling temperature (``policy.generation.temperature``). The policy
    worker divides the logits (the policy's and the reference's) by it before this loss runs,
    as NeMo RL's worker does, so ``curr``, ``prev`` and ``ref`` are log-probs of the
    distribution the generator sampled from; at 1.0 nothing changes.

    Per valid token, with advantage ``A`` and the PPO ratio ``ratio``:

      ratio = exp(curr - prev)                                   (per token; default)
      ratio = exp(mean over the sequence's valid tokens of (curr - prev))
              (``sequence_level_importance_ratios``, GSPO: one ratio per sequence, the same
              value on each of its tokens, differentiated through every token's ``curr``)
      pg = max(-A * ratio, -A * clamp(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max))
      if ratio_clip_c is set and A < 0:  pg = min(pg, -A * ratio_clip_c)       (dual clip)
      kl = reference_policy_kl_penalty * kl_estimate(curr, ref, kl_estimator)
      per_token = w * (pg + kl)

    The importance weight ``w`` (detached) is 1 unless ``use_importance_sampling_correction``;
    then ``w = exp(prev - gen)`` per token (with GSPO: ``exp(sum over the sequence's valid tokens
    of (prev - gen))``, one weight per sequence), shaped by ``truncated_importance_sampling_type``
    with the band ``[lo, hi]`` = [``truncated_importance_sampling_ratio_min`` (tis: default 0),
    ``truncated_importance_sampling_ratio``]:

      None            w as it is (no band; both bounds must be None)
      "tis"           w = clamp(w, lo, hi)
      "icepop"        w = 0 where w is outside [lo, hi]          (the token adds nothing)
      "seq-mask-tis"  w = 0 on every token of a sequence whose geometric-mean weight
                      exp(mean over its valid tokens of (prev - gen)) is outside [lo, hi];
                      the kept sequences keep their raw per-token w (not clamped)

    Refused combinations (`off_policy_loss_problems`, the same rules as the config): a type
    without the correction, a bound without a type, icepop/seq-mask-tis without a lower bound,
    lo > hi, seq-mask-tis with GSPO, GSPO with ``loss_type="token"``.

    Normalisation: ``loss_type="token"`` sums per_token over valid tokens and divides by
    ``global_valid_toks``; ``loss_type="sequence"`` averages each sequence's valid tokens,
    sums over valid sequences and divides by ``global_valid_seqs``.

    Metrics: ``loss``, ``kl_penalty`` (globally normalised like the loss), ``clip_fraction``
    (share of valid tokens whose ratio was outside the clip range), ``ratio_mean``,
    ``entropy`` (of the current policy), ``token_mult_prob_error`` (mean of
    ``exp(|prev - gen|)``; 1.0 means trainer and generator agree), ``gen_kl_error`` (mean of
    ``kl_estimate(gen, prev, kl_estimator)``: KL(pi_generator || pi_trainer) estimated from the
    generator's samples; 0 means they agree), ``is_weight_mean`` (of w after truncation),
    ``is_oob_ratio`` (only with a truncation type: the share of valid tokens whose weight is
    outside the band -- of valid sequences for seq-mask-tis), ``num_valid_tokens``.
    All are means over this micro-batch's valid tokens (or sequences), which the trainer weights
    by ``num_valid_tokens`` across micro-batches.
    """

    pairwise: bool = False
    reads_token_mask_only: bool = True  # (the LossFunction protocol)

    def __init__(
        self,
        ratio_clip_min: float = 0.2,
        ratio_clip_max: float = 0.2,
        ratio_clip_c: float | None = None,
        reference_policy_kl_penalty: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_type: LossType = "token",
        use_importance_sampling_correction: bool = False,
        truncated_importance_sampling_ratio: float | None = None,
        truncated_importance_sampling_type: TruncatedISType | None = None,
        truncated_importance_sampling_ratio_min: float | None = None,
        sequence_level_importance_ratios: bool = False,
        temperature: float = 1.0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(
                f"temperature={temperature} must be > 0: the sampling temperature the "
                "trainer's logits are divided by (policy.generation.temperature)"
            )
        if ratio_clip_min < 0 or ratio_clip_max < 0:
            raise ValueError(
                f"ratio_clip_min={ratio_clip_min} and ratio_clip_max={ratio_clip_max} must be "
                f">= 0 (the clip range is [1 - ratio_clip_min, 1 + ratio_clip_max])."
            )
        if ratio_clip_c is not None and ratio_clip_c <= 1.0:
            raise ValueError(
                f"ratio_clip_c={ratio_clip_c} must be > 1 (dual-clip bound), or None to disable."
            )
        if loss_type not in ("token", "sequence"):
            raise ValueError(f"loss_type='{loss_type}' is unknown; use 'token' or 'sequence'.")
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator='{kl_estimator}' is unknown; use 'k1', 'k2' or 'k3'.")
        problems = off_policy_loss_problems(
            use_importance_sampling_correction=use_importance_sampling_correction,
            truncated_importance_sampling_type=truncated_importance_sampling_type,
            truncated_importance_sampling_ratio=truncated_importance_sampling_ratio,
            truncated_importance_sampling_ratio_min=truncated_importance_sampling_ratio_min,
            sequence_level_importance_ratios=sequence_level_importance_ratios,
            token_level_loss=loss_type == "token",
        )
        if problems:  # token_level_loss=true is loss_type='token' here
            raise ValueError("ClippedPGLoss: " + "; ".join(problems))
        self.ratio_clip_min = ratio_clip_min
        self.ratio_clip_max = ratio_clip_max
        self.ratio_clip_c = ratio_clip_c
        self.reference_policy_kl_penalty = reference_policy_kl_penalty
        self.kl_estimator: KLEstimator = kl_estimator
        self.loss_type: LossType = loss_type
        self.use_importance_sampling_correction = use_importance_sampling_correction
        self.truncated_importance_sampling_type = truncated_importance_sampling_type
        self.truncated_importance_sampling_ratio = truncated_importance_sampling_ratio
        self.truncated_importance_sampling_ratio_min = truncated_importance_sampling_ratio_min
        self.sequence_level_importance_ratios = sequence_level_importance_ratios
        self.temperature = temperature

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        curr = token_logprobs(logits, data["input_ids"], data.get("token_mask"))  # [B, S]
        mask = _valid_token_mask(data, curr)  # [B, S]
        prev = data["prev_logprobs"].to(curr.dtype) if "prev_logprobs" in data else curr.detach()
        gen = data["generation_logprobs"].to(curr.dtype)
        adv = data["advantages"].to(curr.dtype)
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1).expand_as(curr)

        ratio = self._ppo_ratio(curr, prev, mask)  # [B, S]
        clipped_ratio = ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        if self.ratio_clip_c is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * self.ratio_clip_c), pg)

        if self.reference_policy_kl_penalty != 0.0:
            ref = data["reference_policy_logprobs"].to(curr.dtype)
            kl = self.reference_policy_kl_penalty * kl_estimate(curr, ref, self.kl_estimator)
        else:
            kl = torch.zeros_like(curr)

        log_is = (prev - gen).detach()  # [B, S]: log(pi_trainer_old / pi_generator)
        weight, oob = self._importance_weights(log_is, mask)

        pg_term = self._reduce(weight * pg, mask, global_valid_toks, global_valid_seqs)
        kl_term = self._reduce(weight * kl, mask, global_valid_toks, global_valid_seqs)
        loss = pg_term + kl_term

        with torch.no_grad():
            outside = (ratio < 1.0 - self.ratio_clip_min) | (ratio > 1.0 + self.ratio_clip_max)
            metrics = {
                "loss": float(loss.item()),
                "kl_penalty": float(kl_term.item()),
                "clip_fraction": _masked_mean(outside.to(curr.dtype), mask),
                "ratio_mean": _masked_mean(ratio, mask),
                "entropy": _masked_mean(token_entropy(logits, mask).to(curr.dtype), mask),
                "token_mult_prob_error": _masked_mean(torch.exp(log_is.abs()), mask),
                "gen_kl_error": _masked_mean(kl_estimate(gen, prev, self.kl_estimator), mask),
                "is_weight_mean": _masked_mean(weight, mask),
                "num_valid_tokens": float(mask.sum().item()),
            }
            if oob is not None:
                metrics["is_oob_ratio"] = oob
        return loss, metrics

    def _ppo_ratio(self, curr: Tensor, prev: Tensor, mask: Tensor) -> Tensor:
        """pi_theta / pi_old per token, or (GSPO) each sequence's geometric mean on its tokens."""
        log_ratio = curr - prev  # [B, S]
        if self.sequence_level_importance_ratios:
            seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
            log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(curr)
        return torch.exp(log_ratio)

    def _importance_weights(self, log_is: Tensor, mask: Tensor) -> tuple[Tensor, float | None]:
        """(w ``[B, S]``, detached; the share outside the band, or None without a band)."""
        if not self.use_importance_sampling_correction:
            return torch.ones_like(log_is), None
        if self.sequence_level_importance_ratios:  # one weight per sequence: the product
            log_is = (log_is * mask).sum(-1, keepdim=True).expand_as(log_is)
        weight = torch.exp(log_is)
        kind = self.truncated_importance_sampling_type
        if kind is None:
            return weight, None
        hi = self.truncated_importance_sampling_ratio
        lo = self.truncated_importance_sampling_ratio_min
        lo = 0.0 if lo is None else lo  # only tis may leave it unset
        if kind == "seq-mask-tis":
            tokens = mask.sum(-1)  # [B]
            geo_mean = torch.exp((log_is * mask).sum(-1) / tokens.clamp(min=1))  # [B]
            out_seq = ((geo_mean < lo) | (geo_mean > hi)).to(weight.dtype)  # [B]
            weight = weight * (1.0 - out_seq).unsqueeze(-1)
            return weight, _masked_mean(out_seq, (tokens > 0).to(weight.dtype))
        out_tok = (weight < lo) | (weight > hi)  # [B, S]
        oob = _masked_mean(out_tok.to(weight.dtype), mask)
        if kind == "tis":
            return weight.clamp(min=lo, max=hi), oob
        return torch.where(out_tok, torch.zeros_like(weight), weight), oob  # icepop

    def _reduce(
        self, per_token: Tensor, mask: Tensor, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> Tensor:
        if self.loss_type == "token":
            return (per_token * mask).sum() / _as_tensor(global_valid_toks, per_token)
        tokens_per_seq = mask.sum(-1)  # [B]
        seq_mean = (per_token * mask).sum(-1) / tokens_per_seq.clamp(min=1)  # [B]
        seq_valid = (tokens_per_seq > 0).to(per_token.dtype)
        return (seq_mean * seq_valid).sum() / _as_tensor(global_valid_seqs, per_token)


# --------------------------------------------------------------------------------------------
# Preference losses
# --------------------------------------------------------------------------------------------


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
    ``reward_margin``, ``reference_logprob_accuracy`` (pairs whose chosen answer the
    reference finds more likely; means over this micro-batch's valid pairs), ``num_valid_pairs``.
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
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        logprobs = token_logprobs(logits, data["input_ids"], data["token_mask"])  # [B, S]
        token_mask = data["token_mask"].to(logprobs.dtype)
        pair_mask = _pair_mask(data["sample_mask"].to(logprobs.dtype))  # [B/2]

        seq_lp = self._sequence_logprob(logprobs, token_mask)  # [B]
        seq_ref = None
        if self.needs_reference:
            ref = data["reference_policy_logprobs"].to(logprobs.dtype)
            seq_ref = self._sequence_logprob(ref, token_mask)  # [B]
        rewards = self.beta * (seq_lp if seq_ref is None else seq_lp - seq_ref)  # [B]
        r_chosen, r_rejected = rewards[0::2], rewards[1::2]  # [B/2]
        margin = r_chosen - r_rejected

        denom = _as_tensor(global_valid_seqs, logprobs)
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
                "preference_accuracy": _masked_mean((margin > 0).to(margin.dtype), pair_mask),
                "rewards_chosen_mean": _masked_mean(r_chosen, pair_mask),
                "rewards_rejected_mean": _masked_mean(r_rejected, pair_mask),
                "reward_margin": _masked_mean(margin, pair_mask),
                "num_valid_pairs": float(pair_mask.sum().item()),
            }
            if loss_margin is not margin:
                metrics["log_odds_ratio"] = _masked_mean(loss_margin, pair_mask)
            if seq_ref is not None:  # pairs the frozen reference already ranks right
                metrics["reference_logprob_accuracy"] = _masked_mean(
                    (seq_ref[0::2] > seq_ref[1::2]).to(margin.dtype), pair_mask
                )
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
        self,
        scores: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        if scores.dim() == 2 and scores.shape[-1] == 1:
            scores = scores.squeeze(-1)
        if scores.dim() != 1:
            raise ValueError(
                f"BradleyTerryLoss expects scores of shape [B] (or [B, 1]); got {tuple(scores.shape)}."
            )
        scores = upcast(scores)
        pair_mask = _pair_mask(data["sample_mask"].to(scores.dtype))
        margin = scores[0::2] - scores[1::2]
        loss = (-F.logsigmoid(margin) * pair_mask).sum() / _as_tensor(global_valid_seqs, scores)
        with torch.no_grad():
            metrics = {
                "loss": float(loss.item()),
                "accuracy": _masked_mean((margin > 0).to(margin.dtype), pair_mask),
                "margin": _masked_mean(margin, pair_mask),
                "num_valid_pairs": float(pair_mask.sum().item()),
            }
        return loss, metrics


# --------------------------------------------------------------------------------------------
# On-policy distillation
# --------------------------------------------------------------------------------------------


def topk_logprobs(logits: Tensor | HiddenLogits, k: int) -> tuple[Tensor, Tensor]:
    """A teacher's ``k`` most likely next tokens at every position, in the contract layout:
    ``values[b, t]`` / ``indices[b, t]`` ``[B, S, k]`` are the top-k log-probs (normalised over
    the WHOLE vocabulary, so their mass says what top-k leaves out) of token ``t`` given
    ``input_ids[b, :t]``; position 0 is 0 (nothing predicts it). Only these travel."""
    if isinstance(logits, HiddenLogits):
        values, indices = (x[:, :-1] for x in topk_next_token(logits, k))
    else:
        logp = torch.log_softmax(upcast(logits[:, :-1]), dim=-1)
        values, indices = logp.topk(k, dim=-1)  # [B, S-1, k]
    return F.pad(values, (0, 0, 1, 0)), F.pad(indices, (0, 0, 1, 0))


class DistillationLoss:
    """KL between a teacher's top-k next-token distribution and the student's, per token of
    the student's own samples (NeMo RL's ``loss_fn.kl_type`` / ``mixed_kl_weight`` /
    ``zero_outside_topk``).

    Inputs in `data`: ``teacher_topk_logprobs`` and ``teacher_topk_indices`` ``[B, S, k]``
    (`topk_logprobs`' layout). Over the teacher's top-k set K at each position, with the
    teacher's log-probs ``t`` and the student's ``s`` (both full-vocabulary log-probs):

      zero_outside_topk=False: t and s are renormalised over K (two distributions on K);
      zero_outside_topk=True:  they are not -- the mass outside K counts as zero (a partial sum)
      forward = sum over K of exp(t) * (t - s)          KL(teacher || student)
      reverse = sum over K of exp(s) * (s - t)          KL(student || teacher)
      mixed   = mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse

    With k = the vocabulary size both settings give the exact KL. The loss sums the per-token
    KL over valid tokens (``token_mask * sample_mask``) and divides by ``global_valid_toks``.
    Metrics: ``loss``, ``kl_forward`` and ``kl_reverse`` (means over valid tokens, renormalised
    on K), ``teacher_topk_mass`` and ``student_topk_mass`` (share of each model's probability
    inside K), ``num_valid_tokens``.
    """

    loss_type: LossType = "token"
    pairwise: bool = False

    def __init__(
        self,
        kl_type: DistillationKL = "forward",
        mixed_kl_weight: float = 0.5,
        zero_outside_topk: bool = False,
    ) -> None:
        if kl_type not in ("forward", "reverse", "mixed"):
            raise ValueError(f"kl_type={kl_type!r} is unknown; use forward, reverse or mixed")
        if not 0.0 <= mixed_kl_weight <= 1.0:
            raise ValueError(f"mixed_kl_weight={mixed_kl_weight} must lie in [0, 1]")
        self.kl_type = kl_type
        self.mixed_kl_weight = mixed_kl_weight
        self.zero_outside_topk = zero_outside_topk

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_toks: Tensor,
        global_valid_seqs: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        logits = as_logits(logits)  # the student's full distribution at the teacher's top-k
        width = logits.shape[1]  # a micro-batch may be cut to its longest row
        indices = data["teacher_topk_indices"][:, 1:width].long()  # [B, S-1, k]
        teacher = data["teacher_topk_logprobs"][:, 1:width].float()
        student = torch.log_softmax(upcast(logits[:, :-1]), dim=-1).gather(-1, indices)
        t_norm = teacher - teacher.logsumexp(-1, keepdim=True)  # renormalised on K
        s_norm = student - student.logsumexp(-1, keepdim=True)
        t, s = (teacher, student) if self.zero_outside_topk else (t_norm, s_norm)
        forward = (t.exp() * (t - s)).sum(-1)  # [B, S-1]
        reverse = (s.exp() * (s - t)).sum(-1)
        w = {"forward": 1.0, "reverse": 0.0, "mixed": self.mixed_kl_weight}[self.kl_type]
        per_token = F.pad(w * forward + (1.0 - w) * reverse, (1, 0))  # [B, S], 0 at t=0
        mask = _valid_token_mask(data, per_token)[:, : per_token.shape[1]]
        loss = (per_token * mask).sum() / _as_tensor(global_valid_toks, per_token)
        with torch.no_grad():
            m = mask[:, 1:]
            metrics = {
                "loss": float(loss.item()),
                "kl_forward": _masked_mean((t_norm.exp() * (t_norm - s_norm)).sum(-1), m),
                "kl_reverse": _masked_mean((s_norm.exp() * (s_norm - t_norm)).sum(-1), m),
                "teacher_topk_mass": _masked_mean(teacher.exp().sum(-1), m),
                "student_topk_mass": _masked_mean(student.exp().sum(-1), m),
                "num_valid_tokens": float(m.sum().item()),
            }
        return loss, metrics
