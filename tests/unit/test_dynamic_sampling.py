"""DAPO dynamic sampling refill logic and overlong filtering on hand-made groups."""

from __future__ import annotations

import logging

import pytest
import torch

from tempering.algorithms.dynamic_sampling import (
    DynamicSampler,
    concat_batches,
    dynamic_sample,
    mask_overlong_samples,
    nonconstant_group_mask,
)

G = 2


def round_batch(prompt_ids: list[int], rewards: list[float], seq_len: int = 3) -> dict:
    """Groups of G samples per prompt; input_ids rows carry the prompt id for tracing."""
    n = len(rewards)
    assert n == len(prompt_ids) * G
    rows = [p for p in prompt_ids for _ in range(G)]
    return {
        "input_ids": torch.tensor(rows).unsqueeze(-1).expand(n, seq_len).clone(),
        "rewards": torch.tensor(rewards),
        "prompt": [f"p{p}" for p in rows],
        "sample_mask": torch.ones(n),
    }


def test_nonconstant_group_mask():
    mask = nonconstant_group_mask(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert mask.tolist() == [False, True, False]


def test_refill_until_full_then_truncate():
    # round 0: prompts 0,1,2 -> rewards (1,1) (0,1) (0,0) -> keeps prompt 1
    # round 1: prompts 3,4,5 -> (1,0) (0,0) (1,0)         -> keeps prompts 3 and 5 (total 3)
    # target 2 -> prompt 5 is discarded as extra; rounds stop after round 1
    rounds = [
        round_batch([0, 1, 2], [1, 1, 0, 1, 0, 0], seq_len=3),
        round_batch([3, 4, 5], [1, 0, 0, 0, 1, 0], seq_len=5),  # longer rows: padded concat
        round_batch([6, 7, 8], [1, 0, 1, 0, 1, 0]),
    ]
    calls = []

    def next_round(i: int) -> dict:
        calls.append(i)
        return rounds[i]

    result = dynamic_sample(next_round, num_prompts_per_step=2, group_size=G, max_rounds=3)
    assert calls == [0, 1]
    assert result.num_groups_kept == 2 and result.shortfall == 0
    assert result.batch["prompt"] == ["p1", "p1", "p3", "p3"]
    assert result.batch["input_ids"].shape == (4, 5)
    assert result.batch["input_ids"][0].tolist() == [1, 1, 1, 0, 0]  # right-padded with 0
    assert result.batch["rewards"].tolist() == [0.0, 1.0, 1.0, 0.0]
    m = result.metrics
    assert m["dynamic_sampling/rounds"] == 2
    assert m["dynamic_sampling/groups_seen"] == 6
    assert m["dynamic_sampling/groups_filtered"] == 3  # (1,1), (0,0), (0,0)
    assert m["dynamic_sampling/groups_discarded_extra"] == 1
    assert m["dynamic_sampling/shortfall"] == 0


def test_shortfall_is_returned_and_logged(caplog):
    sampler = DynamicSampler(num_prompts_per_step=3, group_size=G, max_rounds=2)
    assert sampler.needs_more()
    assert sampler.add(round_batch([0, 1], [0, 0, 1, 0])) == 1
    assert sampler.needs_more()
    assert sampler.add(round_batch([2, 3], [1, 1, 0, 0])) == 0
    assert not sampler.needs_more() and not sampler.is_full()
    with pytest.raises(RuntimeError, match="max_rounds=2"):
        sampler.add(round_batch([4], [0, 1]))
    with caplog.at_level(logging.WARNING):
        result = sampler.result()
    assert result.num_groups_kept == 1 and result.shortfall == 2
    assert result.batch["prompt"] == ["p1", "p1"]
    assert result.metrics["dynamic_sampling/shortfall"] == 2
    assert "2 groups short" in caplog.text


def test_pad_to_target_fills_shortfall_with_masked_groups():
    # target 3; round 0 keeps prompt 1 (prompt 0 is constant), round 1 keeps nothing
    sampler = DynamicSampler(num_prompts_per_step=3, group_size=G, max_rounds=2)
    sampler.add(round_batch([0, 1], [0, 0, 1, 0]))
    sampler.add(round_batch([2, 3], [1, 1, 0, 0]))
    result = sampler.result(pad_to_target=True)
    assert result.shortfall == 2 and result.num_groups_kept == 1
    # real group first, then the first two dropped groups (prompts 0 and 2) masked out
    assert result.batch["prompt"] == ["p1", "p1", "p0", "p0", "p2", "p2"]
    assert result.batch["sample_mask"].tolist() == [1, 1, 0, 0, 0, 0]
    assert result.group_is_real.tolist() == [True, False, False]
    assert result.metrics["dynamic_sampling/padded_groups"] == 2
    # without padding the same sampler state yields only the real group
    assert sampler.result().batch["prompt"] == ["p1", "p1"]
    # batches without a sample_mask get one: ones for real groups, zeros for padding
    sampler = DynamicSampler(num_prompts_per_step=2, group_size=G, max_rounds=1)
    unmasked = round_batch([0, 1], [0, 1, 1, 1])
    del unmasked["sample_mask"]
    sampler.add(unmasked)
    assert sampler.result(pad_to_target=True).batch["sample_mask"].tolist() == [1, 1, 0, 0]


def test_nothing_kept_gives_no_batch_and_full_shortfall():
    result = dynamic_sample(
        lambda i: round_batch([i], [1, 1]), num_prompts_per_step=1, group_size=G, max_rounds=3
    )
    assert result.batch is None and result.shortfall == 1
    assert result.metrics["dynamic_sampling/rounds"] == 3


def test_result_keeps_mapping_type_and_validates_input():
    class MyBatch(dict):
        pass

    sampler = DynamicSampler(1, G, 1)
    sampler.add(MyBatch(round_batch([0], [0, 1])))
    assert type(sampler.result().batch) is MyBatch
    with pytest.raises(KeyError, match="rewards"):
        DynamicSampler(1, G, 1).add({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="groups of 2"):
        DynamicSampler(1, G, 1).add({"rewards": torch.zeros(3)})


def test_concat_batches_pads_and_joins_lists():
    a = {"x": torch.ones(1, 2), "y": ["a"]}
    b = {"x": torch.full((2, 3), 2.0), "y": ["b", "c"]}
    out = concat_batches([a, b])
    assert out["x"].tolist() == [[1, 1, 0], [2, 2, 2], [2, 2, 2]]
    assert out["y"] == ["a", "b", "c"]


def test_mask_overlong_samples():
    batch = {
        "finish_reasons": ["stop", "length", "length", "stop"],
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
    }
    out, n = mask_overlong_samples(batch)
    assert out["sample_mask"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert n == 1  # sample 2 was already masked
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 1.0]  # input untouched
    out, n = mask_overlong_samples({"finish_reasons": ["length", "stop"]})
    assert out["sample_mask"].tolist() == [0.0, 1.0] and n == 1
    with pytest.raises(KeyError, match="finish_reasons"):
        mask_overlong_samples({"sample_mask": torch.ones(2)})
