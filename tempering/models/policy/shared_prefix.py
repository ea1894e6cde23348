"""Rows that start alike are computed once: exact shared-prefix forwards.

GRPO trains several samples of one prompt, DPO a chosen and a rejected answer to one prompt: in
a padded micro-batch every row recomputes the prompt. `plan_shared_prefix` groups rows whose
token ids share a prefix and lays each group out as ONE row: the shared prefix once, then every
member's own continuation after it::

    rows    [p p p a a]  [p p p b b b]  [p p p a a]     (3 rows, 16 tokens)
    group   [p p p | a a | b b b | a a]                 (1 row, 10 tokens)

A tree attention mask lets each continuation see the prefix and its own earlier tokens only,
and its position ids continue from the prefix's, so every token's logits are those of its own
row computed alone (up to float rounding). `SharedPrefixPlan.forward` runs the model on the
groups and gathers the logits back into the micro-batch's padded ``[B, S, V]`` layout, so every
loss works unchanged and gradients of a shared token sum over the rows that share it.

The groups' attention runs one of two ways, whichever a cost model finds cheaper (a token
costs its matmuls, 2 x parameters; a (query, key) pair of attention `attention_cost_ratio` of
that):

- a *tree mask*: each group row attends densely under a ``[L, L]`` mask (it cannot skip blocks
  the way causal attention does). Grouping is greedy over the rows sorted by their tokens, and
  a row joins a group only where its shared tokens save more than the group's attention grows,
  so long continuations under a short common prefix (a system prompt) stay apart. Pays for a
  long prompt under short answers (GRPO samples of one prompt).
- *over rows* (`packed_attention.RowsAttention`; needs `PACKED_SDPA`): attention gathers every
  row back to its own padded row and runs causal there, as the padded micro-batch would; only
  the matmuls see a shared token once, and no padding. Every row that shares a token joins its
  group; rows that share none still pack side by side (a padding-free micro-batch whose
  attention is one batched call, not one per sequence). Pays for many short rows under a short
  common start (tiny-arith's SFT rows: a 2-token start, ~13 tokens each).

A plan is dropped when it costs no less than the padded micro-batch (its positions, padding
included, and their causal attention). Identical rows (GRPO samples that came out the same)
collapse into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tempering.distributed.batched_data_dict import first_fit_decreasing, rows_tensor
from tempering.models.policy.packed_attention import ROWS_KWARG, RowsAttention

# Attention implementations that take a custom 4-D boolean mask (True = attend).
BOOL_MASK_ATTENTION = ("sdpa", "tempering_packed_sdpa")


@dataclass
class SharedPrefixPlan:
    """Groups of one micro-batch: ``input_ids``/``position_ids`` ``[G, L]``, ``gather``
    ``[B, S]``: for every row and column of the micro-batch, its position in the flattened
    ``[G * L]`` groups; and how they attend: ``mask`` ``[G, 1, L, L]`` (a tree mask, True =
    attend) or ``over_rows`` (attention in the rows' layout, `RowsAttention`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor | None
    over_rows: RowsAttention | None
    gather: torch.Tensor
    tokens: int  # real tokens in the groups (the rows had sum(input_lengths))
    cost: float  # in tokens' worth of matmuls (module docstring)

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """The micro-batch's ``[B, S, V]`` float logits, computed on the groups."""
        device = next(model.parameters()).device
        return self.rows(model(**self.inputs(device), use_cache=False).logits.float())

    def inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The model's keyword arguments that compute the groups."""
        inputs = {
            "input_ids": self.input_ids.to(device),
            "position_ids": self.position_ids.to(device),
        }
        if self.over_rows is None:
            assert self.mask is not None
            return inputs | {"attention_mask": self.mask.to(device)}
        # an all-ones 2-D mask: transformers builds no mask (causal SDPA's own) and does not
        # read the restarting position ids as packed sequences
        ones = torch.ones(self.input_ids.shape, dtype=torch.long, device=device)
        return inputs | {"attention_mask": ones, ROWS_KWARG: self.over_rows.to(device)}

    def rows(self, out: torch.Tensor) -> torch.Tensor:
        """The groups' ``[G, L, D]`` outputs (logits, hidden states) as the micro-batch's
        ``[B, S, D]``, each row as if computed alone."""
        flat = out.reshape(-1, out.shape[-1])
        # index_select, not `flat[index]`: on CPU the backward of advanced indexing (an
        # accumulating index_put) took 6.6 ms against 0.64 at tiny-arith's GRPO step shape
        index = self.gather.to(out.device).reshape(-1)
        return flat.index_select(0, index).reshape(*self.gather.shape, -1)


def attention_cost_ratio(config: Any, num_params: int) -> float:
    """Cost of one (query, key) pair of attention relative to one token's matmuls:
    4 x hidden x layers FLOPs (scores and values) against 2 x parameters."""
    return 2.0 * config.hidden_size * config.num_hidden_layers / max(num_params, 1)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def row_cost(tokens: int, ratio: float, dense: bool) -> float:
    """One row's cost in tokens' worth of matmuls: its tokens and its attention pairs at
    ``ratio`` each -- causal for a lone row (half the square), dense for a group's mask."""
    return tokens + ratio * tokens * tokens * (1.0 if dense else 0.5)


def plan_shared_prefix(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    ratio: float,
    pad_token_id: int = 0,
    over_rows: bool = False,
    per_sequence: float | None = None,
) -> SharedPrefixPlan | None:
    """Group the right-padded rows ``input_ids`` ``[B, S]`` by shared prefixes (see module
    docstring); None when no plan is estimated to cost less than the padded rows.
    ``over_rows``: the model can attend over rows (`PACKED_SDPA`), so that plan competes too;
    ``per_sequence``: one attention call's fixed cost, in tokens (`PaddingFree`), when its rows
    may also attend one call each (None: padded to the longest, one call).

    A group is a token trie of its rows: sorted, each row adds the tokens past its common
    prefix with the row before it (the longest it shares with any earlier row)."""
    lengths = [int(n) for n in input_lengths.tolist()]
    ids = input_ids.tolist()
    rows = [ids[i][: lengths[i]] for i in range(len(lengths))]
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    width = input_ids.shape[1]
    best, best_cost = None, len(rows) * row_cost(width, ratio, False)  # the padded rows
    # each candidate costed from its groups; only the cheapest is laid out (a tree mask is
    # [R, L, L]: building the loser's took ~2 ms of a tiny-arith GRPO step)
    for rows_layout in (False, True) if over_rows else (False,):
        grouped = _groups(rows, order, ratio, rows_layout)
        if grouped is None:
            continue
        groups, sizes = grouped
        bins = first_fit_decreasing(sizes, max(sizes))
        alone = False
        if rows_layout:  # padding included: the matmuls compute it too
            attention, alone = _rows_attention_cost(lengths, width, ratio, per_sequence)
            cost = len(bins) * max(sizes) + attention
        else:
            cost = len(bins) * row_cost(max(sizes), ratio, True)
        if cost < best_cost:
            best, best_cost = (groups, sizes, bins, rows_layout, alone), cost
    if best is None:
        return None
    groups, sizes, bins, rows_layout, alone = best
    return _layout(groups, sizes, bins, rows, width, pad_token_id, rows_layout, alone, best_cost)


def _groups(
    rows: list[list[int]], order: list[int], ratio: float, over_rows: bool
) -> tuple[list[list[int]], list[int]] | None:
    """Greedy groups of the sorted rows and their trie sizes. Under a tree mask a row joins
    only where its shared tokens save more than the group's dense attention grows (None when
    no row joins one); over rows, attention costs the same either way, so wherever it shares
    a token -- and a plan in which no row shares one still drops the micro-batch's padding
    (its rows packed side by side), so it is returned too."""
    groups: list[list[int]] = []  # members, in sorted order
    sizes: list[int] = []  # trie nodes (tokens computed) per group
    saved = False
    for i in order:
        if groups:
            shared = _common(rows[groups[-1][-1]], rows[i])
            grown = sizes[-1] + len(rows[i]) - shared
            apart = row_cost(sizes[-1], ratio, len(groups[-1]) > 1) + row_cost(
                len(rows[i]), ratio, False
            )
            if shared and (over_rows or row_cost(grown, ratio, True) < apart):
                groups[-1].append(i)
                sizes[-1] = grown
                saved = True
                continue
        groups.append([i])
        sizes.append(len(rows[i]))
    return (groups, sizes) if saved or over_rows else None


def _layout(
    groups: list[list[int]],
    sizes: list[int],
    bins: list[list[int]],
    rows: list[list[int]],
    width: int,
    pad_token_id: int,
    over_rows: bool,
    alone: bool,
    cost: float,
) -> SharedPrefixPlan:
    """Each group's trie in depth-first order (a node's ancestors come before it), in the
    rows of ``bins`` (groups packed first-fit-decreasing, as wide as the largest group). Under
    a tree mask a node sees exactly its ancestors and itself: in depth-first order, node j's
    subtree is j..end[j]-1, so position i may attend to j iff j <= i < end[j]. Over rows
    (``alone``: one attention call per row), see `RowsAttention`."""
    L = max(sizes)
    ids = [[pad_token_id] * L for _ in bins]
    depth = [[0] * L for _ in bins]
    end = [list(range(1, L + 1)) for _ in bins]  # padding sees itself only
    gather = [[0] * width for _ in rows]
    pick = [[0] * L for _ in bins]  # one row position holding each group position
    for r, members_of_bin in enumerate(bins):
        node = 0  # next free position of this bin's row
        for g in members_of_bin:
            first = node
            path: list[int] = []  # the previous row's nodes, by depth
            previous: list[int] = []
            for m in groups[g]:
                row = rows[m]
                shared = _common(previous, row)
                path = path[:shared] + list(range(node, node + len(row) - shared))
                ids[r][node : node + len(row) - shared] = row[shared:]
                depth[r][node : node + len(row) - shared] = range(shared, len(row))
                # the row that adds a node holds it (column = depth)
                pick[r][node : node + len(row) - shared] = range(
                    m * width + shared, m * width + len(row)
                )
                node += len(row) - shared
                gather[m][: len(row)] = [r * L + j for j in path]
                previous = row
            if over_rows:
                continue
            # subtree ends: the next node at the same depth or shallower (monotonic stack)
            open_nodes: list[int] = []
            for j in range(first, node):
                while open_nodes and depth[r][open_nodes[-1]] >= depth[r][j]:
                    end[r][open_nodes.pop()] = j
                open_nodes.append(j)
            for j in open_nodes:
                end[r][j] = node
    gathered = rows_tensor(gather)
    if over_rows:
        over = _over_rows([len(row) for row in rows], gathered, rows_tensor(pick), alone)
        return SharedPrefixPlan(
            rows_tensor(ids), rows_tensor(depth), None, over, gathered, sum(sizes), cost
        )
    pos = torch.arange(L)
    ends = rows_tensor(end)  # [R, L]
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, :, None] < ends[:, None, :])
    return SharedPrefixPlan(
        rows_tensor(ids), rows_tensor(depth), mask[:, None], None, gathered, sum(sizes), cost
    )


