"""Logits that are never materialised whole: a micro-batch's last hidden states and the output
projection, reduced chunk by chunk to what a loss reads (each target's log-prob, the entropy,
a teacher's top-k).

At SmolLM2's 49k vocabulary the fp32 logits of one micro-batch of 4 x 384 tokens are 302 MB,
and training through them keeps the logits and writes their gradient: ~0.8 GB at the peak,
more than the model's weights. `HiddenLogits` holds ``hidden [B, S, H]`` and the projection's
weight ``[V, H]`` instead; the functions here compute a chunk of rows' logits, reduce them and
drop them, so at most one chunk (~64 MB) lives at a time.

Backward: with a frozen projection (LoRA, whose base is frozen; any no-grad pass) the gradient
with respect to each row's hidden state, ``(onehot(target) - softmax) @ W / T``, is computed
in the forward pass while the chunk's softmax is at hand, and backward only scales it by the
incoming gradient: the same products as the materialised path, in another order. A trained
projection also needs ``grad W``, which needs the softmax again: backward recomputes each
chunk's logits, one more pass of the projection (about a third more of its cost), so the
policy fuses a trained head only when asked (`policy.logprob_chunk_size`); otherwise a trained
projection's rows are materialised under plain autograd, as the model's own head would compute
them (`HiddenLogits.fused` False).

Only the rows a loss reads: a loss's log-probs are read where its token mask is set (an SFT
row's answer, a GRPO sample's generated tokens, never the prompt or the padding), so
`next_token_logprobs` takes the rows it needs and projects only those -- at SmolLM2's 49k
vocabulary the projection is a fifth of the model's products, and a GSM8K SFT batch reads 38%
of the positions it computes.

Torch only: a layer below the models, beside `tempering.losses`, which accepts a
`HiddenLogits` wherever it takes logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows per chunk when the caller does not say: ~64 MiB of fp32 logits (341 rows at a 49k
# vocabulary), never fewer than 64 rows (smaller products run far below the CPU's peak).
CHUNK_BYTES = 64 * 2**20
MIN_CHUNK_ROWS = 64


def default_chunk_rows(vocab_size: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab_size))


def upcast(logits: Tensor) -> Tensor:
    """Half-precision logits are computed in fp32; fp32/fp64 are kept as they are."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits


def needed_rows(mask: Tensor | None) -> Tensor | None:
    """``[B, S]`` bool: the rows of logits a log-prob read at ``mask [B, S]`` needs (row ``t``
    scores token ``t + 1``; the last row scores nothing). None: every row."""
    if mask is None:
        return None
    return F.pad(mask[:, 1:] != 0, (0, 1), value=False)


