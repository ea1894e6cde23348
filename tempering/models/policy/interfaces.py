"""What the algorithms may ask of a policy: the `PolicyInterface` ABC and optional extras.

The controller holds a policy and never touches its model: it sends token batches
(`BatchedDataDict`, layout in docs/CONTRACTS.md) and gets back metrics or per-token log-probs.
`tempering.models.policy.lm_policy.Policy` implements it over a Ray worker group of FSDP2
workers. The base holds what every algorithm needs (train, log-probs, checkpoints);
capabilities that not every policy has live in extra protocols, so the base stays small:
`ColocatablePolicy` (frees accelerator memory for a generation engine on its devices),
`RefittablePolicy` (hands its weights to generation engines, whole or in buckets) and
`HFExportablePolicy` (writes a Hugging Face folder).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.losses import LossFunction


class PolicyInterface(ABC):
    """A trainable language-model policy."""

    @abstractmethod
    def train(
        self, data: BatchedDataDict, loss_fn: LossFunction, *, eval_mode: bool = False
    ) -> dict[str, float]:
        """One optimizer step per global batch in `data`; returns global (all-reduced) metrics:
        ``loss, grad_norm, lr, num_tokens, num_valid_tokens, tokens_per_s`` + the loss's metrics.
        With ``eval_mode=True`` only the loss is computed (no gradients, no step)."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` aligned to the scored token, 0 at position 0 and on padding."""

    @abstractmethod
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """Like `get_logprobs` but from the frozen reference model: ``{"reference_policy_logprobs"}``."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer and scheduler state (sharded) under folder `path`."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint(path)` wrote."""


@runtime_checkable
class ColocatablePolicy(Protocol):
    """A policy that can share its accelerators with a generation engine (colocated vLLM)."""

    def prepare_for_generation(self) -> None:
        """Free accelerator memory for a colocated generator (optimizer state off the GPU)."""
        ...

    def prepare_for_training(self) -> None:
        """Undo `prepare_for_generation`."""
        ...


@runtime_checkable
class WeightSource(Protocol):
    """The weights of a policy as generation engines take them (`RefittablePolicy.refit`)."""

    def state_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """Full (gathered, unsharded) parameters by HF name, as CPU tensors."""
        ...

    def buckets(self, bucket_bytes: int) -> list[list[str]]:
        """State-dict names in layer-aligned buckets of at most ``bucket_bytes`` (fp32)."""
        ...

    def bucket(self, names: list[str], dtype: str | None) -> tuple[Any, int]:
        """``(object ref, bytes)``: one bucket's full tensors in ``dtype``, in Ray's store."""
        ...


@runtime_checkable
class RefittablePolicy(Protocol):
    """A policy whose weights can be handed to a generation engine (refit)."""

    refit: WeightSource


@runtime_checkable
class HFExportablePolicy(Protocol):
    """A policy that can write a Hugging Face folder that `from_pretrained` loads."""

    def export_hf(self, path: str) -> None: ...
