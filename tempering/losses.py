"""Loss functions for SFT, GRPO/PPO and on-policy distillation (DPO's and reward models':
`tempering.preference_losses`).

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

Metrics are plain floats for this micro-batch. Those named ``loss``, ``kl_penalty``,
``entropy_bonus`` and ``*_loss`` are already globally normalised (sum them over
micro-batches); the others are means over this
micro-batch's valid tokens / pairs, reported with ``num_valid_tokens`` / ``num_valid_pairs``
so a caller can weight them.

Log-prob layout (the contract): ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
for ``t >= 1`` and ``logprobs[b, 0] = 0``; `token_logprobs` computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from tempering.config.schemas import KL_CLAMPS, loss_fn_problems
from tempering.logits import (
    HiddenLogits,
    NextTokenLogprob,
    as_logits,
    default_chunk_rows,
    entropy_of_logits,
    needed_rows,
    next_token_entropy,
    next_token_logprobs,
    next_token_logprobs_and_entropy,
    topk_next_token,
    upcast,
)

LossType = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
DistillationKL = Literal["forward", "reverse", "mixed"]
TruncatedISType = Literal["tis", "icepop", "seq-mask-tis"]
LossBatch = Mapping[str, Any]  # a loss's `data`: a BatchedDataDict or any mapping
LossOutput = tuple[Tensor, dict[str, float]]  # (the loss, this micro-batch's metrics)

__all__ = [
    "ClippedPGLoss",
    "DistillationLoss",
    "KLEstimator",
    "LossBatch",
    "LossFunction",
    "LossOutput",
    "LossType",
    "NLLLoss",
    "TruncatedISType",
    "as_tensor_like",
    "kl_estimate",
    "masked_mean",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
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
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput: ...


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
    targets, rows = _next_targets(logits, input_ids, mask)
    if isinstance(logits, HiddenLogits):
        picked = next_token_logprobs(logits, targets, rows)
    else:  # [B, S]: picked[:, t] scores token t+1
        picked = NextTokenLogprob.apply(logits, targets)
        if rows is not None:
            picked = picked * rows
    return F.pad(picked[:, :-1], (1, 0), value=0.0)


def _next_targets(
    logits: Tensor | HiddenLogits, input_ids: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Row t's target, token t + 1 (the last row's a dummy), and the rows the mask reads."""
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs expects logits [B, S, V] and input_ids [B, S]; got logits "
            f"{tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}."
        )
    return F.pad(input_ids[:, 1:].long(), (0, 1), value=0), needed_rows(mask)


