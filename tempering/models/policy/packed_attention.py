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

It also runs a shared-prefix plan's attention in its rows' layout (`RowsAttention`): the
matmuls of the plan's groups see each shared token once, while attention gathers every row's
queries, keys and values back to its own padded row and runs plain causal SDPA there, instead
of a dense tree mask over a whole group (many short rows under a short common start: 16 rows of
~13 tokens as one 216-token group attend over 46,656 pairs, as rows over 16 x 136).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "tempering_packed_sdpa"
ROWS_KWARG = "tempering_rows"  # the model keyword that carries a `RowsAttention`


@dataclass(frozen=True)
class RowsAttention:
    """Where a shared-prefix plan's attention runs: its rows, gathered from the groups.

    ``bounds`` None: the rows padded to ``width``, one batched causal call; ``gather``
    ``[rows * width]`` holds the flattened group position of every (row, column) (padding
    columns: any position -- their keys come after the row's tokens, their outputs are never
    read). ``bounds`` (the rows' cumulative lengths): the rows packed side by side, one call
    each; ``gather`` ``[bounds[-1]]``. ``pick`` ``[G * L]``: for each group position, one
    gathered position holding it (group padding: any)."""

    gather: torch.Tensor
    pick: torch.Tensor
    rows: int
    width: int
    bounds: tuple[int, ...] | None = None

    def to(self, device: torch.device) -> RowsAttention:
        return RowsAttention(
            self.gather.to(device), self.pick.to(device), self.rows, self.width, self.bounds
        )


# Rows at most this long attend on CPU by `matmul_attention`: torch's CPU SDPA kernels pay a
# fixed cost per (row, head) block that dwarfs short rows' work (2026-11-28, 2 EPYC cores, fp32,
# forward + backward, 128 rows x 2 heads x 64 dims: 16 tokens 2.2 ms by SDPA against 1.0 by
# matmuls, 32 tokens 5.2 against 3.9, 64 tokens 14.4 against 12.0, 128 tokens 37.7 against
# 40.1; 8 rows x 9 heads alike; forward alone equal at 64).
SHORT_ROWS = 64


def matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """``softmax(q k^T * scaling, where keep) v`` over ``[B, H, S, D]`` rows as two matmuls
    (the softmax in fp32, as transformers' eager attention); every query keeps a key."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scale)
    scores = scores.masked_fill_(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(weights, value)


def causal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal SDPA over ``[B, H, S, D]`` rows, within ``sliding_window`` where it is narrower
    than the rows (a key at most ``sliding_window - 1`` positions back, as transformers')."""
    width = query.shape[2]
    mask = None
    short = query.device.type == "cpu" and width <= SHORT_ROWS and dropout == 0.0
    if short or (sliding_window is not None and sliding_window < width):
        pos = torch.arange(width, device=query.device)
        back = pos[:, None] - pos[None, :]
        mask = (back >= 0) & (back < (sliding_window or width))
    if short:
        return matmul_attention(query, key, value, mask, scaling)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        is_causal=mask is None,
    )  # fmt: skip


def sequences_sdpa(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int] | tuple[int, ...],
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """`causal_sdpa` on each packed sequence ``bounds[i]:bounds[i + 1]`` alone: ``[1, H, T, D]``."""
    pieces = [
        causal_sdpa(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout, scaling, sliding_window
        )
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(pieces, dim=2)


def rows_attention(
    layout: RowsAttention,
    query: torch.Tensor,  # [G, H, L, D]
    key: torch.Tensor,  # [G, KVH, L, D]
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal SDPA over the micro-batch's rows, from and back to the groups' layout:
    ``[G, L, H, D]``. Gradients of a shared key or value sum over the rows that read it
    (`index_select`'s backward); a shared query's output is taken from one row."""
    groups, _, length, dim = query.shape
    shape = (layout.rows, layout.width) if layout.bounds is None else (1, layout.bounds[-1])

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [G, h, L, D] -> [B, h, S, D] / [1, h, T, D]
        flat = x.transpose(1, 2).reshape(groups * length, -1)
        return flat.index_select(0, layout.gather).view(*shape, x.shape[1], dim).transpose(1, 2)

    q, k, v = to_rows(query), to_rows(key), to_rows(value)
    heads = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    if layout.bounds is None:
        out = causal_sdpa(q, k, v, dropout, scaling, sliding_window)
    else:
        out = sequences_sdpa(q, k, v, layout.bounds, dropout, scaling, sliding_window)
    flat = out.transpose(1, 2).reshape(shape[0] * shape[1], -1)
    return flat.index_select(0, layout.pick).view(groups, length, -1, dim)


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
    """Causal SDPA over a shared-prefix plan's rows when `ROWS_KWARG` is given, per packed
    sequence when ``cu_seq_lens_q`` is, else plain sdpa."""
    layout, window = kwargs.get(ROWS_KWARG), kwargs.get("sliding_window")
    if layout is not None:
        return rows_attention(layout, query, key, value, dropout, scaling, window), None
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = sequences_sdpa(query, key, value, bounds.tolist(), dropout, scaling, window)
    return out.transpose(1, 2).contiguous(), None  # [1, T, H, D]


def use_packed_sdpa(model: Any) -> bool:
    """Switch ``model`` from ``sdpa`` to `PACKED_SDPA`; returns whether it did (other
    implementations, e.g. flash-attention or eager, are left as they are)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # unpacked calls need sdpa's mask
    model.set_attn_implementation(PACKED_SDPA)
    return True


def attends_over_rows(model: Any) -> bool:
    """Whether ``model``'s attention takes `ROWS_KWARG` (it runs `PACKED_SDPA`)."""
    return getattr(model.config, "_attn_implementation", None) == PACKED_SDPA
