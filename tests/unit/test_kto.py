"""KTO pieces without Ray: the loss against a hand computation (value, the reference point's
clamp and detach, the label weights), its sums adding up over micro-batches, unpaired rows
(the file format's bad rows, pairs unpaired), the KL rows `collate_kto` builds, TRL's weight
guidance, the config's refusals, and `kto_step` on a single-rank FSDP2PolicyWorker in this
process (the loss is exactly 0.5 while the policy equals its reference; a fixed batch is
learnt: desirable rows' rewards rise above undesirable ones').

The learning run (held-out pairs' log-prob accuracy rising from the reference's) is in
tests/functional/test_kto_learning.py.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from tempering.algorithms import kto
from tempering.config import KTOMasterConfig
from tempering.config.schemas import DataConfig
from tempering.data.records import DataFormatError
from tempering.data.unpaired import UnpairedExample, collate_kto, kl_partners, unpair
from tempering.losses import token_logprobs
from tempering.models.policy.training import aggregate_loss_metrics
from tempering.preference_losses import KTOLoss


def _batch(n: int, seq: int = 6, vocab: int = 11, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * n, seq)
    mask[:, 3:] = 1.0
    return {
        "input_ids": torch.randint(0, vocab, (2 * n, seq), generator=g),
        "token_mask": mask,
        "sample_mask": torch.ones(2 * n),
        "desirable": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0][:n]).repeat_interleave(2),
        "reference_policy_logprobs": -torch.rand(2 * n, seq, generator=g) * 3,
    }


def _by_hand(logits, data, beta, w_good, w_bad, kl=None):
    """Each row's summed log-ratio, the reference point and the mean per-example loss, in
    plain Python over the rows."""
    logp = token_logprobs(logits, data["input_ids"], data["token_mask"])
    n = data["input_ids"].shape[0] // 2
    ratio = [float(((logp[i] - data["reference_policy_logprobs"][i]) * data["token_mask"][i])
                   .sum()) for i in range(2 * n)]  # fmt: skip
    if kl is None:
        kl = max(0.0, sum(ratio[2 * i + 1] for i in range(n)) / n)
    total = 0.0
    for i in range(n):
        r = ratio[2 * i]
        if data["desirable"][2 * i] > 0.5:
            total += w_good * (1 - 1 / (1 + math.exp(-beta * (r - kl))))
        else:
            total += w_bad * (1 - 1 / (1 + math.exp(-beta * (kl - r))))
    return total / n, kl, ratio


@pytest.mark.parametrize("beta,w_good,w_bad", [(0.1, 1.0, 1.0), (0.7, 1.33, 0.5)])
def test_kto_loss_is_the_papers_formula(beta, w_good, w_bad):
    data = _batch(6)
    logits = torch.randn(12, 6, 11, generator=torch.Generator().manual_seed(1)) * 2
    loss, metrics = KTOLoss(beta, w_good, w_bad)(logits, data, None, torch.tensor(6.0))
    expected, kl, ratio = _by_hand(logits, data, beta, w_good, w_bad)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["kl"] == pytest.approx(kl, rel=1e-6)
    good = [ratio[2 * i] for i in range(6) if data["desirable"][2 * i] > 0.5]
    assert metrics["num_desirable"] == len(good) == 3
    assert metrics["rewards_desirable_sum"] == pytest.approx(beta * sum(good), rel=1e-5)


def test_the_reference_point_is_clamped_at_zero_and_carries_no_gradient():
    """With the KL rows' mean log-ratio below 0 the reference point is 0; above it, the
    gradient equals that of the same loss with the point as a constant (detached)."""
    data = _batch(6)
    data["reference_policy_logprobs"][1::2] = 0.0  # log-ratios of the KL rows < 0: clamped
    logits = torch.randn(12, 6, 11, generator=torch.Generator().manual_seed(2))
    _, metrics = KTOLoss(0.5)(logits, data, None, torch.tensor(6.0))
    assert metrics["kl"] == 0.0

    data = _batch(6)
    data["reference_policy_logprobs"][1::2] = -30.0  # KL rows far below: point > 0
    logits = (torch.randn(12, 6, 11, generator=torch.Generator().manual_seed(3))).requires_grad_()
    loss, metrics = KTOLoss(0.5)(logits, data, None, torch.tensor(6.0))
    assert metrics["kl"] > 1.0
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(grad[1::2]) == 0  # the KL rows: no gradient at all
    const = logits.detach().clone().requires_grad_()
    logp = token_logprobs(const, data["input_ids"], data["token_mask"])
    r = ((logp - data["reference_policy_logprobs"]) * data["token_mask"]).sum(-1)[0::2]
    good = data["desirable"][0::2] > 0.5
    point = torch.tensor(metrics["kl"])
    per = torch.where(good, 1 - torch.sigmoid(0.5 * (r - point)),
                      1 - torch.sigmoid(0.5 * (point - r)))  # fmt: skip
    (expected,) = torch.autograd.grad(per.mean(), const)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_sums_add_up_over_micro_batches():
    """Split in two micro-batches, the loss (globally normalised), the counts and the reward
    sums aggregate to the whole batch's: the per-label means `kto_step` derives are exact."""
    data = _batch(6)
    logits = torch.randn(12, 6, 11, generator=torch.Generator().manual_seed(4))
    loss_fn, n = KTOLoss(0.3), torch.tensor(6.0)
    halves = [loss_fn(logits[s], {k: v[s] for k, v in data.items()}, None, n)[1]
              for s in (slice(0, 6), slice(6, 12))]  # fmt: skip
    whole = aggregate_loss_metrics(halves)
    for key in ("num_desirable", "num_undesirable", "rewards_desirable_sum"):
        assert whole[key] == pytest.approx(sum(h[key] for h in halves))
    assert whole["num_desirable"] + whole["num_undesirable"] == whole["num_valid_pairs"] == 6
    # (the loss of each half uses that half's reference point, as TRL's per forward pass)
    assert whole["loss"] == pytest.approx(sum(h["loss"] for h in halves))


