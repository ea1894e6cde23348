"""BatchedDataDict: shapes, order-restoring invariants (randomized with torch.Generator) and errors."""

from __future__ import annotations

import pytest
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict


def _batch(n: int, seq: int, gen: torch.Generator, min_len: int = 1) -> BatchedDataDict:
    """Right-padded token batch with a per-row id so order can be checked exactly."""
    lengths = torch.randint(min_len, seq + 1, (n,), generator=gen)
    ids = torch.randint(1, 1000, (n, seq), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    ids = ids * mask  # 0 = padding
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=mask.float(),
        row=torch.arange(n),
        text=[f"sample-{i}" for i in range(n)],
    )


def _assert_equal(a: BatchedDataDict, b: BatchedDataDict) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_size_slice_select_and_errors() -> None:
    b = _batch(6, 5, torch.Generator().manual_seed(0))
    assert b.size == 6
    s = b.slice(2, 5)
    assert (
        s.size == 3
        and s["row"].tolist() == [2, 3, 4]
        and s["text"] == ["sample-2", "sample-3", "sample-4"]
    )
    sel = b.select_indices([5, 0, 0])
    assert sel["row"].tolist() == [5, 0, 0] and sel["text"] == ["sample-5", "sample-0", "sample-0"]
    assert sel["input_ids"].shape == (3, 5)
    with pytest.raises(IndexError, match="out of range"):
        b.select_indices([6])
    bad = BatchedDataDict(a=torch.zeros(3), b=[1, 2])
    with pytest.raises(ValueError, match=r"a=3, b=2"):
        _ = bad.size
    with pytest.raises(TypeError, match="'x' has type int"):
        _ = BatchedDataDict(x=3).size
    assert BatchedDataDict().size == 0


def test_repeat_interleave_copies_lists() -> None:
    b = BatchedDataDict(x=torch.tensor([[1, 1], [2, 2]]), logs=[[{"c": "a"}], [{"c": "b"}]])
    r = b.repeat_interleave(3)
    assert r["x"][:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert [m[0]["c"] for m in r["logs"]] == ["a", "a", "a", "b", "b", "b"]
    r["logs"][0].append({"c": "new"})  # growing one rollout's log must not touch the others
    assert len(r["logs"][1]) == 1 and len(b["logs"][0]) == 1
    with pytest.raises(ValueError, match="n=0"):
        b.repeat_interleave(0)


def test_from_batches_pads_dim1() -> None:
    a = BatchedDataDict(
        ids=torch.ones(2, 3, dtype=torch.long), n=torch.tensor([1, 2]), t=["a", "b"]
    )
    b = BatchedDataDict(ids=torch.full((1, 5), 7), n=torch.tensor([3]), t=["c"])
    m = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -1})
    assert m["ids"].shape == (3, 5)
    assert m["ids"][0].tolist() == [1, 1, 1, -1, -1] and m["ids"][2].tolist() == [7] * 5
    assert m["n"].tolist() == [1, 2, 3] and m["t"] == ["a", "b", "c"]
    assert BatchedDataDict.from_batches([a, b])["ids"][1].tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="same keys"):
        BatchedDataDict.from_batches([a, BatchedDataDict(ids=torch.ones(1, 3))])
    with pytest.raises(ValueError, match="empty"):
        BatchedDataDict.from_batches([])


