"""Generation inside the policy rank: a torch engine over an unsharded copy of its weights.

A component of `FSDP2PolicyWorker`, reached as its ``generation`` attribute: the controller's
`tempering.models.generation.builders.ColocatedGeneration` calls ``"generation.generate"``,
``"generation.refit"`` and ``"generation.reseed"`` on the policy's worker group (the worker
group's ``execute`` resolves dotted names), after `Policy.init_colocated_generation` built the
engines (``"generation.init"``). Each rank generates for its own DP shard of the prompts;
`refit` copies the trained weights into the copy in place, so no tensor leaves this process.
"""

from __future__ import annotations

from typing import Any

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.policy.model_setup import PolicyState, full_tensor, require_head
from tempering.utils import faults


class ColocatedGenerationView:
    """This rank's colocated torch generation engine over the policy's weights: a copy read
    from the policy's source (only a "causal_lm" head generates), on this rank's device, its
    sampling seeds offset by rank."""

    def __init__(self, state: PolicyState) -> None:
        self.state = state
        self._engine: Any = None

    def init(self, sampling: dict[str, Any], dtype: str = "float32") -> None:
        """Build a torch generation engine on an unsharded copy of this policy's weights, held
        and computed in ``dtype`` (refits cast the trained weights into it)."""
        from tempering.models.generation.cpu_inference import optimize_for_cpu_inference
        from tempering.models.generation.interfaces import SamplingConfig
        from tempering.models.generation.torch_engine import TorchGenerationEngine
        from tempering.models.hf import load_causal_lm

        source, topo = self.state.source, self.state.topo
        require_head(source.head, "causal_lm", "init_colocated_generation")
        args = dict(sampling)
        if args.get("seed") is None:  # distinct, reproducible streams per rank
            args["seed"] = int(torch.initial_seed()) + 1000 * topo.rank
        model = load_causal_lm(source.model_path, getattr(torch, dtype)).to(topo.device).eval()
        optimize_for_cpu_inference(model)  # this copy only generates
        tokenizer = source.tokenizer()
        self._engine = TorchGenerationEngine(model, tokenizer, SamplingConfig(**args))
        self.refit()

    def reseed(self, seed: int) -> None:
        """Restart the colocated engine's sampling stream from the controller's step seed."""
        if self._engine is None:
            raise RuntimeError(
                "generation.reseed: call generation.init first (Policy.init_colocated_generation)"
            )
        self._engine.reseed(seed + 1000 * self.state.topo.rank)

    def refit(self) -> None:
        """Copy the current (sharded) policy weights into the generation copy. Collective:
        every rank gathers each full tensor in state-dict order (`full_tensor`: an all-gather
        for a sharded DTensor, the tensor itself on an unsharded rank -- one fp32 rank keeps the
        plain module, where `get_model_state_dict`'s walk cost 2.3 of a tiny refit's ms)."""
        faults.maybe_fault("generation", "refit")
        state = self.state.model.state_dict()
        full = {name: full_tensor(t) for name, t in state.items()}
        self._engine.update_weights(self.state.hf_weights(full))

    def generate(
        self, data: BatchedDataDict, greedy: bool = False, sampling: Any = None
    ) -> BatchedDataDict:
        """Generate for this rank's prompts with the colocated engine (contract layout);
        `sampling` (a SamplingConfig) overrides the engine's settings for this call."""
        faults.maybe_fault("generation", "generation")
        if self._engine is None:
            raise RuntimeError(
                "FSDP2PolicyWorker generation.generate: call generation.init first "
                "(policy.generation.colocated.enabled=true builds it)"
            )
        device = self.state.topo.device
        return self._engine.generate(data.to(device), greedy, sampling).to("cpu")
