"""Checkpoint I/O of one policy rank: sharded DCP state, and Hugging Face export.

A component of `FSDP2PolicyWorker`, reached as its ``checkpoint`` attribute: `Policy` calls
``"checkpoint.save"``, ``"checkpoint.load"`` and ``"checkpoint.export_hf"`` on its worker
group (the worker group's ``execute`` resolves dotted names).

- `save` / `load`: sharded model + optimizer state with ``torch.distributed.checkpoint``
  (DCP), which loads into any data-parallel size; the LR scheduler's state and each rank's
  torch RNG state beside it;
- `export_hf`: a folder that ``from_pretrained`` loads (`tempering.models.export`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tempering.models.policy.weight_streaming import full_state_dict
from tempering.utils import faults

logger = logging.getLogger(__name__)

SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_rank{rank}.pt"


class CheckpointIO:
    """Save, load and export ``model`` (with ``optimizer`` and ``scheduler`` when it trains).

    Args:
        model: the sharded policy.
        optimizer, scheduler: None for an inference-only policy.
        rank: this rank (rank 0 writes the scheduler and the HF folder).
        model_path: the source model (its tokenizer and generation config are exported).
        export_dtype: the dtype the HF weights are written in (the configured precision).
        head: "causal_lm" or "score" (the exported model class).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LambdaLR | None,
        *,
        rank: int,
        model_path: str,
        export_dtype: torch.dtype,
        head: str,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = rank
        self.model_path = model_path
        self.export_dtype = export_dtype
        self.head = head

    def save(self, path: str) -> None:
        """Sharded model + optimizer state (DCP) under `path`, scheduler state beside it."""
        faults.maybe_fault("policy", "checkpoint")
        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state: dict[str, Any] = {}
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        dcp.save(state, checkpoint_id=path)
        if self.rank == 0 and self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), Path(path) / SCHEDULER_FILE)
        # This rank's torch RNG (dropout and other training-side draws), for exact resume.
        torch.save({"torch": torch.get_rng_state()}, Path(path) / RNG_FILE.format(rank=self.rank))
        dist.barrier()

    def load(self, path: str) -> None:
        """Restore what `save(path)` wrote (same or another DP size)."""
        if not (Path(path) / ".metadata").exists():
            raise FileNotFoundError(
                f"load_checkpoint: {path} holds no DCP checkpoint (.metadata missing); pass the "
                "'policy' folder of a complete step_N checkpoint"
            )
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(self.model, state["model"])
        sched_file = Path(path) / SCHEDULER_FILE
        if self.scheduler is not None and sched_file.exists():
            self.scheduler.load_state_dict(torch.load(sched_file, weights_only=True))
        rng_file = Path(path) / RNG_FILE.format(rank=self.rank)
        if rng_file.exists():
            torch.set_rng_state(torch.load(rng_file, weights_only=True)["torch"])
        else:  # saved with another world size: this rank's stream starts afresh
            logger.warning("%s missing: rank %d keeps its own RNG state", rng_file, self.rank)
        dist.barrier()

    def export_hf(self, path: str) -> None:
        """Write an HF folder atomically (weights in `precision`, config, generation config,
        tokenizer with its chat template); see `tempering.models.export`. Collective."""
        sd = full_state_dict(self.model)
        if self.rank == 0:
            from tempering.models.export import save_hf_folder

            save_hf_folder(
                path, sd, self.model.config, self.model_path, self.export_dtype, head=self.head
            )
        dist.barrier()