def test_shard_by_batch_size_semantics() -> None:
    b = BatchedDataDict(row=torch.arange(12), t=list(range(12)))
    # No batch_size: contiguous quarters.
    assert [s["row"].tolist() for s in b.shard_by_batch_size(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
    ]
    # batch_size=6, 2 shards: global batches [0..5], [6..11]; shard i gets its half of each.
    shards = b.shard_by_batch_size(2, batch_size=6)
    assert shards[0]["row"].tolist() == [0, 1, 2, 6, 7, 8]
    assert shards[1]["row"].tolist() == [3, 4, 5, 9, 10, 11]
    assert shards[1]["t"] == [3, 4, 5, 9, 10, 11]
    with pytest.raises(ValueError, match="12 is not divisible by shards=5"):
        b.shard_by_batch_size(5)
    with pytest.raises(ValueError, match="data size 12 is not divisible by batch_size=5"):
        b.shard_by_batch_size(1, batch_size=5)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by shards=4"):
        b.shard_by_batch_size(4, batch_size=6)


def test_shard_merge_roundtrip_randomized() -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        shards = int(torch.randint(1, 5, (1,), generator=gen))
        per = int(torch.randint(1, 4, (1,), generator=gen))
        n_batches = int(torch.randint(1, 4, (1,), generator=gen))
        bs = shards * per
        b = _batch(bs * n_batches, 7, gen)
        use_bs = bool(torch.randint(0, 2, (1,), generator=gen))
        parts = b.shard_by_batch_size(shards, batch_size=bs if use_bs else None)
        assert len(parts) == shards and all(p.size == per * n_batches for p in parts)
        # Every row lands in exactly one shard.
        assert sorted(torch.cat([p["row"] for p in parts]).tolist()) == list(range(b.size))
        merged = BatchedDataDict.merge_shards(parts, batch_size=bs if use_bs else None)
        _assert_equal(merged, b)


def test_make_microbatches() -> None:
    b = BatchedDataDict(row=torch.arange(7))
    mbs = b.make_microbatches(3)
    assert [m["row"].tolist() for m in mbs] == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        b.make_microbatches(0)


def test_microbatches_by_tokens_budget_trim_and_restore_randomized() -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(30):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        seq = int(torch.randint(2, 30, (1,), generator=gen))
        b = _batch(n, seq, gen)
        budget = int(torch.randint(seq, 4 * seq, (1,), generator=gen))
        mbs, perm = b.make_microbatches_by_tokens(budget)
        assert sorted(perm.tolist()) == list(range(n))
        assert sum(m.size for m in mbs) == n
        for m in mbs:
            max_len = int(m["input_lengths"].max())
            assert m.size * max_len <= budget  # padded-token budget respected
            assert m["input_ids"].shape[1] == max_len  # trimmed to its own max length
            assert m["token_mask"].shape[1] == max_len
            assert m["row"].ndim == 1  # 1-D keys untouched
        # Greedy fill: each micro-batch could not take the next (shorter) sequence.
        for m, nxt in zip(mbs, mbs[1:], strict=False):
            assert (m.size + 1) * int(m["input_lengths"].max()) > budget
            assert int(nxt["input_lengths"].max()) <= int(m["input_lengths"].min())
        # Per-micro-batch "results" go back to the original order.
        results = [
            BatchedDataDict(row=m["row"], ids=m["input_ids"] * 2, t=list(m["text"])) for m in mbs
        ]
        restored = BatchedDataDict.from_microbatches(results, perm)
        assert restored["row"].tolist() == list(range(n))
        assert restored["t"] == b["text"]
        assert torch.equal(restored["ids"], (b["input_ids"] * 2)[:, : restored["ids"].shape[1]])


def test_microbatches_by_tokens_errors() -> None:
    b = BatchedDataDict(input_ids=torch.ones(2, 10), input_lengths=torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"sequence 1 has input_lengths=10 > max_tokens_per_mb=8"):
        b.make_microbatches_by_tokens(8)
    with pytest.raises(KeyError, match="missing key 'lens'"):
        b.make_microbatches_by_tokens(20, length_key="lens")
    with pytest.raises(ValueError, match="not a permutation"):
        BatchedDataDict.from_microbatches([b], [0, 0])


def test_pack_sequences_randomized() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        seq = int(torch.randint(1, 20, (1,), generator=gen))
        b = _batch(n, seq, gen)
        cap = int(torch.randint(seq, 3 * seq + 1, (1,), generator=gen))
        bins = b.pack_sequences(cap)
        seen = torch.cat([p.indices for p in bins]).tolist()
        assert sorted(seen) == list(range(n))
        lengths = b["input_lengths"]
        for p in bins:
            lens = lengths[p.indices]
            assert p.cu_seqlens.dtype == torch.int32 and len(p.cu_seqlens) == len(p.indices) + 1
            assert p.cu_seqlens[0] == 0 and torch.equal(p.cu_seqlens[1:].long(), lens.cumsum(0))
            assert (
                p.num_tokens <= cap and p.input_ids.ndim == 1 and len(p.input_ids) == p.num_tokens
            )
            assert p.max_seqlen == int(lens.max())
            for j, i in enumerate(p.indices.tolist()):
                s, e = int(p.cu_seqlens[j]), int(p.cu_seqlens[j + 1])
                L = int(lengths[i])
                assert torch.equal(p.input_ids[s:e], b["input_ids"][i, :L])
                assert p.position_ids[s:e].tolist() == list(range(L))
                assert torch.equal(p.tokens["token_mask"][s:e], b["token_mask"][i, :L])
            # unpack gives back the right-padded rows.
            unpacked = p.unpack(p.input_ids)
            assert torch.equal(unpacked, b["input_ids"][p.indices, : p.max_seqlen])
        # First-fit-decreasing: no two bins could have been merged into one.
        if len(bins) > 1:
            sizes = sorted(p.num_tokens for p in bins)
            assert sizes[0] + sizes[1] > cap


def test_pack_sequences_ffd_exact_and_errors() -> None:
    lengths = torch.tensor([6, 5, 4, 3, 2])  # FFD into bins of 10: [6,4], [5,3,2]
    b = BatchedDataDict(input_ids=torch.arange(50).reshape(5, 10), input_lengths=lengths)
    bins = b.pack_sequences(10)
    assert [p.indices.tolist() for p in bins] == [[0, 2], [1, 3, 4]]
    assert bins[1].cu_seqlens.tolist() == [0, 5, 8, 10]
    assert bins[0].position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="sequence 0 has input_lengths=6 > max_tokens_per_bin=5"):
        b.pack_sequences(5)
    with pytest.raises(ValueError, match="holds 10 tokens"):
        bins[0].unpack(torch.zeros(3))


