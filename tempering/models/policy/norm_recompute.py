"""Decoder layers whose norm outputs are recomputed in backward instead of saved.

A decoder layer's norms feed linear layers (q/k/v; gate/up), which save the norm's output
for their backward (a trained weight's gradient, or a LoRA adapter's A), while the norm itself
keeps its input. Both are ``[tokens, hidden]``. `recompute_norm_outputs` makes the layer's
consumers save a recipe instead -- the norm and its input, which stays saved anyway -- and
backward recomputes the output once when the first consumer needs it (Megatron's "layernorm"
recompute): SmolLM2-135M, a 4 x 384-token micro-batch, 7 MiB less per layer, 210 MiB of its
saved activations. The same operations on the same input, so gradients are unchanged
(tests/unit/test_norm_recompute.py). A forward whose norm outputs come to less than
``min_bytes`` a layer (`model_setup.LEAN_MIN_BYTES`: a tiny model's) keeps them: the hooks' and
the recompute's per-call costs would outweigh the few MiB.

How: each decoder layer's forward runs inside `torch.autograd.graph.saved_tensors_hooks`;
forward hooks on its norms record their outputs (held until the layer's forward returns,
so no other tensor can take their memory meanwhile), and the pack hook swaps a saved tensor
that shares a norm output's storage for a recipe with its view geometry. With activation
checkpointing the layer is recomputed whole already, so this is not installed.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

NORM_CLASS_SUFFIXES = ("RMSNorm", "LayerNorm")  # the norms whose outputs are recorded


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        return None


@dataclass(eq=False)
class _NormOutput:
    """One norm call of one forward: recomputed at most once, kept while consumers unpack."""

    norm: torch.nn.Module
    inputs: tuple
    output: torch.Tensor | None  # held during the layer's forward only
    pending: int = 0  # consumers that saved it and have not unpacked yet
    recomputed: torch.Tensor | None = None
    versions: tuple = ()  # the inputs' version counters when recorded

    def __post_init__(self) -> None:
        self.versions = tuple(getattr(x, "_version", None) for x in self.inputs)

    def value(self) -> torch.Tensor:
        if self.recomputed is None:
            now = tuple(getattr(x, "_version", None) for x in self.inputs)
            if now != self.versions:  # autograd's own check, for an input it did not save
                raise RuntimeError(
                    f"{type(self.norm).__name__}'s input was modified in place after its "
                    "forward, so its output cannot be recomputed in backward "
                    "(tempering/models/policy/norm_recompute.py); set "
                    "policy.dtensor_cfg.activation_checkpointing=true, which does not use it"
                )
            with torch.no_grad():
                self.recomputed = self.norm(*self.inputs)
        out = self.recomputed
        self.pending -= 1
        if self.pending <= 0:  # the last consumer: nothing holds the recomputed output after
            self.recomputed = None
        return out


@dataclass(eq=False)
class _LayerScope:
    """The saved-tensor hooks of one decoder layer's forward."""

    outputs: dict[int, _NormOutput] = field(default_factory=dict)

    def record(self, norm: torch.nn.Module, inputs: tuple, output: Any) -> None:
        key = _storage_key(output) if isinstance(output, torch.Tensor) else None
        if key is not None:
            self.outputs[key] = _NormOutput(norm, inputs, output)

    def pack(self, tensor: torch.Tensor) -> Any:
        entry = self.outputs.get(_storage_key(tensor)) if self.outputs else None
        if entry is None or entry.output is None or tensor.dtype != entry.output.dtype:
            return tensor
        entry.pending += 1
        return entry, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        entry, shape, stride, offset = packed
        return entry.value().as_strided(shape, stride, offset)


def _layer_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not torch.is_grad_enabled() or (
        isinstance(hidden, torch.Tensor) and hidden.nbytes * self._norm_count < self._norm_min_bytes
    ):
        return self._forward_saving_norms(*args, **kwargs)
    scope = _LayerScope()
    self._norm_scope = scope
    try:
        with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack):
            return self._forward_saving_norms(*args, **kwargs)
    finally:
        self._norm_scope = None
        for entry in scope.outputs.values():
            entry.output = None  # its storage is free once the forward's own references go


def _record_norm(layer: torch.nn.Module) -> Any:
    def hook(norm: torch.nn.Module, inputs: tuple, output: Any) -> None:
        scope = getattr(layer, "_norm_scope", None)
        if scope is not None:
            scope.record(norm, inputs, output)

    return hook


def recompute_norm_outputs(layers: list[torch.nn.Module], min_bytes: int = 0) -> int:
    """Install on every layer holding a norm (a module class named ``*RMSNorm`` or
    ``*LayerNorm``); returns (and logs) how many layers took it. A forward whose norm outputs
    come to less than ``min_bytes`` (its hidden states' bytes times the layer's norms) keeps
    them: the hooks' and the recompute's fixed costs buy nothing there
    (`model_setup.LEAN_MIN_BYTES`)."""
    done = 0
    for layer in layers:
        norms = [m for m in layer.modules() if type(m).__name__.endswith(NORM_CLASS_SUFFIXES)]
        if not norms:
            continue
        layer._norm_min_bytes, layer._norm_count = min_bytes, len(norms)
        done += 1
        if hasattr(layer, "_forward_saving_norms"):  # installed already
            continue
        for norm in norms:
            norm.register_forward_hook(_record_norm(layer))
        layer._forward_saving_norms = layer.forward
        layer._norm_scope = None
        layer.forward = types.MethodType(_layer_forward, layer)
    logger.info(
        "norm outputs recomputed in backward in %d of %d decoder layers (where they come to "
        ">= %d bytes a layer)%s", done, len(layers), min_bytes,
        "" if done == len(layers) else " (the rest hold no *RMSNorm / *LayerNorm module)",
    )  # fmt: skip
    return done