class NextTokenLogprob(torch.autograd.Function):
    """``logits[..., targets] - logsumexp(logits)`` over the last dimension, with a one-pass
    backward (materialised logits, ``[B, S, V]`` or ``[N, V]``).

    Autograd through ``log_softmax`` + ``gather`` on a ``[:, :-1]`` slice walks the ``[B, S, V]``
    logits about seven times (the slice's copy, the saved log-softmax, gather's zero-filled
    gradient, log-softmax's backward, the slice's zero-filled gradient and its copy); at a
    49k vocabulary that was a fifth of an SFT step. This keeps no ``[B, S, V]`` output and
    writes the gradient once: ``(onehot(target) - softmax(logits)) * grad``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # noqa: ANN001 (ctx)
        work = upcast(logits)
        lse = torch.logsumexp(work, dim=-1)  # [B, S]
        picked = work.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(logits, lse, targets)
        return picked

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001 (ctx)
        logits, lse, targets = ctx.saved_tensors
        out = upcast(logits) - lse.unsqueeze(-1)  # a new [B, S, V]: every write below is in place
        out.exp_().mul_(-grad.unsqueeze(-1))
        out.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
        return out.to(logits.dtype), None


@dataclass
class HiddenLogits:
    """The logits ``F.linear(hidden, weight).float() / temperature``, not yet computed.

    ``hidden`` ``[B, S, H]`` (the model's dtype), ``weight`` ``[V, H]`` (the output
    projection, bias-free), ``chunk_rows``: rows of logits computed at a time. ``logits / t``
    gives the same logits at temperature ``t`` (as on a tensor). ``fused``: a training pass
    differentiates through the chunked function (a frozen projection; a trained one when the
    policy fuses it); False: through the needed rows' materialised logits (a trained
    projection: the model's own path). ``entropy`` is filled by a training pass of
    `next_token_logprobs` (``[B, S]``, not differentiated) at ``entropy_rows`` (None: every
    row), so a loss's entropy metric costs no second pass. ``computed_rows`` (``[B, S]``
    bool; None: every row): the only rows whose hidden states are the model's (the policy ran
    its last layer's MLP, query and output at the rows its loss reads, `read_rows.py`); a
    read at any other raises.
    """

    hidden: Tensor
    weight: Tensor
    chunk_rows: int
    temperature: float = 1.0
    fused: bool = True
    entropy: Tensor | None = field(default=None, repr=False)
    entropy_rows: Tensor | None = field(default=None, repr=False)
    computed_rows: Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:2], self.weight.shape[0]))

    def dim(self) -> int:
        return 3

    def __truediv__(self, temperature: float) -> HiddenLogits:
        return HiddenLogits(
            self.hidden,
            self.weight,
            self.chunk_rows,
            self.temperature * float(temperature),
            self.fused,
            computed_rows=self.computed_rows,
        )

    def require(self, rows: Tensor | None) -> None:
        """Raise unless every row in ``rows`` (``[B, S]`` bool; None: all) was computed."""
        done = self.computed_rows
        if done is None or (rows is not None and not bool((rows & ~done).any())):
            return
        asked = "every row" if rows is None else f"{int((rows & ~done).sum())} rows outside them"
        raise ValueError(
            f"these logits were computed only at the {int(done.sum())} rows the loss reads "
            f"(its token mask; the last layer ran there alone, read_rows.py), and a read "
            f"asked for {asked}. A loss that reads other rows must not set "
            f"reads_token_mask_only = True"
        )

    def materialize(self) -> Tensor:
        """The whole ``[B, S, V]`` float logits (for a loss that needs every vocabulary entry)."""
        self.require(None)
        return _logits(self.hidden, self.weight, self.temperature)


def as_logits(logits: Tensor | HiddenLogits) -> Tensor:
    """A tensor of logits, materialising a `HiddenLogits`."""
    return logits.materialize() if isinstance(logits, HiddenLogits) else logits


def _logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """Exactly what the model's forward and the policy computed: the projection in the
    model's dtype, then float, then the temperature."""
    z = F.linear(hidden, weight).float()
    return z / temperature if temperature != 1.0 else z


def _chunks(n: int, rows: int) -> list[slice]:
    return [slice(s, min(s + rows, n)) for s in range(0, n, rows)]