# ------------------------------------------------------------------------ rows
def _rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_unpaired_rows_load_and_bad_ones_are_named_or_counted(tmp_path):
    good = [{"prompt": f"Q: {i}+1=? A:", "completion": f" {i + 1}", "label": i % 3 != 0}
            for i in range(12)]  # fmt: skip
    bad = [*good[:2], {"prompt": "Q: 5+5=? A:", "completion": " 10", "label": 1},  # line 3
           *good[2:4], {"prompt": "Q: 6+6=? A:", "completion": "", "label": True}, *good[4:]]  # fmt: skip
    cfg = DataConfig(dataset_name="unpaired", train_data_path=str(_rows(tmp_path / "r.jsonl", bad)),
                     num_val_samples=4)  # fmt: skip
    with pytest.raises(DataFormatError, match=r"r.jsonl:3: field 'label' must be bool, got int"):
        kto.load_data(cfg)
    data = kto.load_data(cfg.model_copy(update={"on_bad_row": "skip"}))
    assert (len(data.train), len(data.val), data.num_skipped) == (8, 4, 2)
    assert any("r.jsonl:6" in reason and "empty" in reason for reason in data.skipped_reasons)
    assert not data.val_pairs  # no pairs to rank in a file of single rows
    assert {row.completion[0]["content"] for row in data.train + data.val} == {
        row["completion"] for row in good
    }


def test_pairs_unpair_into_a_desirable_and_an_undesirable_row():
    data = kto.load_data(DataConfig(dataset_name="arithmetic_parity", num_train_samples=8,
                                    num_val_samples=4))  # fmt: skip
    assert (len(data.train), len(data.val), len(data.val_pairs)) == (16, 8, 4)
    pair = data.val_pairs[1]
    assert data.val[2:4] == unpair([pair])
    assert (data.val[2].completion, data.val[2].desirable) == (pair.chosen, True)
    assert (data.val[3].completion, data.val[3].desirable) == (pair.rejected, False)


def test_a_kl_row_pairs_a_prompt_with_another_prompts_response(tmp_path):
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    def row(q: str, a: str, good: bool) -> UnpairedExample:
        return UnpairedExample([{"role": "user", "content": q}],
                               [{"role": "assistant", "content": a}], good)  # fmt: skip

    rows = [row("Q: 1+1=? A:", " 2", True), row("Q: 1+1=? A:", " 7", False),
            row("Q: 3+4=? A:", " 7", True), row("Q: 5+5=? A:", " 3", False)]  # fmt: skip
    assert kl_partners(rows) == [2, 2, 3, 0]  # the next row with ANOTHER prompt
    assert kl_partners(rows[:2]) == [0, 1]  # one prompt only: the rows themselves
    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    batch = collate_kto(rows, tokenizer, 32)
    lengths = batch["input_lengths"].tolist()
    text = [tokenizer.decode(ids[:n]) for ids, n in zip(batch["input_ids"], lengths, strict=True)]
    assert text[0].startswith("Q: 1+1=? A: 2") and text[1].startswith("Q: 1+1=? A: 7")
    assert text[7].startswith("Q: 5+5=? A: 2")  # the last row's partner is the first
    assert batch["desirable"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]


# ------------------------------------------------------------------------ config
def test_weights_outside_trls_guidance_are_warned_and_one_label_refused(caplog):
    rows = [UnpairedExample([], [], good) for good in [True] * 3 + [False] * 6]
    cfg = KTOMasterConfig()
    with caplog.at_level(logging.WARNING):
        assert kto.weight_ratio(cfg, rows) == pytest.approx(0.5)
    assert "= 0.50, outside the [1, 4/3]" in caplog.text
    assert "kto.desirable_weight=2.33 would make it 1.17" in caplog.text
    caplog.clear()
    cfg = KTOMasterConfig(kto={"desirable_weight": 2.33})
    assert kto.weight_ratio(cfg, rows) == pytest.approx(1.165)
    assert not caplog.text
    with pytest.raises(ValueError, match="all desirable .* add rows of the other label"):
        kto.weight_ratio(cfg, rows[:3])