def _rows_attention_cost(
    lengths: list[int], width: int, ratio: float, per_sequence: float | None
) -> tuple[float, bool]:
    """Attention over rows: its cost, and whether each row attends alone (one call each,
    ``per_sequence`` a call's fixed cost; None: never) rather than all padded to the longest
    in one call -- alone pays for rows of very different lengths (SmolLM2's SFT rows:
    129-512 tokens)."""
    padded = len(lengths) * (row_cost(width, ratio, False) - width)
    if per_sequence is None:
        return padded, False
    alone = sum(row_cost(n, ratio, False) - n + per_sequence for n in lengths)
    return (alone, True) if alone < padded else (padded, False)


def _over_rows(
    lengths: list[int], gather: torch.Tensor, pick: torch.Tensor, alone: bool
) -> RowsAttention:
    """`RowsAttention` from the ``[B, S]`` gather and ``[R, L]`` pick (row * S + column):
    the rows padded to ``S`` in one call, or (``alone``) packed side by side, a call each."""
    count, width = gather.shape
    if not alone:
        return RowsAttention(gather.reshape(-1), pick.reshape(-1), count, width)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    real = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    starts = torch.tensor(bounds[:-1])
    packed_pick = starts[pick // width] + pick % width  # the row starts at bounds[row]
    return RowsAttention(gather[real], packed_pick.reshape(-1), count, width, tuple(bounds))
