"""Refit: the policy's new weights into generation workers of their own, streamed.

The policy workers agree on a list of buckets -- consecutive state-dict entries, cut only
between decoder layers (vLLM's in-place reload needs a layer whole) and at most
``bucket_mb`` each (a larger layer is a bucket of its own). For each bucket every policy rank
joins the all-gathers of its sharded tensors; rank 0 casts them to the generator's dtype
(bf16 for a bf16 engine: half the bytes of fp32) and puts them into Ray's object store; every
generation worker fetches that one object and loads it in place. The next bucket is gathered
while the workers load the current one. Nothing passes through the controller, and no process
ever holds more than a bucket or two: the old way -- the whole fp32 state dict gathered on
rank 0 and put at once -- held a full fp32 copy in rank 0 and in the object store.

    stream_weights(policy, generation_group, dtype="bfloat16")  -> bytes moved
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

DEFAULT_BUCKET_MB = 512


def cast_for_sampling(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``t`` in a sampler's ``dtype``. fp32 -> bf16 rounds stochastically with a draw fixed per
    element (seeded by ``name``), not to nearest: E[cast] = t, values already on the bf16 grid
    stay exact, and the same weights always give the same bf16 copy.

    Why not round to nearest: a checkpoint whose fp32 weights sit exactly halfway between two
    bf16 values (8% of SmolLM2's, dequantized from GGUF) rounds each tie one way; the first
    optimizer step moves every weight by ~lr in its gradient's direction, and each tie then
    rounds the other way wherever the step points there -- half a bf16 step (~1e-4) on 8% of
    the weights, all along the gradient: the bf16 sampler ran far ahead of the fp32 trainer
    (SmolLM2 GRPO, lr 1e-6: token_mult_prob_error 1.03 before the first update, 1.16-1.28
    after; lr 1e-8 alike). A fixed draw spreads each element's rounding threshold over the
    whole bf16 step, so a small update flips a fraction ~update/step of the weights, the
    expected move equals the update, and the copy tracks the trainer as an fp32 one would.
    Other dtype pairs are cast as torch does."""
    if t.dtype != torch.float32 or dtype != torch.bfloat16:
        return t.to(dtype)
    draw = torch.Generator(device=t.device).manual_seed(zlib.crc32(name.encode()))
    low = torch.randint(0, 1 << 16, t.shape, generator=draw, dtype=torch.int32, device=t.device)
    bits = t.detach().contiguous().view(torch.int32)
    # the low 16 bits are bf16's rounding remainder: adding a uniform draw carries into the
    # kept bits with probability remainder / 2^16 (sign-magnitude: the magnitude rounds)
    return ((bits + low) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)


def stream_weights(
    policy: Any,
    worker_group: Any,
    dtype: str | None,
    bucket_mb: int = DEFAULT_BUCKET_MB,
    method: str = "update_weights",
) -> int:
    """Load the policy's weights (its ``refit`` handle, `RefittablePolicy`) into every worker
    of ``worker_group`` by its ``method`` (``update_weights``, or ``stage_weights`` for an
    in-flight update that ``commit_weights`` ends); returns the bytes put into the object
    store."""
    buckets = policy.refit.buckets(bucket_mb * 2**20)
    moved = 0
    pending: list[Any] = []  # the generation workers' loads of the previous bucket
    for names in buckets:
        ref, nbytes = policy.refit.bucket(names, dtype)  # gathered while the last one loads
        worker_group.get_all_worker_results(pending)
        pending = worker_group.run_all_workers_single_data(method, ref)
        moved += nbytes
    worker_group.get_all_worker_results(pending)
    return moved