def test_kto_config_refuses_what_it_does_not_read():
    with pytest.raises(ValueError, match="data.response_key='answer': KTO does not read it"):
        KTOMasterConfig(data={"response_key": "answer"})
    with pytest.raises(ValueError, match="'unpaired' reads your file"):
        KTOMasterConfig(data={"dataset_name": "unpaired"})
    with pytest.raises(ValueError, match="is not a KTO dataset"):
        KTOMasterConfig(data={"dataset_name": "squad"})
    with pytest.raises(ValueError, match="greater than 0"):
        KTOMasterConfig(kto={"beta": 0})


# ------------------------------------------------------------------------ worker
@pytest.fixture(scope="module")
def tiny_arith_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tempering.models.tiny_arith import build_untrained

    return str(build_untrained(tmp_path_factory.mktemp("tiny_arith"), seed=0))


def test_kto_step_starts_at_one_half_and_learns_a_fixed_batch(tiny_arith_dir, monkeypatch):
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = FSDP2PolicyWorker(tiny_arith_dir, learning_rate=1e-3, init_reference_model=True,
                               num_threads=1, seed=0)  # fmt: skip
    try:
        rows = kto.load_data(DataConfig(num_train_samples=8, num_val_samples=1)).train
        batch = collate_kto(rows, load_tokenizer(tiny_arith_dir), 32)
        loss_fn = KTOLoss(0.5)
        kwargs = {"global_batch_size": 32, "micro_batch_size": 8}
        first = kto.kto_step(worker, batch, loss_fn, **kwargs)
        # policy == reference: every reward 0, the point 0, each example's loss 1 - 1/2
        assert first["loss"] == pytest.approx(0.5, abs=1e-6)
        assert first["rewards_desirable_mean"] == first["rewards_undesirable_mean"] == 0
        assert (first["num_desirable"], first["num_undesirable"]) == (8, 8)
        last = first
        for _ in range(10):
            last = kto.kto_step(worker, batch, loss_fn, **kwargs)
        assert last["loss"] < 0.45
        assert last["rewards_desirable_mean"] > last["rewards_undesirable_mean"] + 0.1
        assert last["reward_accuracy"] > 0.8
        # validation's way: the reference's log-probs asked once and carried in the batch
        # (`preference.held_out_reference`) give what the per-micro-batch reference gives
        evals = kto.kto_step(worker, batch, loss_fn, eval_mode=True, **kwargs)
        carried = collate_kto(rows, load_tokenizer(tiny_arith_dir), 32)
        ref = worker.get_reference_policy_logprobs(carried)["reference_policy_logprobs"]
        carried["reference_policy_logprobs"] = ref
        kept = kto.kto_step(worker, carried, loss_fn, with_reference=False, eval_mode=True,
                            **kwargs)  # fmt: skip
        for key in ("loss", "kl", "rewards_desirable_mean", "rewards_undesirable_mean"):
            assert kept[key] == pytest.approx(evals[key], abs=1e-5), key
        assert evals["loss"] == pytest.approx(last["loss"], abs=0.05)  # no update in eval mode
    finally:
        worker.shutdown()


def test_the_reference_point_is_the_whole_micro_batch_of_every_rank(
    ray_session, tiny_arith_dir, monkeypatch
):
    """TRL gathers KTO's reference point over processes: two data-parallel ranks, each with one
    micro-batch of 4 examples, take the step one rank takes on all 8 (with each half's own
    point, per rank, the second step's loss was 0.36906 against 0.36819: measured)."""
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
    from tempering.models.policy.lm_policy import build_policy

    rows = kto.load_data(DataConfig(num_train_samples=4, num_val_samples=1)).train
    batch = collate_kto(rows, load_tokenizer(tiny_arith_dir), 32)  # 8 examples, 16 rows
    kwargs = {"learning_rate": 1e-2, "init_reference_model": True, "num_threads": 1, "seed": 0}
    loss_fn = KTOLoss(0.5)

    def two_steps(train):  # the first moves the policy off its reference (its point is 0)
        train(batch, loss_fn)
        return train(batch, loss_fn)

    cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.5, name="kto_point")
    policy = build_policy(cluster, tiny_arith_dir, train_global_batch_size=16,
                          train_micro_batch_size=8, **kwargs)  # fmt: skip
    try:
        two = two_steps(lambda b, f: kto.kto_step(policy, b, f))
    finally:
        policy.shutdown()
        cluster.shutdown()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TEMPERING_DIST_INIT_METHOD", raising=False)
    worker = FSDP2PolicyWorker(tiny_arith_dir, **kwargs)
    try:
        one = two_steps(lambda b, f: kto.kto_step(worker, b, f, global_batch_size=16,
                                                  micro_batch_size=16))  # fmt: skip
    finally:
        worker.shutdown()
    assert one["kl"] > 0.01  # the point is not clamped to 0: the gathering shows
    for key in ("loss", "kl", "grad_norm", "rewards_desirable_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
