"""The optimizer step of one policy rank, and how its metrics add up.

`FSDP2PolicyWorker.train` runs the micro-batches' forward/backward; this module is what
follows, once per global batch, and what it reports:

- `OptimizerStep`: clip the global gradient norm (over FSDP2's and tensor parallelism's two
  meshes), then step AdamW and the LR schedule -- unless the global loss or gradient norm is
  NaN/Inf, in which case the step is skipped and counted, and too many in a row raise
  `NonFiniteTrainingError` (the numerics guard);
- `local_batch_size` and `check_pairwise_batching`: what a train call's sizes must satisfy;
- `aggregate_loss_metrics` folds the loss function's per-micro-batch metrics from every rank
  into one dict; `combine_steps` folds the global batches of one call into one.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from tempering.losses import LossFunction
from tempering.models.policy.model_setup import PolicyState, full_tensor, local_tensor

logger = logging.getLogger(__name__)

# Loss metrics that are already divided by the global count: summed over micro-batches/ranks.
_GLOBALLY_NORMALISED = ("loss", "kl_penalty", "entropy_bonus")


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


class OptimizerStep:
    """Clip, step (or skip a non-finite step), zero the gradients of the policy in ``state``
    (which has an optimizer and scheduler). Collective.

    Args:
        max_grad_norm: clip the global gradient norm to this; None = no clipping.
        max_consecutive_nonfinite: this many skipped steps in a row raise.
    """

    def __init__(
        self, state: PolicyState, max_grad_norm: float | None, max_consecutive_nonfinite: int
    ) -> None:
        self.state = state
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self._nonfinite_streak = 0

    def __call__(self, global_loss: float) -> dict[str, float]:
        """``grad_norm`` (before clipping), ``lr`` and ``num_nonfinite_skipped`` of this step."""
        optimizer, scheduler = self.state.optimizer, self.state.scheduler
        assert optimizer is not None and scheduler is not None
        result: dict[str, float] = {}
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        result["grad_norm"] = self._clip_grad_norm(max_norm)
        result["lr"] = float(optimizer.param_groups[0]["lr"])
        # Numerics guard: the same decision on every rank (global loss, global norm).
        finite = math.isfinite(global_loss) and math.isfinite(result["grad_norm"])
        result["num_nonfinite_skipped"] = 0.0 if finite else 1.0
        if finite:
            optimizer.step()
            scheduler.step()
            self._nonfinite_streak = 0
        else:
            self._skip_nonfinite_step(global_loss, result["grad_norm"])
        optimizer.zero_grad(set_to_none=True)
        return result

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        With TP the parameters live on two meshes (TP-split layers on ``dp x tp``, the rest on
        ``dp``), which torch's clip_grad_norm_ cannot combine: each rank adds the squares of
        its local shards, divided by how many ranks hold the same shard, and one all-reduce
        over every rank sums them."""
        params = [p for p in self.state.model.parameters() if p.grad is not None]
        if self.state.topo.tp_mesh is None:
            return float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            g = p.grad
            copies = self.state.topo.world_size / g.device_mesh.size()  # ranks outside its mesh
            for dim, placement in enumerate(g.placements):
                copies *= g.device_mesh.size(dim) if placement.is_replicate() else 1
            total += local_tensor(g).double().pow(2).sum().cpu() / copies
        dist.all_reduce(total)
        norm = float(total.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _skip_nonfinite_step(self, loss: float, grad_norm: float) -> None:
        """Leave weights, optimizer state and schedule as they were; count the step; raise
        NonFiniteTrainingError after ``max_consecutive_nonfinite`` in a row. Collective."""
        self._nonfinite_streak += 1
        bad = [
            name
            for name, p in self.state.model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())
        ]
        gathered = self.state.topo.all_gather_object(bad[:5])
        names = sorted({n for rank_names in gathered for n in rank_names})
        what = (
            f"loss={loss}, grad_norm={grad_norm}; non-finite gradients in {names or 'none'}"
            f"{' (first 5 per rank)' if len(names) >= 5 else ''}"
        )
        logger.warning(
            "non-finite training step skipped (%d in a row, limit %d): %s",
            self._nonfinite_streak, self.max_consecutive_nonfinite, what,
        )  # fmt: skip
        if self._nonfinite_streak >= self.max_consecutive_nonfinite:
            raise NonFiniteTrainingError(
                f"{self._nonfinite_streak} consecutive optimizer steps were non-finite and "
                f"skipped (policy.max_consecutive_nonfinite_steps="
                f"{self.max_consecutive_nonfinite}); the last had {what}. Lower the learning "
                "rate, clip gradients (policy.max_grad_norm), or check the data and rewards "
                "for inf/NaN; the last checkpoint holds the weights before this."
            )


