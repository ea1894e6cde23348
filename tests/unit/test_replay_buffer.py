"""The async GRPO replay buffer: age filter, exact takes, eviction counts, capacity, order, the
checkpoint round trip, and the age bound over random push/take sequences."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.experience.replay_buffer import NotEnoughGroups, ReplayBuffer, ReplayBufferFull


def group(tag: int, rows: int = 2) -> BatchedDataDict:
    """A small prompt group whose contents identify it (``tag``)."""
    return BatchedDataDict(
        input_ids=torch.full((rows, 3), tag, dtype=torch.long),
        generation_logprobs=torch.full((rows, 3), -0.5 * tag),
        rewards=torch.tensor([float(tag)] * rows),
        finish_reasons=["stop"] * rows,
        message_logs=[[{"role": "user", "content": f"q{tag}"}] for _ in range(rows)],
    )


def tags(taken) -> list[int]:
    return [int(g.group["input_ids"][0, 0]) for g in taken]


def test_take_filters_by_age_and_counts_the_stale():
    buf = ReplayBuffer(max_size=10)
    for tag, version in [(1, 0), (2, 1), (3, 2), (4, 3), (5, 3)]:
        buf.push(group(tag), weight_version=version)
    # step 3, max_age 1: versions 2 and 3 are eligible; 0 and 1 are stale and go
    taken = buf.take(2, current_step=3, max_age=1)
    assert tags(taken) == [3, 4]
    assert [g.age(3) for g in taken] == [1, 0]
    assert buf.dropped_stale == 2 and len(buf) == 1
    assert buf.metrics() == {
        "train/avg_trajectory_age": 0.5,
        "train/max_trajectory_age": 1.0,
        "train/buffer_size": 1.0,
        "train/stale_groups_dropped": 2.0,
    }
    assert buf.pushed == 5 and buf.taken == 2


def test_take_is_exact_or_refuses_and_ready_says_which():
    buf = ReplayBuffer(max_size=4)
    buf.push(group(1), 0)
    buf.push(group(2), 0)
    assert buf.ready(2, current_step=0, max_age=0)
    assert not buf.ready(3, current_step=0, max_age=0)
    with pytest.raises(NotEnoughGroups, match="needs 3 groups .* holds 2"):
        buf.take(3, current_step=0, max_age=0)
    assert len(buf) == 2 and buf.taken == 0  # a refused take leaves the groups
    assert len(buf.take(2, current_step=0, max_age=0)) == 2 and len(buf) == 0
    with pytest.raises(ValueError, match="n=5 groups can never be met by a buffer of max_size=4"):
        buf.ready(5, current_step=0, max_age=0)


def test_ready_evicts_stale_groups_so_a_full_buffer_frees_the_producer():
    buf = ReplayBuffer(max_size=2)
    buf.push(group(1), 0)
    buf.push(group(2), 0)
    assert not buf.has_room()
    with pytest.raises(ReplayBufferFull, match="max_size=2"):
        buf.push(group(3), 1)
    assert len(buf) == 2 and buf.pushed == 2  # nothing was dropped to make room
    # step 2 with max_age 1: both groups are stale; ready evicts them and counts them
    assert not buf.ready(1, current_step=2, max_age=1)
    assert buf.has_room() and buf.dropped_stale == 2
    buf.push(group(3), 2)
    assert tags(buf.take(1, current_step=2, max_age=1)) == [3]
    assert buf.metrics()["train/stale_groups_dropped"] == 2.0  # evicted since the last take
    buf.push(group(4), 2)
    buf.take(1, current_step=2, max_age=1)
    assert buf.metrics()["train/stale_groups_dropped"] == 0.0


def test_order_is_oldest_version_first_then_fifo():
    buf = ReplayBuffer(max_size=8)
    for tag, version in [(1, 2), (2, 1), (3, 2), (4, 1), (5, 2)]:
        buf.push(group(tag), version)
    assert tags(buf.take(3, current_step=2, max_age=2)) == [2, 4, 1]
    assert tags(buf.take(2, current_step=2, max_age=2)) == [3, 5]


def test_steps_go_forward_and_versions_are_not_from_the_future():
    buf = ReplayBuffer(max_size=4)
    buf.push(group(1), 3)
    with pytest.raises(ValueError, match="weight version 3, newer than current_step=2"):
        buf.take(1, current_step=2, max_age=1)
    buf.take(1, current_step=3, max_age=1)
    with pytest.raises(ValueError, match="current_step=2 is behind step 3"):
        buf.ready(1, current_step=2, max_age=1)
    with pytest.raises(ValueError, match="weight_version=-1"):
        buf.push(group(2), -1)
    with pytest.raises(TypeError, match="mapping"):
        buf.push([1, 2], 0)  # type: ignore[arg-type]


def test_token_versions_must_tag_the_group_with_the_oldest():
    buf = ReplayBuffer(max_size=4)
    versions = torch.tensor([[-1, 4, 5], [-1, 5, 5]])
    with pytest.raises(ValueError, match=r"oldest of them \(4\).*weight_version=5"):
        buf.push(group(1), 5, token_versions=versions)
    buf.push(group(1), 4, token_versions=versions)
    (taken,) = buf.take(1, current_step=5, max_age=1)
    assert taken.age(5) == 1 and torch.equal(taken.token_versions, versions)


def _roundtrip(state: dict) -> dict:
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def _same_groups(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if (x.weight_version, x.seq, type(x.group)) != (y.weight_version, y.seq, type(y.group)):
            return False
        if sorted(x.group) != sorted(y.group):
            return False
        for key, value in x.group.items():
            other = y.group[key]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            if not same:
                return False
        if (x.token_versions is None) != (y.token_versions is None):
            return False
        if x.token_versions is not None and not torch.equal(x.token_versions, y.token_versions):
            return False
    return True


def test_state_round_trip_resumes_exactly():
    buf = ReplayBuffer(max_size=6)
    for tag, version in [(1, 0), (2, 0), (3, 1), (4, 1)]:
        buf.push(group(tag), version)
    buf.push(group(5), 1, token_versions=torch.tensor([[-1, 1, 2], [-1, 1, 1]]))
    buf.take(1, current_step=1, max_age=1)
    assert not buf.ready(5, current_step=2, max_age=1)  # evicts group 2 (version 0)
    assert tags(sorted(buf._groups, key=lambda g: g.seq)) == [3, 4, 5] and buf.dropped_stale == 1
    state = _roundtrip(buf.state_dict())

    resumed = ReplayBuffer(max_size=6)
    resumed.load_state_dict(state)
    assert _same_groups(resumed._groups, buf._groups)
    assert isinstance(resumed._groups[0].group, BatchedDataDict)
    for name in ("pushed", "taken", "dropped_stale"):
        assert getattr(resumed, name) == getattr(buf, name), name
    assert resumed.metrics() == buf.metrics()
    # the same further pushes and takes give the same groups and metrics
    for b in (buf, resumed):
        b.push(group(6), 2)
        b.push(group(7), 2)
    for step, n, want in [(2, 2, [3, 4]), (3, 1, [6])]:  # step 3 evicts group 5 (version 1)
        a, r = buf.take(n, step, 1), resumed.take(n, step, 1)
        assert _same_groups(a, r) and tags(a) == tags(r) == want
        assert buf.metrics() == resumed.metrics()
    assert resumed.metrics()["train/stale_groups_dropped"] == 1.0
    assert resumed.dropped_stale == buf.dropped_stale == 2 and len(resumed) == len(buf) == 1

    small = ReplayBuffer(max_size=1)
    with pytest.raises(ValueError, match="holds 3 groups, more than this buffer's max_size=1"):
        small.load_state_dict(state)


@settings(max_examples=200, deadline=None)
@given(
    max_age=st.integers(0, 3),
    n=st.integers(1, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["push", "take", "step"]), st.integers(0, 4)), max_size=60
    ),
)
def test_age_never_exceeds_the_bound_and_nothing_is_lost(max_age, n, ops):
    """Random producers (lagging by up to 4 versions) and a trainer taking whenever ready:
    every group taken is between 0 and max_age steps old, and every group pushed is taken,
    evicted as stale (counted) or still held."""
    buf = ReplayBuffer(max_size=6)
    step, seen = 0, 0
    for op, lag in ops:
        if op == "push" and buf.has_room():
            buf.push(group(seen), max(step - lag, 0))
            seen += 1
        elif op == "take" and buf.ready(n, step, max_age):
            for g in buf.take(n, step, max_age):
                assert 0 <= g.age(step) <= max_age
            assert buf.metrics()["train/max_trajectory_age"] <= max_age
        elif op == "step":
            step += 1
        assert buf.pushed == buf.taken + buf.dropped_stale + len(buf) == seen
        assert len(buf) <= buf.max_size
