"""Checkpoint I/O of one policy rank: sharded DCP state, and Hugging Face export.

A component of `FSDP2PolicyWorker`, reached as its ``checkpoint`` attribute: `Policy` calls
``"checkpoint.save"``, ``"checkpoint.load"`` and ``"checkpoint.export_hf"`` on its worker
group (the worker group's ``execute`` resolves dotted names).

- `save` / `load`: sharded model + optimizer state with ``torch.distributed.checkpoint``
  (DCP), which loads into any data-parallel size; the LR scheduler's state and each rank's
  torch RNG state beside it;
- `export_hf`: a folder that ``from_pretrained`` loads (`tempering.models.export`); with
  LoRA the adapters merged in, and `export_adapter` writes them alone in PEFT's format.

With LoRA a checkpoint holds what trains: the adapters (and a reward model's score head) and
their optimizer state. The frozen base is read from the model source again on resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
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

    def _options(self) -> StateDictOptions:
        """LoRA: the trainable tensors only (the frozen base is not the run's state). Not
        strict then, as the frozen ones are absent; `dcp.load` still fails on any
        trainable tensor the checkpoint lacks."""
        lora = self.state.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _state(self) -> dict[str, Any]:
        """This rank's state to save or load into: ``model`` (and ``optim`` when it trains)."""
        model, optimizer = self.state.model, self.state.optimizer
        if optimizer is None:
            state = {"model": get_model_state_dict(model, options=self._options())}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
            state = {"model": model_sd, "optim": optim_sd}
        if self.state.lora is not None:
            # torch's ignore_frozen_params keeps a tied frozen weight under its second name
            # (lm_head.weight: SmolLM2's 113 MB embedding); keep the trainable names only.
            trained = {n for n, p in model.named_parameters(remove_duplicate=False)
                       if p.requires_grad}  # fmt: skip
            state["model"] = {k: v for k, v in state["model"].items() if k in trained}
        return state

    def save(self, path: str) -> None:
        """Sharded model + optimizer state (DCP) under `path`, scheduler state beside it."""
        faults.maybe_fault("policy", "checkpoint")
        scheduler = self.state.scheduler
        rank = self.state.topo.rank
        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=path)
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
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        if optimizer is not None:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"],
                optim_state_dict=state["optim"], options=self._options(),
            )  # fmt: skip
        else:
            set_model_state_dict(model, state["model"], options=self._options())
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
                path, self.state.hf_weights(sd), self.state.model.config,
                source.tokenizer_path or source.model_path, self.export_dtype, head=source.head,
                chat_template=source.chat_template, model_source=source.model_path,
            )  # fmt: skip
        dist.barrier()

    def export_adapter(self, path: str) -> None:
        """The LoRA adapters alone, in PEFT's format (atomic). Collective."""
        from tempering.models.policy.lora import adapter_state, save_peft_adapter

        lora = self.state.lora
        if lora is None:
            raise RuntimeError("export_adapter: this policy trains without LoRA adapters")
        sd = full_state_dict(self.state.model)
        if self.state.topo.rank == 0:
            config = lora.peft_config(self.state.source.model_path)
            save_peft_adapter(path, adapter_state(sd), config)
        dist.barrier()
