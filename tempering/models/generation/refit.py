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

from typing import Any

DEFAULT_BUCKET_MB = 512


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