def local_batch_size(shard_size: int, global_batch_size: int | None, dp_size: int) -> int:
    """The rows of one global batch on this rank (None: the whole shard is one batch)."""
    if global_batch_size is None:
        if shard_size == 0:
            raise ValueError("FSDP2PolicyWorker.train got an empty batch")
        return shard_size
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the data-parallel "
            f"size {dp_size}; pick a multiple of {dp_size}"
        )
    local = global_batch_size // dp_size
    if shard_size == 0 or shard_size % local:
        raise ValueError(
            f"this rank got {shard_size} samples, not a positive multiple of "
            f"global_batch_size/dp_size={local}; the data size must be a multiple of "
            f"global_batch_size={global_batch_size}"
        )
    return local


def check_pairwise_batching(
    loss_fn: LossFunction, micro_batch_size: int | None, max_tokens: int | None
) -> None:
    """A pairwise loss (chosen/rejected rows interleaved) needs its pairs kept together."""
    if loss_fn.pairwise and micro_batch_size is not None and micro_batch_size % 2:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must be even for {type(loss_fn).__name__}: "
            "its batches interleave chosen/rejected pairs"
        )
    if loss_fn.pairwise and max_tokens is not None:
        raise ValueError(
            f"{type(loss_fn).__name__} needs chosen/rejected pairs kept together; dynamic "
            "or packed micro-batches (max_tokens_per_microbatch) reorder rows: use "
            "micro_batch_size"
        )


def aggregate_loss_metrics(all_mbs: list[dict[str, float]]) -> dict[str, float]:
    """Loss metrics over micro-batches (of every rank), following tempering.losses'
    conventions: ``loss``/``kl_penalty``/``entropy_bonus``/``*_loss`` are globally normalised
    (summed), ``num_*`` are counts and ``*_sum`` sums (summed), the rest are per-micro-batch
    means (weighted by num_valid_tokens/pairs)."""
    keys = sorted({k for m in all_mbs for k in m})
    out: dict[str, float] = {}
    for key in keys:
        rows = [m for m in all_mbs if key in m]
        if key in _GLOBALLY_NORMALISED or key.endswith(("_loss", "_sum")) or key.startswith("num_"):
            out[key] = float(sum(m[key] for m in rows))
            continue
        weights = [float(m.get("num_valid_tokens", m.get("num_valid_pairs", 1.0))) for m in rows]
        total = sum(weights)
        if total > 0:
            out[key] = sum(w * m[key] for w, m in zip(weights, rows, strict=True)) / total
        else:
            out[key] = sum(m[key] for m in rows) / len(rows)
    return out


def combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One dict for a call that ran several global batches: means of per-step values, except
    counts and sums (``num_*``, ``*_sum``, step_time_s: summed), tokens_per_s (total tokens /
    total time) and lr (the last step's)."""
    if len(steps) == 1:
        return {**steps[0], "num_steps": 1.0}
    out: dict[str, float] = {}
    for key in steps[0]:
        values = [s[key] for s in steps if key in s]
        if key == "step_time_s" or key.startswith("num_") or key.endswith("_sum"):
            out[key] = float(sum(values))
        elif key == "lr":
            out[key] = values[-1]
        else:
            out[key] = float(sum(values) / len(values))
    out["tokens_per_s"] = out["num_tokens"] / max(out["step_time_s"], 1e-9)
    out["num_steps"] = float(len(steps))
    return out
