"""Micro-batches and the forward pass of one policy rank.

`FSDP2PolicyWorker` (training, log-probs, scores) hands every batch to a `ForwardPass`, which
cuts it into micro-batches and runs each through a model in its *layout*. Three kinds:

- a fixed number of rows (``micro_batch_size``), each micro-batch trimmed to its longest row;
- dynamic ones under a padded-token budget (``max_tokens_per_microbatch``);
- packed ones (``max_tokens_per_microbatch`` + ``pack_sequences=True``): first-fit-decreasing
  bins of unpadded sequences, each bin one row whose ``position_ids`` restart at 0 per
  sequence, so transformers' attention mask keeps the sequences apart (no padding computed at
  all). The packed logits are unpacked to the padded layout before the loss, so every loss
  works unchanged.

Unpacked micro-batches may also run as shared-prefix groups (rows that start alike compute
their common prefix once; `tempering.models.policy.shared_prefix`) or padding-free: their rows,
in order, as one packed row (the micro-batch keeps its rows; only its padding is not computed).
`ForwardPass.split` picks each one's cheapest layout by `PaddingFree`'s cost model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict, PackedBin, pack_in_order
from tempering.logits import HiddenLogits, as_logits
from tempering.models.policy.packed_attention import attends_over_rows
from tempering.models.policy.read_rows import LastLayer, model_rows
from tempering.models.policy.shared_prefix import SharedPrefixPlan, plan_shared_prefix, row_cost

# How a micro-batch runs through the model: packed into one row, as shared-prefix groups, or
# (None) as its padded rows.
Layout = PackedBin | SharedPrefixPlan | None


@dataclass(frozen=True)
class PaddingFree:
    """Costs, in tokens' worth of matmuls, that decide whether a micro-batch runs padding-free.

    A token costs 1; a (query, key) pair of attention ``ratio`` (`attention_cost_ratio`); a
    padded row attends causally (half its square), a shared-prefix row densely; a padding-free
    micro-batch costs its real tokens, each sequence's causal square, and ``per_sequence``
    for each sequence: the per-sequence attention calls and the packing around them, fixed
    costs that dwarf a short row's matmuls on a small model (tiny-arith: 128 rows of ~12
    tokens ran 2x slower padding-free) and vanish on a large one (SmolLM2: ~6 tokens a row).
    """

    ratio: float
    per_sequence: float

    def cheaper(self, mb: BatchedDataDict, plan: SharedPrefixPlan | None) -> bool:
        """Whether ``mb`` costs less padding-free than as ``plan`` (None: its padded rows)."""
        lengths = [int(n) for n in mb["input_lengths"].tolist()]
        free = sum(row_cost(n, self.ratio, False) + self.per_sequence for n in lengths)
        if plan is not None:
            return free < plan.cost
        rows, width = mb["input_ids"].shape
        return free < rows * row_cost(width, self.ratio, dense=False)


@dataclass(frozen=True)
class ForwardPass:
    """How this rank splits a batch and runs a micro-batch through a model.

    Args:
        head: "causal_lm" (``[B, S, V]`` logits), "score" (``[B]`` scores) or "value"
            (``[B, S]`` values, each token's from the position before it).
        device: where micro-batches are computed.
        shared_prefix: the cost ratio of `plan_shared_prefix`; None: rows computed whole.
        over_rows: the model attends over rows (`PACKED_SDPA`), so a shared-prefix plan may
            run its attention in the rows' layout (`plan_shared_prefix`).
        pad_token_id: the pad id shared-prefix plans fill with (0 when None).
        chunk_rows: rows of logits a `HiddenLogits` computes at a time; None: the logits are
            always materialised whole (a reward model; a head `HiddenLogits` cannot compute).
            Otherwise every pass returns a `HiddenLogits` (a loss projects only the rows it
            reads), differentiated chunk by chunk where `chunked` says so.
        fuse_trained_head: chunk a trained output projection's logits too (`chunked`).
        padding_free: the cost model that lets a micro-batch run without its padding; None:
            never (a reward model; an attention without varlen support).
        read_rows: a pass told which rows its caller reads runs the last decoder layer's MLP,
            query and output at those rows alone (`read_rows.py`; where the model's last MLP
            is a dense gated one and the logits stay hidden, `chunk_rows`).
    """

    head: str
    device: torch.device
    shared_prefix: float | None
    pad_token_id: int | None
    chunk_rows: int | None = None
    fuse_trained_head: bool = False
    padding_free: PaddingFree | None = None
    over_rows: bool = False
    read_rows: bool = False

    def split(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        max_tokens: int | None,
        pack: bool = False,
    ) -> tuple[list[BatchedDataDict], list[Layout], torch.Tensor | None]:
        """Micro-batches trimmed to their longest sequence, each one's layout for the forward
        (its packed bin when packing; else its shared-prefix plan, or None: the padded rows),
        and the row permutation (None when rows keep their order). A layout is decided once
        per micro-batch, so a reference forward and the policy's share it."""
        if pack:
            if max_tokens is None:
                raise ValueError(
                    "pack_sequences=True needs max_tokens_per_microbatch (the bin size); set "
                    "policy.sequence_packing.train_mb_tokens"
                )
            bins = data.pack_sequences(max_tokens, seq_keys=["input_ids"])
            mbs = [trim(data.select_indices(b.indices)) for b in bins]
            return mbs, list(bins), torch.cat([b.indices for b in bins])
        if max_tokens is not None:
            mbs, perm = data.make_microbatches_by_tokens(max_tokens)
        else:
            mbs = [trim(mb) for mb in data.make_microbatches(micro_batch_size or max(1, data.size))]
            perm = None
        return mbs, [self._plan(mb) for mb in mbs], perm

    def _plan(self, mb: BatchedDataDict) -> Layout:
        """The cheapest layout of an unpacked micro-batch: a shared-prefix plan where one
        pays, padding-free where that costs less, else (None) its padded rows."""
        plan = None
        if self.shared_prefix is not None:
            plan = plan_shared_prefix(
                mb["input_ids"], mb["input_lengths"], self.shared_prefix,
                self.pad_token_id or 0, self.over_rows,
                self.padding_free.per_sequence if self.padding_free is not None else None,
            )  # fmt: skip
        if mb.size and self.padding_free is not None and self.padding_free.cheaper(mb, plan):
            return pack_in_order(mb)
        return plan

    def logits(
        self,
        model: torch.nn.Module,
        mb: BatchedDataDict,
        layout: Layout = None,
        router: list[Any] | None = None,
        reads: torch.Tensor | None = None,
    ) -> torch.Tensor | HiddenLogits:
        """``[B, S, V]`` float logits of micro-batch ``mb``, computed in its ``layout`` (see
        `split`; None: the padded rows) -- as `HiddenLogits` (the last hidden states and the
        output projection, reduced chunk by chunk by the loss) where `chunked` says so;
        ``[B]`` scores for ``head="score"``, ``[B, S]`` values for ``head="value"``. ``router``
        (a mixture-of-experts model in training, `moe.py`): the padded and packed layouts append ``(aux_loss,
        router_logits, token mask or None)`` to it. ``reads`` (``[B, S]`` bool): the only rows
        of the logits the caller reads (`read_rows`); None: any."""
        if self.head == "score":
            if layout is not None:
                raise ValueError("a reward model (head='score') takes its rows whole")
            ids = mb["input_ids"]
            seq = torch.arange(ids.shape[1], device=ids.device)
            attention_mask = (seq[None, :] < mb["input_lengths"][:, None]).long()
            return model(input_ids=ids, attention_mask=attention_mask).logits.float()[:, 0]
        if self.head == "value":  # any layout, as a policy's logits (packed: unpacked back)
            out = self._computed(model, mb, layout, None, {}, None)[..., 0]  # [B, S]
            # a value per token t, the token log-probs' layout: read at t - 1 (the state
            # before token t), 0 at t = 0
            return torch.nn.functional.pad(out[:, :-1], (1, 0))
        moe = {"output_router_logits": True} if router is not None else {}
        last = LastLayer.of(model) if self.read_rows and self.chunk_rows is not None else None
        if reads is None or last is None:
            return self._computed(model, mb, layout, router, moe, None)
        with last.at(model_rows(reads, layout)):
            return self._computed(model, mb, layout, router, moe, reads)

    def _computed(
        self,
        model: torch.nn.Module,
        mb: BatchedDataDict,
        layout: Layout,
        router: list[Any] | None,
        moe: dict[str, Any],
        reads: torch.Tensor | None,
    ) -> torch.Tensor | HiddenLogits:
        """`logits` of a causal LM, computed at the rows ``reads`` (None: every row)."""
        if isinstance(layout, SharedPrefixPlan):
            if layout.over_rows is not None and not attends_over_rows(model):
                raise ValueError(
                    f"a shared-prefix plan that attends over rows met a model on "
                    f"{model.config._attn_implementation!r} attention, which would ignore it; "
                    f"build the ForwardPass with over_rows=attends_over_rows(model)"
                )
            out, weight = self._run(model, **layout.inputs(self.device))
            rows = layout.rows(out.logits)  # each row as if computed alone
            return self._finish(model, rows, weight, reads)
        if isinstance(layout, PackedBin):
            # One row holding every sequence; transformers builds a block-diagonal causal mask
            # from position_ids that restart at 0 when attention_mask is None.
            cu = layout.cu_seqlens.to(self.device)
            out, weight = self._run(
                model,
                input_ids=layout.input_ids[None].to(self.device),
                position_ids=layout.position_ids[None].to(self.device),
                # sequence bounds for varlen attention (packed_attention.py, flash-attention)
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=layout.max_seqlen,
                max_length_k=layout.max_seqlen,
                **moe,
            )
            if router is not None:
                router.append((out.aux_loss, out.router_logits, None))
            rows = layout.unpack(out.logits[0])  # == mb's layout
            return self._finish(model, rows, weight, reads)
        input_ids = mb["input_ids"]
        seq = torch.arange(input_ids.shape[1], device=input_ids.device)
        attention_mask = (seq[None, :] < mb["input_lengths"][:, None]).long()  # [B, S]
        out, weight = self._run(model, input_ids=input_ids, attention_mask=attention_mask, **moe)
        if router is not None:
            router.append((out.aux_loss, out.router_logits, attention_mask))
        return self._finish(model, out.logits, weight, reads)  # [B, S, V]

    def chunked(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s logits are differentiated chunk by chunk now: `chunk_rows` is set
        and either no gradient flows (log-probs, references) or the output projection is
        frozen (LoRA), or `fuse_trained_head` (one more projection pass in backward, for
        memory). Otherwise a loss materialises the rows it reads under autograd."""
        if self.chunk_rows is None:
            return False
        if self.fuse_trained_head or not torch.is_grad_enabled():
            return True
        return not model.get_output_embeddings().weight.requires_grad

    def _run(self, model: torch.nn.Module, **inputs: Any) -> tuple[Any, torch.Tensor | None]:
        """``model(**inputs)``, and the output projection's weight when its ``logits`` are
        the hidden states instead (`chunk_rows` set): the projection passes them through."""
        if self.chunk_rows is None:
            return model(**inputs, use_cache=False), None
        head = model.get_output_embeddings()
        seen: list[torch.Tensor] = []

        def passthrough(hidden: torch.Tensor) -> torch.Tensor:
            seen.append(head.weight)  # as the forward sees it (FSDP2: gathered whole)
            # HF hands the head a view (the rows kept); an FSDP2 module returning a view
            # warns in every run's log that an in-place op on it would skip its hooks. A copy
            # of the hidden states (not the logits) costs little.
            return hidden.clone() if hidden._is_view() else hidden

        head.forward = passthrough
        try:
            out = model(**inputs, use_cache=False)
        finally:
            del head.forward
        return out, seen[0]

    def _finish(
        self,
        model: torch.nn.Module,
        out: torch.Tensor,
        weight: torch.Tensor | None,
        reads: torch.Tensor | None,
    ) -> torch.Tensor | HiddenLogits:
        if weight is None:
            return out.float()
        assert self.chunk_rows is not None
        return HiddenLogits(
            out, weight, self.chunk_rows, fused=self.chunked(model), computed_rows=reads
        )

    def padding(self, model: torch.nn.Module) -> torch.Tensor:
        """A one-token pass whose result is dropped: a rank with fewer micro-batches runs it so
        that every rank joins the same FSDP2 collectives (its logits whole: a backward through
        them reaches every parameter, as the other ranks' passes do)."""
        return as_logits(self.logits(model, dummy_batch(self.device)))


def computed_tokens(mb: BatchedDataDict, layout: Layout) -> int:
    """Tokens one forward of ``mb`` computes in ``layout`` (padding not counted)."""
    if isinstance(layout, PackedBin):
        return layout.num_tokens
    if isinstance(layout, SharedPrefixPlan):
        return layout.tokens
    return int(mb["input_lengths"].sum())


def trim(mb: BatchedDataDict) -> BatchedDataDict:
    """Cut sequence keys (dim 1 == input_ids' dim 1) to the micro-batch's longest sequence."""
    width = mb["input_ids"].shape[1]
    keep = int(mb["input_lengths"].max()) if mb.size else width
    if keep >= width:
        return mb
    return BatchedDataDict(
        {
            k: v[:, :keep]
            if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == width
            else v
            for k, v in mb.items()
        }
    )


def dummy_batch(device: torch.device) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        input_lengths=torch.ones(1, dtype=torch.long, device=device),
    )
