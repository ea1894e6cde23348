"""Padding-free micro-batches (`microbatching.PaddingFree`): a micro-batch whose padding costs
more than its rows' own attention calls runs its rows, in order, as one packed row -- the same
losses, gradients and log-probs as its padded rows, chosen only where the cost model says so."""

from __future__ import annotations

import dataclasses

import pytest
import test_lora
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict, PackedBin
from tempering.losses import NLLLoss
from tempering.models.policy.microbatching import PaddingFree
from tempering.models.policy.shared_prefix import plan_shared_prefix
from tests.tiny_models import save_tiny_llama

lone_rank = test_lora.lone_rank  # the fixture: a worker built in this process
SMOLLM2 = PaddingFree(ratio=2.57e-4, per_sequence=5.6)  # model_setup's costs for SmolLM2-135M
TINY_ARITH = PaddingFree(ratio=1.6e-3, per_sequence=83.0)  # and for tiny-arith


def _rows(lengths: list[int], prefix: list[int] | None = None, seed: int = 0) -> BatchedDataDict:
    """Right-padded rows of the given lengths (random ids, or ``prefix`` then random)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 100, (n,), generator=g)
        if prefix:
            ids[i, : len(prefix)] = torch.tensor(prefix)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    mask[:, :3] = 0  # a prompt
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(lengths),
        token_mask=mask,
        sample_mask=torch.ones(len(lengths)),
    )


def test_the_cost_model_picks_padding_free_only_where_it_pays() -> None:
    # GSM8K SFT rows on SmolLM2: 45% padding, sequences long enough to carry their calls
    uneven = _rows([512, 369, 226, 316, 284, 240, 129, 166])
    assert SMOLLM2.cheaper(uneven, None)
    # tiny-arith's arithmetic rows: 128 rows of ~12 tokens, 3% padding: the calls cost more
    short = _rows([12] * 100 + [11] * 28)
    assert not TINY_ARITH.cheaper(short, None)
    # rows of one length have no padding to save
    assert not SMOLLM2.cheaper(_rows([300] * 8), None)
    # GRPO groups sharing a 150-token prompt: the shared-prefix plan computes less
    prompt = list(range(1, 151))
    grpo = _rows([150 + n for n in (90, 40, 128, 70, 100, 20, 128, 60)], prefix=prompt)
    plan = plan_shared_prefix(grpo["input_ids"], grpo["input_lengths"], SMOLLM2.ratio)
    assert plan is not None and not SMOLLM2.cheaper(grpo, plan)


def test_padding_free_steps_equal_padded_steps(lone_rank, tmp_path) -> None:
    """Two SFT steps of a worker that runs every micro-batch padding-free (a zero
    per-sequence cost), and its log-probs after them, equal the same worker's on padded rows
    (the weights are compared through those log-probs: AdamW turns a gradient's last-bit
    difference into a visible one where the gradient is near zero)."""
    save_tiny_llama(tmp_path)
    batches = [_rows([30, 7, 19, 4, 26, 11], seed=s) for s in (0, 1)]
    results = []
    for free in (True, False):
        worker = lone_rank(str(tmp_path))
        costs = worker.forward_pass.padding_free
        assert costs is not None and costs.per_sequence > 0  # the tiny model's calls count
        fp = dataclasses.replace(
            worker.forward_pass,
            shared_prefix=None,
            padding_free=dataclasses.replace(costs, per_sequence=0.0) if free else None,
        )
        worker.forward_pass = fp
        layout = fp.split(batches[0], None, None)[1][0]
        assert isinstance(layout, PackedBin) == free
        if free:
            assert layout.num_tokens == 97 and layout.indices.tolist() == list(range(6))
        steps = [worker.train(b, NLLLoss(), global_batch_size=6) for b in batches]
        logprobs = worker.get_logprobs(batches[0])["logprobs"]
        results.append((steps, logprobs))
    (free_steps, free_lp), (padded_steps, padded_lp) = results
    for a, b in zip(free_steps, padded_steps, strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    torch.testing.assert_close(free_lp, padded_lp, atol=1e-5, rtol=0)
    assert free_lp[0, 1:30].abs().min() > 0 and free_lp[1, 7:].abs().max() == 0