class _FusedNextTokenLogprob(torch.autograd.Function):
    """Per row ``n``: ``z[n, targets[n]] - logsumexp(z[n])`` and (training) the entropy
    ``H[n]`` of ``softmax(z[n])``, where ``z = F.linear(hidden, weight).float() / temperature``,
    computed a chunk of rows at a time. See the module's docstring for the two backward modes.
    The entropy is differentiated only when ``entropy_grad`` (a loss's entropy bonus):
    ``dH/dz = -p * (log p + H)``, alongside the log-prob's ``onehot - p``."""

    @staticmethod
    def forward(  # noqa: PLR0913
        ctx,  # noqa: ANN001
        hidden: Tensor,  # [N, H]
        weight: Tensor,  # [V, H]
        targets: Tensor,  # [N]
        rows: int,
        temperature: float,
        entropy_grad: bool = False,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        training = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep_direction = ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]
        want_entropy = training or entropy_grad  # asked for: computed even without a gradient
        entropy_grad = entropy_grad and training
        picked = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        direction = torch.empty_like(hidden) if keep_direction else None
        entropy_direction = torch.empty_like(hidden) if keep_direction and entropy_grad else None
        for c in _chunks(n, rows):
            z = _logits(hidden[c], weight, temperature)  # [c, V]
            lse[c] = torch.logsumexp(z, dim=-1)
            picked[c] = z.gather(-1, targets[c, None]).squeeze(-1) - lse[c]
            if not want_entropy:
                continue
            logp = z.sub_(lse[c, None])  # in place: z is log-softmax now
            p = logp.exp()
            entropy[c] = -torch.linalg.vecdot(p, logp)
            if entropy_direction is not None:  # d H / d hidden = -p (log p + H) @ W / T
                logp.add_(entropy[c, None]).mul_(p).div_(-temperature)
                entropy_direction[c] = logp.to(weight.dtype) @ weight
            if direction is not None:  # d picked / d hidden = (onehot - p) @ W / T
                p.neg_().scatter_add_(-1, targets[c, None], p.new_ones(p.shape[0], 1))
                if temperature != 1.0:
                    p.div_(temperature)
                direction[c] = p.to(weight.dtype) @ weight
        ctx.rows, ctx.temperature, ctx.entropy_grad = rows, temperature, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        if direction is not None:
            ctx.save_for_backward(direction, entropy_direction)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        return picked, entropy

    @staticmethod
    def backward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        grad: Tensor,
        grad_entropy: Tensor,  # zeros unless the entropy was differentiated and read
    ):
        if len(ctx.saved_tensors) == 2:  # the frozen head's precomputed directions
            direction, entropy_direction = ctx.saved_tensors
            out = direction * grad[:, None]
            if entropy_direction is not None:
                out += entropy_direction * grad_entropy[:, None]
            return out.to(direction.dtype), None, None, None, None, None
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for c in _chunks(hidden.shape[0], ctx.rows):
            g = _logits(hidden[c], weight, ctx.temperature)  # recomputed [c, V]
            g.sub_(lse[c, None])  # log p
            if not ctx.entropy_grad:
                g.exp_().mul_(-grad[c, None])  # -p * grad
            else:  # -p * (grad + grad_H * (log p + H))
                scale = (g + entropy[c, None]).mul_(grad_entropy[c, None]).add_(grad[c, None])
                g = g.exp_().mul_(scale).neg_()
            g.scatter_add_(-1, targets[c, None], grad[c, None])  # + onehot * grad
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            g = g.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[c] = g @ weight
            grad_weight.addmm_(g.T.float(), hidden[c].float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


class _EntropyOfLogits(torch.autograd.Function):
    """``[n]``: the entropy of ``softmax(z[i])`` for materialised logits ``z [n, V]``, a chunk
    at a time, differentiable: ``dH/dz = -p * (log p + H)``, recomputed in backward."""

    @staticmethod
    def forward(ctx, z: Tensor, rows: int) -> Tensor:  # noqa: ANN001 (ctx)
        out = _entropy(z.detach(), rows)
        ctx.rows = rows
        ctx.save_for_backward(z, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001 (ctx)
        z, entropy = ctx.saved_tensors
        out = torch.empty_like(z)
        for c in _chunks(z.shape[0], ctx.rows):
            logp = torch.log_softmax(upcast(z[c]), dim=-1)
            scale = (logp + entropy[c, None]).mul_(grad[c, None])
            out[c] = logp.exp_().mul_(scale).neg_().to(z.dtype)
        return out, None


def entropy_of_logits(z: Tensor, chunk_rows: int) -> Tensor:
    """``[n]``: the entropy of each row of materialised logits ``z [n, V]``, differentiated."""
    return _EntropyOfLogits.apply(z, chunk_rows)


def next_token_logprobs(
    logits: HiddenLogits, targets: Tensor, rows: Tensor | None = None
) -> Tensor:
    """``[B, S]``: ``log_softmax(logits[b, t])[targets[b, t]]`` in fp32 at the ``rows``
    (``[B, S]`` bool, `needed_rows`; None: all) and 0 elsewhere: only those rows are projected.
    A training pass also fills ``logits.entropy`` at the same rows."""
    return _next_token(logits, targets, rows, entropy_grad=False)[0]


def next_token_logprobs_and_entropy(
    logits: HiddenLogits, targets: Tensor, rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`next_token_logprobs` and the entropy at the same rows, both ``[B, S]`` and both
    differentiated (an entropy bonus): one pass of the projection, as for the log-probs alone."""
    return _next_token(logits, targets, rows, entropy_grad=True)


def _next_token(
    logits: HiddenLogits, targets: Tensor, rows: Tensor | None, entropy_grad: bool
) -> tuple[Tensor, Tensor]:
    logits.require(rows)
    hidden, weight = logits.hidden, logits.weight
    shape = hidden.shape[:2]
    flat, index = _flat_rows(hidden, rows)
    flat_targets = targets.reshape(-1) if index is None else targets.reshape(-1)[index]
    training = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if logits.fused or not training:
        picked, entropy = _FusedNextTokenLogprob.apply(
            flat, weight, flat_targets, logits.chunk_rows, logits.temperature, entropy_grad
        )
    else:  # a trained projection: the model's own path, on the needed rows only
        z = _logits(flat, weight, logits.temperature)  # [n, V]
        picked = NextTokenLogprob.apply(z, flat_targets)
        if entropy_grad:
            entropy = entropy_of_logits(z, logits.chunk_rows)
        else:
            entropy = _entropy(z.detach(), logits.chunk_rows)
    entropy = _spread(entropy, index, shape)
    if training:
        logits.entropy, logits.entropy_rows = entropy.detach(), rows
    return _spread(picked, index, shape), entropy


def _flat_rows(hidden: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``hidden [B, S, H]``'s rows in ``rows`` (``[B, S]`` bool; None: all) as ``[n, H]``, and
    their flat index (None: all)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if rows is None:
        return flat, None
    index = rows.reshape(-1).nonzero().squeeze(-1)
    return flat.index_select(0, index), index


def _spread(values: Tensor, index: Tensor | None, shape: torch.Size) -> Tensor:
    """``[n]`` values computed at the flat ``index`` as ``[B, S]``, 0 elsewhere."""
    if index is None:
        return values.reshape(shape)
    return values.new_zeros(shape.numel()).index_copy(0, index, values).reshape(shape)


@torch.no_grad()
def _entropy(z: Tensor, rows: int) -> Tensor:
    """``[n]``: the entropy of ``softmax(z[i])`` for logits ``z [n, V]``, a chunk at a time."""
    out = z.new_empty(z.shape[0])
    for c in _chunks(z.shape[0], rows):
        logp = torch.log_softmax(z[c], dim=-1)
        out[c] = -torch.linalg.vecdot(logp.exp(), logp)
    return out


def _log_softmax_chunks(logits: HiddenLogits) -> Iterator[tuple[slice, Tensor]]:
    """Each chunk of flattened rows with its ``[c, V]`` fp32 log-softmax."""
    flat = logits.hidden.reshape(-1, logits.hidden.shape[-1])
    for c in _chunks(flat.shape[0], logits.chunk_rows):
        yield c, torch.log_softmax(_logits(flat[c], logits.weight, logits.temperature), dim=-1)


@torch.no_grad()
def next_token_entropy(logits: HiddenLogits, rows: Tensor | None = None) -> Tensor:
    """``[B, S]``: the entropy of the distribution of every row in ``rows`` (``[B, S]`` bool;
    None: all; 0 elsewhere), from the training pass when it covered them, else computed now."""
    done = logits.entropy_rows
    if logits.entropy is not None and (
        done is None or (rows is not None and not bool((rows & ~done).any()))
    ):
        return logits.entropy
    logits.require(rows)
    flat, index = _flat_rows(logits.hidden, rows)
    out = flat.new_empty(flat.shape[0], dtype=torch.float32)
    for c in _chunks(flat.shape[0], logits.chunk_rows):
        out[c] = _entropy(_logits(flat[c], logits.weight, logits.temperature), logits.chunk_rows)
    return _spread(out, index, logits.hidden.shape[:2])


@torch.no_grad()
def topk_next_token(logits: HiddenLogits, k: int) -> tuple[Tensor, Tensor]:
    """``[B, S, k]`` top-k log-probs and their token ids of every row, chunk by chunk."""
    logits.require(None)
    rows = logits.hidden.shape[:2]
    values = logits.hidden.new_empty(rows.numel(), k, dtype=torch.float32)
    indices = torch.empty(rows.numel(), k, dtype=torch.long, device=logits.hidden.device)
    for c, logp in _log_softmax_chunks(logits):
        values[c], indices[c] = logp.topk(k, dim=-1)
    return values.reshape(*rows, k), indices.reshape(*rows, k)