def token_logprobs_and_entropy(
    logits: Tensor | HiddenLogits, input_ids: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` and `token_entropy` at the same positions, the entropy differentiated
    too (a loss's entropy bonus); with `HiddenLogits`, in the log-probs' one projection pass."""
    targets, rows = _next_targets(logits, input_ids, mask)
    if isinstance(logits, HiddenLogits):
        picked, ent = next_token_logprobs_and_entropy(logits, targets, rows)
    else:
        picked = NextTokenLogprob.apply(logits, targets)
        flat = logits.reshape(-1, logits.shape[-1])
        ent = entropy_of_logits(flat, default_chunk_rows(flat.shape[-1])).view(picked.shape)
        if rows is not None:
            picked, ent = picked * rows, ent * rows
    return F.pad(picked[:, :-1], (1, 0), value=0.0), F.pad(ent[:, :-1], (1, 0), value=0.0)


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


def _valid_token_mask(data: LossBatch, like: Tensor) -> Tensor:
    """token_mask * sample_mask as ``[B, S]`` in the dtype of `like`."""
    for key in ("token_mask", "sample_mask"):
        if key not in data:
            raise KeyError(f"Loss input is missing '{key}'; keys present: {sorted(data)}.")
    token_mask = data["token_mask"].to(like.dtype)
    sample_mask = data["sample_mask"].to(like.dtype)
    return token_mask * sample_mask.unsqueeze(-1)


def as_tensor_like(x: Tensor | float, like: Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of `values` where mask is 1 (a float; 0.0 when nothing is valid)."""
    denom = mask.sum()
    if denom.item() == 0:
        return 0.0
    return float(((values * mask).sum() / denom).item())


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples drawn from pi.

    With ``log r = logprobs - ref_logprobs`` (r = pi / pi_ref at the sampled token), clamped to
    ``[-input_clamp, input_clamp]`` when given:

    - ``k1 = log r``
    - ``k2 = 0.5 * (log r) ** 2``
    - ``k3 = exp(-log r) - 1 + log r`` (Schulman 2020; unbiased and always >= 0)

    then clamped to ``[-output_clamp, output_clamp]`` when given (NeMo RL's ``calculate_kl``:
    a token the reference finds e^-30 times as likely costs a bounded penalty, not exp(30)).
    """
    log_r = logprobs - ref_logprobs
    if input_clamp is not None:
        log_r = log_r.clamp(-input_clamp, input_clamp)
    if estimator == "k1":
        kl = log_r
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    elif estimator == "k3":
        kl = torch.exp(-log_r) - 1.0 + log_r
    else:
        raise ValueError(f"kl estimator '{estimator}' is unknown; use one of 'k1', 'k2', 'k3'.")
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


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
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        logprobs = token_logprobs(logits, data["input_ids"], data.get("token_mask"))  # [B, S]
        mask = _valid_token_mask(data, logprobs)
        loss = -(logprobs * mask).sum() / as_tensor_like(global_valid_toks, logprobs)
        return loss, {"loss": float(loss.item()), "num_valid_tokens": float(mask.sum().item())}


# --------------------------------------------------------------------------------------------
# GRPO / PPO
# --------------------------------------------------------------------------------------------


class ValueLoss:
    """PPO's critic loss on a value head's ``[B, S]`` values (`head="value"`, each token's
    value read at the position before it).

    ``data`` needs ``token_mask``, ``sample_mask``, ``returns`` (the GAE targets) and, with
    ``value_clip``, ``prev_values`` (the values the advantages were computed from). Per token:
    ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2)`` (the clipped term only
    with ``value_clip``), summed over the valid tokens / ``global_valid_toks``.
    Metrics: ``loss``, ``value_clip_fraction`` (tokens moved past the clip where the clipped
    term was larger), ``num_valid_tokens``."""

    loss_type: LossType = "token"
    pairwise: bool = False

    def __init__(self, value_clip: float | None = 0.2) -> None:
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"value_clip={value_clip} must be > 0 (None: no clipping)")
        self.value_clip = value_clip

    def __call__(
        self, values: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        mask = _valid_token_mask(data, values)
        returns = data["returns"].to(values.device, values.dtype)[:, : values.shape[1]]
        loss_tokens = (values - returns) ** 2
        clipped_larger = torch.zeros_like(mask)
        if self.value_clip is not None:
            old = data["prev_values"].to(values.device, values.dtype)[:, : values.shape[1]]
            moved = values - old
            clipped = old + moved.clamp(-self.value_clip, self.value_clip)
            clipped_loss = (clipped - returns) ** 2
            # Only where the clip bit: inside it ``old + (v - old)`` is ``v`` up to rounding,
            # which would count (and pick) a last-bit difference as a clipped token.
            larger = (moved.abs() > self.value_clip) & (clipped_loss > loss_tokens)
            clipped_larger = larger.to(values.dtype)
            loss_tokens = torch.where(larger, clipped_loss, loss_tokens)
        loss = 0.5 * (loss_tokens * mask).sum() / as_tensor_like(global_valid_toks, values)
        return loss, {
            "loss": float(loss.item()),
            "value_clip_fraction": masked_mean(clipped_larger, mask),
            "num_valid_tokens": float(mask.sum().item()),
        }


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
      kl = reference_policy_kl_penalty * v * kl_estimate(curr, ref, kl_estimator)
           (the estimator's input and output clamped, ``kl_input_clamp_value`` 20 and
           ``kl_output_clamp_value`` 10 by default as NeMo RL's; None: no clamp)
      loss = reduce(w * pg) + reduce(kl) - entropy_coeff * reduce(entropy)   (verl's bonus)

    ``v`` is 1, or with ``use_on_policy_kl_approximation`` the detached ``exp(curr - gen)``
    (non-finite values 0): the samples come from the generator, and v makes the penalty an
    estimate of KL(pi_theta || pi_ref) under pi_theta. The importance weight ``w`` below weighs
    the policy-gradient term only, as NeMo RL's does.

    ``entropy_coeff`` > 0 rewards the current policy's entropy at the valid tokens (not
    importance-weighted), reduced like the rest, and differentiated (`token_logprobs_and_
    entropy`: the same projection pass as the log-probs).

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
    lo > hi, seq-mask-tis with GSPO, GSPO or ``length_normalizer`` with ``loss_type="token"``;
    and (`kl_penalty_problems`) the KL options without a penalty, a clamp <= 0.

    Normalisation: ``loss_type="token"`` sums per_token over valid tokens and divides by
    ``global_valid_toks``; ``loss_type="sequence"`` averages each sequence's valid tokens,
    sums over valid sequences and divides by ``global_valid_seqs``. ``length_normalizer`` L
    (Dr. GRPO; sequence-level only) divides each sequence's token sum by L instead of by its
    length: ``sum over valid tokens / (global_valid_seqs * L)``, so a token's gradient does
    not grow as its answer shortens.

    Metrics: ``loss``, ``kl_penalty`` and (with a bonus) ``entropy_bonus``, its
    ``entropy_coeff * reduce(entropy)`` (both globally normalised like the loss), ``clip_fraction``
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
        entropy_coeff: float = 0.0,
        length_normalizer: int | None = None,
        use_on_policy_kl_approximation: bool = False,
        kl_input_clamp_value: float | None = KL_CLAMPS[0],
        kl_output_clamp_value: float | None = KL_CLAMPS[1],
    ) -> None:
        if entropy_coeff < 0:
            raise ValueError(
                f"entropy_coeff={entropy_coeff} must be >= 0 (a bonus on the policy's entropy; "
                "0 turns it off)"
            )
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
        # its arguments by the config's names: the config's rules, checked again here
        problems = loss_fn_problems({**locals(), "token_level_loss": loss_type == "token"})
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
        self.entropy_coeff = entropy_coeff
        self.length_normalizer = length_normalizer
        self.use_on_policy_kl_approximation = use_on_policy_kl_approximation
        self.kl_clamps = (kl_input_clamp_value, kl_output_clamp_value)

    def __call__(
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
        entropy = None
        if self.entropy_coeff > 0:
            curr, entropy = token_logprobs_and_entropy(
                logits, data["input_ids"], data.get("token_mask")
            )
        else:
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

        kl = self._kl_penalty(curr, gen, data)

        log_is = (prev - gen).detach()  # [B, S]: log(pi_trainer_old / pi_generator)
        weight, oob = self._importance_weights(log_is, mask)

        pg_term = self._reduce(weight * pg, mask, global_valid_toks, global_valid_seqs)
        kl_term = self._reduce(kl, mask, global_valid_toks, global_valid_seqs)
        loss = pg_term + kl_term
        if entropy is not None:
            bonus = self.entropy_coeff * self._reduce(
                entropy, mask, global_valid_toks, global_valid_seqs
            )
            loss = loss - bonus

        with torch.no_grad():
            outside = (ratio < 1.0 - self.ratio_clip_min) | (ratio > 1.0 + self.ratio_clip_max)
            metrics = {
                "loss": float(loss.item()),
                "kl_penalty": float(kl_term.item()),
                "clip_fraction": masked_mean(outside.to(curr.dtype), mask),
                "ratio_mean": masked_mean(ratio, mask),
                "entropy": masked_mean(
                    (token_entropy(logits, mask) if entropy is None else entropy).to(curr.dtype),
                    mask,
                ),
                "token_mult_prob_error": masked_mean(torch.exp(log_is.abs()), mask),
                "gen_kl_error": masked_mean(kl_estimate(gen, prev, self.kl_estimator), mask),
                "is_weight_mean": masked_mean(weight, mask),
                "num_valid_tokens": float(mask.sum().item()),
            }
            if oob is not None:
                metrics["is_oob_ratio"] = oob
            if entropy is not None:
                metrics["entropy_bonus"] = float(bonus.item())
        return loss, metrics

    def _kl_penalty(self, curr: Tensor, gen: Tensor, data: LossBatch) -> Tensor:
        """Each token's ``beta * v * kl`` (class docstring), ``[B, S]``; zeros without a penalty."""
        if self.reference_policy_kl_penalty == 0.0:
            return torch.zeros_like(curr)
        ref = data["reference_policy_logprobs"].to(curr.dtype)
        kl = kl_estimate(curr, ref, self.kl_estimator, *self.kl_clamps)
        if self.use_on_policy_kl_approximation:
            v = torch.exp(curr - gen).detach()
            kl = kl * torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        return self.reference_policy_kl_penalty * kl

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
            return weight, masked_mean(out_seq, (tokens > 0).to(weight.dtype))
        out_tok = (weight < lo) | (weight > hi)  # [B, S]
        oob = masked_mean(out_tok.to(weight.dtype), mask)
        if kind == "tis":
            return weight.clamp(min=lo, max=hi), oob
        return torch.where(out_tok, torch.zeros_like(weight), weight), oob  # icepop

    def _reduce(
        self, per_token: Tensor, mask: Tensor, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> Tensor:
        if self.loss_type == "token":
            return (per_token * mask).sum() / as_tensor_like(global_valid_toks, per_token)
        tokens_per_seq = mask.sum(-1)  # [B]
        length = (
            tokens_per_seq.clamp(min=1)
            if self.length_normalizer is None
            else self.length_normalizer
        )
        seq_term = (per_token * mask).sum(-1) / length  # [B]: the mean, or Dr. GRPO's sum / L
        seq_valid = (tokens_per_seq > 0).to(per_token.dtype)
        return (seq_term * seq_valid).sum() / as_tensor_like(global_valid_seqs, per_token)


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
        # the forward KL's share of the loss, the reverse's the rest
        self.forward_weight = {"forward": 1.0, "reverse": 0.0, "mixed": mixed_kl_weight}[kl_type]
        self.zero_outside_topk = zero_outside_topk

    def __call__(
        self, logits: Tensor, data: LossBatch, global_valid_toks: Tensor, global_valid_seqs: Tensor
    ) -> LossOutput:
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
        w = self.forward_weight
        per_token = F.pad(w * forward + (1.0 - w) * reverse, (1, 0))  # [B, S], 0 at t=0
        mask = _valid_token_mask(data, per_token)[:, : per_token.shape[1]]
        loss = (per_token * mask).sum() / as_tensor_like(global_valid_toks, per_token)
        with torch.no_grad():
            m = mask[:, 1:]
            metrics = {
                "loss": float(loss.item()),
                "kl_forward": masked_mean((t_norm.exp() * (t_norm - s_norm)).sum(-1), m),
                "kl_reverse": masked_mean((s_norm.exp() * (s_norm - t_norm)).sum(-1), m),
                "teacher_topk_mass": masked_mean(teacher.exp().sum(-1), m),
                "student_topk_mass": masked_mean(student.exp().sum(-1), m),
                "num_valid_tokens": float(m.sum().item()),
            }
        return loss, metrics
