"""A generation worker (Ray actor body) running the torch-native engine on its own model copy.

Used in split mode (`policy.generation.colocated.enabled=false`, backend torch): generation
lives in its own worker group and receives new weights by refit (a Ray object ref to the
policy's full state dict, fetched by each worker straight from the object store).

With in-flight weight updates (async GRPO) the actor runs two calls at a time (Ray's
``max_concurrency=2``): a refit's ``stage_weights`` / ``commit_weights`` arrive while
``generate`` runs, and the engine loads the committed weights between two decode steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from tempering.models.generation.cpu_inference import optimize_for_cpu_inference
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.utils import faults


class TorchGenerationWorker:
    def __init__(
        self,
        model_path: str,
        sampling: dict[str, Any],
        num_threads: int | None = None,
        in_flight: bool = False,
        dtype: str = "float32",
        tokenizer_path: str | None = None,
    ) -> None:
        """``tokenizer_path``: the run's tokenizer (its EOS, pad and decoding), default the
        model's."""
        from tempering.models.hf import load_causal_lm, load_tokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = load_causal_lm(model_path, getattr(torch, dtype)).eval()  # refits cast
        optimize_for_cpu_inference(self.model)  # this copy only generates
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.sampling = SamplingConfig(**sampling)
        self.engine = TorchGenerationEngine(self.model, self.tokenizer, self.sampling)
        self.engine.in_flight = in_flight  # outputs carry each token's weight version

    def generate(
        self, data: Mapping[str, Any], greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> Any:
        faults.maybe_fault("generation", "generation")
        return self.engine.generate(data, greedy, sampling)

    def reseed(self, seed: int) -> None:
        """A distinct, reproducible stream per rank from the controller's step seed."""
        self.engine.reseed(seed + 1000 * int(os.environ.get("RANK", "0")))

    def update_weights(self, weights: Mapping[str, Any]) -> None:
        faults.maybe_fault("generation", "refit")
        self.engine.update_weights(weights)

    def stage_weights(self, weights: Mapping[str, Any]) -> None:
        faults.maybe_fault("generation", "refit")
        self.engine.stage_weights(weights)

    def commit_weights(self, version: int) -> None:
        self.engine.commit_weights(version)

    def is_generating(self) -> bool:
        return self.engine.is_generating()

    def prepare_for_generation(self) -> None:
        self.engine.prepare_for_generation()

    def finish_generation(self) -> None:
        self.engine.finish_generation()
