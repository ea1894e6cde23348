"""Attention over packed sequences at the cost of the sequences, not of the bin.

A packed micro-batch is one row holding several sequences back to back, with ``position_ids``
that restart at 0 for each (see `FSDP2PolicyWorker`). Plain ``sdpa`` in transformers handles
that by building a dense ``[T, T]`` block-diagonal mask and attending over the whole bin:
``O(T^2)`` work, most of it masked out, which made packing *slower* than padding on CPU.

`use_packed_sdpa(model)` switches a model from ``sdpa`` to `PACKED_SDPA`, an attention function
registered through transformers' own `AttentionInterface` (its documented extension point):
given ``cu_seq_lens_q`` (the sequence boundaries, the keyword that flash-attention's varlen
kernels take too), it runs causal SDPA on each sequence separately, ``O(sum L_i^2)``; without
it, it is plain ``sdpa``. Models on ``flash_attention_*`` keep their own varlen kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "tempering_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, KVH, T, D]
    value: torch.Tensor,  # [B, KVH, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per packed sequence when ``cu_seq_lens_q`` is given, else plain sdpa."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    edges = bounds.tolist()
    pieces = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
        )
        for start, end in zip(edges[:-1], edges[1:], strict=True)
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None  # [1, T, H, D]


def use_packed_sdpa(model: Any) -> bool:
    """Switch ``model`` from ``sdpa`` to `PACKED_SDPA`; returns whether it did (other
    implementations, e.g. flash-attention or eager, are left as they are)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # unpacked calls need sdpa's mask
    model.set_attn_implementation(PACKED_SDPA)
    return True