def test_to_device_keeps_lists() -> None:
    b = BatchedDataDict(x=torch.ones(2), t=["a", "b"])
    moved = b.to("cpu")
    assert isinstance(moved, BatchedDataDict) and moved["t"] == ["a", "b"]
    assert moved["x"].device.type == "cpu"


def test_pickling_ships_tensors_as_arrays_and_only_a_views_elements():
    """Every Ray call pickles its BatchedDataDict: CPU tensors go as numpy arrays (torch's own
    pickling was 1.3 ms for a tiny SFT step's batch, and ships a view's whole storage)."""
    import pickle

    full = torch.arange(10_000).reshape(1000, 10)
    data = BatchedDataDict(
        ids=full[:4],  # a shard: a view of the whole batch
        half=torch.ones(4, 3, dtype=torch.bfloat16),  # numpy has no bf16: torch's pickling
        mask=torch.tensor([True, False, True, True]),
        text=["a", "b", "c", "d"],
    )
    blob = pickle.dumps(data)
    assert len(blob) < full.numel() * full.element_size() // 10  # not the whole storage
    back = pickle.loads(blob)
    assert type(back) is BatchedDataDict and list(back) == list(data)
    for key in ("ids", "half", "mask"):
        assert back[key].dtype == data[key].dtype and torch.equal(back[key], data[key])
    assert back["text"] == data["text"]
    back["ids"] += 1  # its own memory, writable
    assert int(full[0, 0]) == 0


def test_batches_through_rays_object_store_come_back_writable(ray_session):
    """A large batch lives in Ray's object store, whose zero-copy arrays are read-only: the
    tensors rebuilt from them are copies that can be written in place."""
    import ray

    data = BatchedDataDict(x=torch.zeros(256, 1024))  # 1 MiB: stored out of line
    back = ray.get(ray.put(data))
    back["x"] += 1
    assert float(back["x"].sum()) == 256 * 1024 and float(data["x"].sum()) == 0


def test_rows_tensor_equals_torch_tensor_of_the_rows():
    """The numpy route builds exactly what torch.tensor builds from nested lists: same dtype,
    shape and values (floats rounded to float32 the same way)."""
    from tempering.distributed.batched_data_dict import rows_tensor

    ints = [[1, 2, 3], [2**40, -5, 0]]
    floats = [[0.1, -1.5, 1e-8], [3.0, 0.0, 2.0 / 3.0]]
    for rows, dtype in ((ints, torch.long), (floats, torch.float32), (ints, torch.float32)):
        got, want = rows_tensor(rows, dtype), torch.tensor(rows, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
