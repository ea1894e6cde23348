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

from tempering.models.policy.model_setup import PolicyState
from tempering.models.policy.weight_streaming import full_state_dict
from tempering.utils import faults

logger = logging.getLogger(__name__)

SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_rank{rank}.pt"


class CheckpointIO:
    """Save, load and export the policy (with its optimizer and scheduler when it trains).
    Rank 0 writes the scheduler state and the HF folder; ``export_dtype`` is the dtype the HF
    weights are written in (the configured precision)."""

    def __init__(self, state: PolicyState, export_dtype: torch.dtype) -> None:
        self.state = state
        self.export_dtype = export_dtype

    def save(self, path: str) -> None:
        """Sharded model + optimizer state (DCP) under `path`, scheduler state beside it."""
        faults.maybe_fault("policy", "checkpoint")
        model, optimizer, scheduler = self.state.model, self.state.optimizer, self.state.scheduler
        rank = self.state.topo.rank
        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state: dict[str, Any] = {}
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        dcp.save(state, checkpoint_id=path)
        if rank == 0 and scheduler is not None:
            torch.save(scheduler.state_dict(), Path(path) / SCHEDULER_FILE)
        # This rank's torch RNG (dropout and other training-side draws), for exact resume.
        torch.save({"torch": torch.get_rng_state()}, Path(path) / RNG_FILE.format(rank=rank))
        dist.barrier()

    def load(self, path: str) -> None:
        """Restore what `save(path)` wrote (same or another DP size)."""
        if not (Path(path) / ".metadata").exists():
            raise FileNotFoundError(
                f"load_checkpoint: {path} holds no DCP checkpoint (.metadata missing); pass the "
                "'policy' folder of a complete step_N checkpoint"
            )
        model, optimizer, scheduler = self.state.model, self.state.optimizer, self.state.scheduler
        rank = self.state.topo.rank
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
        sched_file = Path(path) / SCHEDULER_FILE
        if scheduler is not None and sched_file.exists():
            scheduler.load_state_dict(torch.load(sched_file, weights_only=True))
        rng_file = Path(path) / RNG_FILE.format(rank=rank)
        if rng_file.exists():
            torch.set_rng_state(torch.load(rng_file, weights_only=True)["torch"])
        else:  # saved with another world size: this rank's stream starts afresh
            logger.warning("%s missing: rank %d keeps its own RNG state", rng_file, rank)
        dist.barrier()

    def export_hf(self, path: str) -> None:
        """Write an HF folder atomically (weights in `precision`, config, generation config,
        tokenizer with its chat template); see `tempering.models.export`. Collective."""
        sd = full_state_dict(self.state.model)
        if self.state.topo.rank == 0:
            from tempering.models.export import save_hf_folder

            source = self.state.source
            save_hf_folder(
                path, sd, self.state.model.config, source.model_path, self.export_dtype,
                head=source.head,
            )  # fmt: skip
        dist.barrier()
