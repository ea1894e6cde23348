"""The last decoder layer at the rows a loss reads, and nowhere else.

A causal LM's last hidden state at position ``t`` feeds only the logits at ``t``, and a loss
reads logits only where its token mask asks (an SFT row's answer, a GRPO sample's tokens, a
DPO answer): the positions before are needed for their keys and values in every layer's
attention -- but not the last layer's MLP, nor its attention's query and output projections,
which work for nobody there. tiny-arith's SFT rows read 4.6 of their 15.6 tokens; its two
layers' MLPs are 3/4 of its products.

`LastLayer.at` runs those parts on the read rows only (in the layout the model runs: padded
rows, a packed bin or a shared-prefix plan's groups, `model_rows`) and gives zeros elsewhere,
so the model's last hidden states there are not its own: the pass hands its logits on as
`HiddenLogits` with ``computed_rows``, and a read anywhere else raises (`tempering.logits`)
instead of returning wrong numbers.

Only where it is exact: a dense gated MLP (`gated_mlp`'s classes; a mixture of experts routes
every token and its load-balancing loss counts them), no activation checkpointing (a
recomputed layer would run its parts whole, so its saved tensors would not match) and one
tensor-parallel rank (the column split is not exercised on a subset of rows). FSDP2-wrapped
models (bf16, several ranks) too: the parts are inside the layer that ``fully_shard`` gathers,
and their layers are found through the class ``fully_shard`` derives (`hf.decoder_layers`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tempering.distributed.batched_data_dict import PackedBin
from tempering.models.hf import decoder_layers
from tempering.models.policy.gated_mlp import FUSED_GATE_UP, LLAMA_STYLE
from tempering.models.policy.shared_prefix import SharedPrefixPlan

# The attention projections of a decoder layer that work for their own rows only: a query
# (its keys and values serve every later row) and the output (transformers' names).
ROW_PROJECTIONS = ("q_proj", "o_proj")


@dataclass(frozen=True)
class LastLayer:
    """The parts of a model's last decoder layer that work only for their own rows: its
    dense gated MLP, and its attention's separate query and output projections (a fused
    ``qkv_proj`` stays whole: its keys and values serve every row)."""

    modules: tuple[torch.nn.Module, ...]

    @staticmethod
    def of(model: torch.nn.Module) -> LastLayer | None:
        """``model``'s last decoder layer (``_no_split_modules``) if its MLP is one of the
        dense gated MLPs; None otherwise. Found once per model."""
        if model not in _FOUND:
            _FOUND[model] = LastLayer._find(model)
        return _FOUND[model]

    @staticmethod
    def _find(model: torch.nn.Module) -> LastLayer | None:
        layers = decoder_layers(model)
        mlp = getattr(layers[-1], "mlp", None) if layers else None
        if mlp is None or type(mlp).__name__ not in LLAMA_STYLE | FUSED_GATE_UP:
            return None
        attention = getattr(layers[-1], "self_attn", None)
        projections = [getattr(attention, name, None) for name in ROW_PROJECTIONS]
        return LastLayer((mlp, *(p for p in projections if isinstance(p, torch.nn.Module))))

    @contextmanager
    def at(self, index: torch.Tensor) -> Iterator[None]:
        """While inside, each part computes only the flat rows ``index`` of its input
        ``[..., D]`` (the model's tokens in its layout) and gives zeros at the others (a zero
        query attends evenly: its output, zero elsewhere too, is never read)."""
        owned = [(m, m.__dict__.get("forward")) for m in self.modules]  # gated_mlp's rebinding
        for module, _ in owned:
            module.forward = _rows_only(module.forward, index)
        try:
            yield
        finally:
            for module, own in owned:
                if own is not None:
                    module.forward = own
                else:
                    del module.forward


def _rows_only(full: Callable[[torch.Tensor], torch.Tensor], index: torch.Tensor) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        picked = full(flat.index_select(0, index))
        out = picked.new_zeros(flat.shape[0], picked.shape[-1]).index_copy(0, index, picked)
        return out.view(*x.shape[:-1], picked.shape[-1])

    return forward


_FOUND: weakref.WeakKeyDictionary[torch.nn.Module, LastLayer | None] = weakref.WeakKeyDictionary()


def model_rows(reads: torch.Tensor, layout: PackedBin | SharedPrefixPlan | None) -> torch.Tensor:
    """The flat positions of the model's input (``layout``: None, the padded rows ``[B, S]``;
    a packed bin ``[1, T]``; a plan's groups ``[G, L]``) that hold the micro-batch's rows'
    ``reads`` (``[B, S]`` bool), sorted and each once."""
    if layout is None:
        return reads.reshape(-1).nonzero().squeeze(-1)
    if isinstance(layout, PackedBin):
        starts = layout.cu_seqlens[:-1].to(reads.device)
        columns = torch.arange(reads.shape[1], device=reads.device)
        return (starts[:, None] + columns[None, :])[reads]
    return layout.gather.to(reads.device)[reads].unique()
