"""BatchedDataDict: the batch format that crosses every worker boundary.

A ``BatchedDataDict`` is a plain ``dict`` whose values are all batch-major: tensors with the
batch on dim 0, or Python lists (message logs, strings, metadata) of the same length. Token
data follows docs/CONTRACTS.md: right-padded ``input_ids [B, S]`` with ``input_lengths [B]``.

The methods here are the data mechanics that the controller and the workers share:

- ``shard_by_batch_size``: split a batch over data-parallel workers (NeMo RL semantics), with
  ``merge_shards`` as the exact inverse;
- ``make_microbatches`` / ``make_microbatches_by_tokens``: fixed-size micro-batches, or
  dynamic ones under a padded-token budget (returns the permutation and
  ``from_microbatches`` puts results back in the original order);
- ``pack_sequences``: first-fit-decreasing packing into 1-D bins with ``cu_seqlens`` for
  padding-free (varlen) attention.

"Sequence keys" are the tensors with a token dimension (dim 1) to pad, trim or pack: by default
every tensor with ``ndim >= 2`` whose dim 1 equals the batch's padded length (that of
``input_ids`` if present, else the largest dim 1); pass ``seq_keys=`` to say it explicitly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Value = Any  # torch.Tensor (batch on dim 0) or list


def _as_index_list(idx: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(idx, torch.Tensor):
        return [int(i) for i in idx.reshape(-1).tolist()]
    return [int(i) for i in idx]


def _lengths_of(value: Value, key: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.ndim != 1:
            raise ValueError(
                f"BatchedDataDict: length key '{key}' must be 1-D [B], got shape {tuple(value.shape)}"
            )
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` in bins of at most ``capacity`` (each size <= capacity): largest
    first, each into the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


@dataclass
class PackedBin:
    """One bin of packed sequences (padding-free layout for varlen attention).

    ``indices[j]`` is the row of the source batch that sequence ``j`` came from;
    sequence ``j`` occupies ``cu_seqlens[j]:cu_seqlens[j+1]`` of every packed tensor.
    """

    indices: torch.Tensor  # LongTensor[n]
    input_ids: torch.Tensor  # LongTensor[T], T = sum of the n lengths
    position_ids: torch.Tensor  # LongTensor[T], restarts at 0 for each sequence
    cu_seqlens: torch.Tensor  # IntTensor[n + 1], cu_seqlens[0] = 0, cu_seqlens[-1] = T
    max_seqlen: int
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every packed sequence key (``input_ids`` included), each ``[T, ...]``."""

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def unpack(self, packed: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """``[T, ...]`` packed values (e.g. per-token log-probs) -> right-padded ``[n, max_seqlen, ...]``."""
        if packed.shape[0] != self.num_tokens:
            raise ValueError(
                f"PackedBin.unpack: got {packed.shape[0]} packed rows but this bin holds "
                f"{self.num_tokens} tokens"
            )
        n = len(self.indices)
        out = packed.new_full((n, self.max_seqlen, *packed.shape[1:]), pad_value)
        bounds = self.cu_seqlens.tolist()
        for j in range(n):
            out[j, : bounds[j + 1] - bounds[j]] = packed[bounds[j] : bounds[j + 1]]
        return out


def pack_in_order(data: BatchedDataDict) -> PackedBin:
    """Every row of ``data``, in order, as one bin of ``input_ids`` (a micro-batch computed
    without its padding; `PackedBin.unpack` gives back its rows in the same order)."""
    _require(data, "input_ids")
    lengths = [int(n) for n in data["input_lengths"].tolist()]
    return _bin(data, list(range(len(lengths))), lengths, ["input_ids"])


def _bin(data: BatchedDataDict, members: list[int], lens: list[int], keys: list[str]) -> PackedBin:
    """The rows ``members`` (of lengths ``lens``) of ``data`` packed back to back."""
    cu = torch.zeros(len(members) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    tokens = {
        k: torch.cat([data[k][i, :L] for i, L in zip(members, lens, strict=True)]) for k in keys
    }
    device = tokens["input_ids"].device
    return PackedBin(
        indices=torch.tensor(members, dtype=torch.long),
        input_ids=tokens["input_ids"],
        position_ids=torch.cat([torch.arange(L, device=device) for L in lens]),
        cu_seqlens=cu,
        max_seqlen=max(lens),
        tokens=tokens,
    )


def rows_tensor(rows: Sequence[Sequence[Any]], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A ``[R, C]`` tensor from ``R`` Python lists of equal length ``C``, through numpy:
    `torch.tensor` infers the type of every element of a nested list, 4-6x slower (a GRPO
    step's 128 x 17 token rows: 536 against 128 us)."""
    return torch.from_numpy(np.array(rows)).to(dtype)


def _as_array(value: Any) -> Any:
    """A CPU tensor's numpy view (shared memory), or None where numpy cannot hold it
    (bfloat16, GPU tensors, tensors that need grad, subclasses)."""
    if type(value) is not torch.Tensor or value.device.type != "cpu" or value.requires_grad:
        return None
    try:
        return value.numpy()
    except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks
        return None


def _rebuild(
    cls: type, order: list[str], plain: dict[str, Any], arrays: dict[str, Any]
) -> BatchedDataDict:
    """The inverse of `BatchedDataDict.__reduce__`: arrays back to tensors, in key order.
    Arrays that arrive read-only (Ray hands out zero-copy views of its object store) are
    copied, so the tensors can be written like any other."""
    out = cls()
    for key in order:
        if key in arrays:
            array = arrays[key]
            out[key] = torch.from_numpy(array if array.flags.writeable else array.copy())
        else:
            out[key] = plain[key]
    return out


class BatchedDataDict(dict):
    """A dict of batch-major tensors and lists, all of the same batch size.

    Pickled (every Ray call and result), CPU tensors travel as numpy arrays: torch's own
    pickling took 1.3 ms for a tiny SFT step's four small tensors and ships a view's whole
    storage (a shard of a batch carried the batch); numpy's goes out of band in Ray, costs
    microseconds and carries only the view. bfloat16 and GPU tensors keep torch's pickling."""

    def __reduce__(self) -> tuple[Any, ...]:
        plain: dict[str, Any] = {}
        arrays: dict[str, Any] = {}
        for key, value in self.items():
            array = _as_array(value)
            if array is None:
                plain[key] = value
            else:
                arrays[key] = array
        return (_rebuild, (type(self), list(self), plain, arrays))

    # ----------------------------------------------------------------- basics
    @property
    def size(self) -> int:
        """The batch size; raises if values disagree (naming every key and its length)."""
        sizes: dict[str, int] = {}
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                if value.ndim == 0:
                    raise ValueError(
                        f"BatchedDataDict: '{key}' is a 0-dim tensor; every value needs a batch "
                        f"dim 0 (use value.reshape(1) or keep it outside the batch)"
                    )
                sizes[key] = int(value.shape[0])
            elif isinstance(value, list | tuple):
                sizes[key] = len(value)
            else:
                raise TypeError(
                    f"BatchedDataDict: '{key}' has type {type(value).__name__}; values must be "
                    f"tensors (batch on dim 0) or lists"
                )
        if not sizes:
            return 0
        distinct = set(sizes.values())
        if len(distinct) > 1:
            listing = ", ".join(f"{k}={n}" for k, n in sizes.items())
            raise ValueError(f"BatchedDataDict: values have different batch sizes ({listing})")
        return distinct.pop()

    def to(self, device: torch.device | str) -> BatchedDataDict:
        """Tensors moved to ``device`` (lists unchanged); returns a new BatchedDataDict."""
        return BatchedDataDict(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()}
        )

    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Rows ``start:end`` of every value."""
        n = self.size
        if not 0 <= start <= end <= n:
            raise IndexError(f"BatchedDataDict.slice({start}, {end}) is out of range for size {n}")
        return BatchedDataDict({k: v[start:end] for k, v in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """Rows ``indices`` (in that order, repeats allowed) of every value."""
        n = self.size
        idx = _as_index_list(indices)
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            raise IndexError(
                f"BatchedDataDict.select_indices: indices {bad[:5]} out of range for size {n}"
            )
        out = BatchedDataDict()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[torch.tensor(idx, dtype=torch.long, device=v.device)]
            else:
                out[k] = [v[i] for i in idx]
        return out

    def repeat_interleave(self, n: int) -> BatchedDataDict:
        """Each row repeated ``n`` times in place (``[a, b] -> [a, a, b, b]`` for n=2).

        List items are deep-copied so the copies of one prompt can be changed independently
        (e.g. message logs that grow per rollout).
        """
        if n < 1:
            raise ValueError(f"BatchedDataDict.repeat_interleave: n={n} must be >= 1")
        _ = self.size  # validates
        out = BatchedDataDict()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(n, dim=0)
            else:
                out[k] = [copy.deepcopy(x) for x in v for _ in range(n)]
        return out

    # --------------------------------------------------------- concatenation
    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Value]],
        pad_value_dict: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict:
        """Concatenate batches along dim 0.

        Tensors of ``ndim >= 2`` whose dim 1 differs between batches are right-padded to the
        longest with ``pad_value_dict.get(key, 0)``; other dims must match.
        """
        if not batches:
            raise ValueError("BatchedDataDict.from_batches: got an empty list of batches")
        pad_value_dict = pad_value_dict or {}
        keys = list(batches[0].keys())
        for i, b in enumerate(batches):
            if set(b.keys()) != set(keys):
                raise ValueError(
                    f"BatchedDataDict.from_batches: batch {i} has keys {sorted(b.keys())}, "
                    f"batch 0 has {sorted(keys)}; every batch needs the same keys"
                )
        out = cls()
        for k in keys:
            values = [b[k] for b in batches]
            if all(isinstance(v, torch.Tensor) for v in values):
                out[k] = _cat_padded(k, values, pad_value_dict.get(k, 0))
            elif not any(isinstance(v, torch.Tensor) for v in values):
                out[k] = [x for v in values for x in v]
            else:
                raise TypeError(
                    f"BatchedDataDict.from_batches: '{k}' is a tensor in some batches and a list "
                    f"in others"
                )
        _ = out.size  # validates
        return out

    # --------------------------------------------------------------- sharding
    def shard_by_batch_size(
        self, shards: int, batch_size: int | None = None
    ) -> list[BatchedDataDict]:
        """Split into ``shards`` data-parallel shards.

        Without ``batch_size``: shard i is the i-th contiguous 1/shards of the data.
        With ``batch_size``: the data is cut into consecutive global batches of ``batch_size``
        and shard i gets the i-th contiguous 1/shards of EACH global batch, concatenated, so
        that iterating a shard in steps of ``batch_size // shards`` walks the global batches
        in order. ``merge_shards`` inverts this exactly.
        """
        n = self.size
        if shards < 1:
            raise ValueError(f"shard_by_batch_size: shards={shards} must be >= 1")
        if batch_size is None:
            if n % shards:
                raise ValueError(
                    f"shard_by_batch_size: batch size {n} is not divisible by shards={shards}; "
                    f"make the batch a multiple of the data-parallel size"
                )
            per = n // shards
            return [self.slice(i * per, (i + 1) * per) for i in range(shards)]
        if batch_size < 1 or n % batch_size:
            raise ValueError(
                f"shard_by_batch_size: data size {n} is not divisible by batch_size={batch_size}"
            )
        if batch_size % shards:
            raise ValueError(
                f"shard_by_batch_size: batch_size={batch_size} is not divisible by shards={shards} "
                f"(e.g. policy.train_global_batch_size must be a multiple of the data-parallel size)"
            )
        if shards == 1:  # the rows in order: views, not a gathered copy
            return [self.slice(0, n)]
        return [self.select_indices(idx) for idx in _shard_indices(n, shards, batch_size)]

    @classmethod
    def merge_shards(
        cls,
        shards: Sequence[Mapping[str, Value]],
        batch_size: int | None = None,
        pad_value_dict: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict:
        """Inverse of ``shard_by_batch_size`` (same ``batch_size``): results in the original order."""
        merged = cls.from_batches(shards, pad_value_dict)
        if batch_size is None:
            return merged
        n = merged.size
        if n % batch_size or batch_size % len(shards):
            raise ValueError(
                f"merge_shards: {len(shards)} shards of total size {n} cannot come from "
                f"batch_size={batch_size}"
            )
        order = [i for idx in _shard_indices(n, len(shards), batch_size) for i in idx]
        return merged.select_indices(_inverse_permutation(order))

    # ------------------------------------------------------------ micro-batches
    def make_microbatches(self, micro_batch_size: int) -> list[BatchedDataDict]:
        """Consecutive micro-batches of ``micro_batch_size`` rows (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"make_microbatches: micro_batch_size={micro_batch_size} must be >= 1")
        n = self.size
        return [self.slice(s, min(s + micro_batch_size, n)) for s in range(0, n, micro_batch_size)]

    def make_microbatches_by_tokens(
        self,
        max_tokens_per_mb: int,
        length_key: str = "input_lengths",
        seq_keys: Iterable[str] | None = None,
    ) -> tuple[list[BatchedDataDict], torch.Tensor]:
        """Dynamic batching under a padded-token budget.

        Rows are sorted by length (longest first) and greedily added to the current
        micro-batch while ``n_seqs * max_len_in_mb <= max_tokens_per_mb``. Each micro-batch's
        sequence keys are trimmed to its own longest sequence.

        Returns ``(microbatches, permutation)``: row j of the concatenated micro-batches is
        row ``permutation[j]`` of this batch. ``from_microbatches(results, permutation)`` puts
        per-micro-batch results back in the original order.
        """
        lengths = self._lengths_within(
            length_key, max_tokens_per_mb, "make_microbatches_by_tokens: max_tokens_per_mb",
            "the token budget",
        )  # fmt: skip
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            # Longest first, so the group's max length is that of its first member.
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens_per_mb:
                groups[-1].append(i)
            else:
                groups.append([i])
        keys = self._sequence_keys(seq_keys)
        mbs = []
        for g in groups:
            mb = self.select_indices(g)
            max_len = max(lengths[i] for i in g)
            for k in keys:
                mb[k] = mb[k][:, :max_len]
            mbs.append(mb)
        return mbs, torch.tensor(order, dtype=torch.long)

    @classmethod
    def from_microbatches(
        cls,
        microbatches: Sequence[Mapping[str, Value]],
        permutation: torch.Tensor | Sequence[int],
        pad_value_dict: Mapping[str, float | int] | None = None,
    ) -> BatchedDataDict:
        """Concatenate (padding dim 1) per-micro-batch results and undo ``permutation``."""
        merged = cls.from_batches(microbatches, pad_value_dict)
        return merged._restore_order(permutation)

    def _restore_order(self, permutation: torch.Tensor | Sequence[int]) -> BatchedDataDict:
        """Row j of self is original row ``permutation[j]``; returns rows in the original order."""
        perm = _as_index_list(permutation)
        if len(perm) != self.size or sorted(perm) != list(range(len(perm))):
            raise ValueError(
                f"from_microbatches: permutation of length {len(perm)} is not a permutation of "
                f"range({self.size})"
            )
        return self.select_indices(_inverse_permutation(perm))

    # --------------------------------------------------------------- packing
    def pack_sequences(
        self,
        max_tokens_per_bin: int,
        length_key: str = "input_lengths",
        seq_keys: Iterable[str] | None = None,
    ) -> list[PackedBin]:
        """First-fit-decreasing packing of the unpadded sequences into bins of at most
        ``max_tokens_per_bin`` tokens. Every sequence key is packed (``input_ids`` is required).
        """
        _require(self, "input_ids")
        lengths = self._lengths_within(
            length_key, max_tokens_per_bin, "pack_sequences: max_tokens_per_bin", "the bin size"
        )
        keys = self._sequence_keys(seq_keys)
        if "input_ids" not in keys:
            keys.insert(0, "input_ids")
        bins = first_fit_decreasing(lengths, max_tokens_per_bin)
        return [_bin(self, members, [lengths[i] for i in members], keys) for members in bins]

    # --------------------------------------------------------------- helpers
    def _lengths_within(self, length_key: str, limit: int, where: str, fix: str) -> list[int]:
        """The rows' lengths; a ValueError naming the first row over ``limit`` and the fix.
        ``where`` is ``"<method>: <limit's name>"``."""
        lengths = _lengths_of(self[_require(self, length_key)], length_key)
        too_long = [(i, L) for i, L in enumerate(lengths) if L > limit]
        if too_long:
            i, L = too_long[0]
            method, limit_name = where.split(": ")
            raise ValueError(
                f"{method}: sequence {i} has {length_key}={L} > {limit_name}={limit} "
                f"({len(too_long)} such sequences); raise {fix} to at least "
                f"{max(L for _, L in too_long)}"
            )
        return lengths

    def _sequence_keys(self, seq_keys: Iterable[str] | None) -> list[str]:
        if seq_keys is not None:
            keys = list(seq_keys)
            for k in keys:
                v = self[_require(self, k)]
                if not isinstance(v, torch.Tensor) or v.ndim < 2:
                    raise ValueError(
                        f"BatchedDataDict: sequence key '{k}' must be a tensor [B, S, ...]"
                    )
            return keys
        tensors = {k: v for k, v in self.items() if isinstance(v, torch.Tensor) and v.ndim >= 2}
        if not tensors:
            return []
        if "input_ids" in tensors:
            seq_len = tensors["input_ids"].shape[1]
        else:
            seq_len = max(v.shape[1] for v in tensors.values())
        return [k for k, v in tensors.items() if v.shape[1] == seq_len]

    def __repr__(self) -> str:
        parts = []
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k}: Tensor{list(v.shape)} {v.dtype}")
            else:
                parts.append(f"{k}: list[{len(v)}]")
        return "BatchedDataDict(" + ", ".join(parts) + ")"


def _require(data: Mapping[str, Value], key: str) -> str:
    if key not in data:
        raise KeyError(f"BatchedDataDict: missing key '{key}' (has {sorted(data)})")
    return key


def _inverse_permutation(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for j, i in enumerate(perm):
        inv[i] = j
    return inv


def _shard_indices(n: int, shards: int, batch_size: int) -> list[list[int]]:
    per = batch_size // shards
    return [
        [start + s * per + j for start in range(0, n, batch_size) for j in range(per)]
        for s in range(shards)
    ]


def _cat_padded(key: str, values: list[torch.Tensor], pad_value: float | int) -> torch.Tensor:
    ndims = {v.ndim for v in values}
    if len(ndims) > 1:
        raise ValueError(
            f"from_batches: '{key}' has different ranks across batches: {sorted(ndims)}"
        )
    if values[0].ndim < 2:
        return torch.cat(values)
    if len({tuple(v.shape[2:]) for v in values}) > 1:
        shapes = [tuple(v.shape) for v in values]
        raise ValueError(f"from_batches: '{key}' shapes differ beyond dim 1: {shapes}")
    width = max(v.shape[1] for v in values)
    padded = []
    for v in values:
        if v.shape[1] < width:
            pad = v.new_full((v.shape[0], width - v.shape[1], *v.shape[2:]), pad_value)
            v = torch.cat([v, pad], dim=1)
        padded.append(v)
    return torch.cat(padded)
