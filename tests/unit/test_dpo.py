"""DPO pieces without Ray: preference data through the DPO loader (bad rows, skip counts),
batch-size checks, the likelihood preference metric, DPOLoss micro-batch invariance, and
`dpo_step` on a single-rank FSDP2PolicyWorker built in this process (reference log-probs
computed before the update, frozen, and the loss going down on a fixed batch).

DPOLoss and BradleyTerryLoss parity with an independent hand computation (loss AND
gradient, 1e-6) lives in test_losses.py.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tempering.algorithms.dpo import dpo_step, likelihood_preference_accuracy
from tempering.algorithms.preference import (
    check_pair_batch_sizes,
    load_preference_data,
    preference_batch,
)
from tempering.config.schemas import DataConfig
from tempering.data.records import DataFormatError
from tempering.losses import token_logprobs
from tempering.preference_losses import DPOLoss, count_valid_pairs, orpo_log_odds_ratio


# ------------------------------------------------------------------------ data
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [
    {"prompt": f"Q: {i}+1=? A:", "chosen": f" {i + 1}", "rejected": f" {i + 3}"} for i in range(8)
]


@pytest.fixture
def bad_file(tmp_path: Path) -> Path:
    rows = list(GOOD)
    rows.insert(2, {"prompt": "Q: 5+5=? A:", "chosen": "", "rejected": " 11"})  # line 3: empty
    rows.insert(5, {"prompt": "Q: 6+6=? A:", "chosen": " 12", "rejected": " 12"})  # line 6: same
    return write_jsonl(tmp_path / "prefs.jsonl", rows)


def test_bad_row_is_an_error_naming_file_and_line(bad_file: Path):
    cfg = DataConfig(dataset_name="preference", train_data_path=str(bad_file))
    with pytest.raises(DataFormatError, match=rf"{bad_file.name}:3: .*empty"):
        load_preference_data(cfg)


def test_bad_rows_skipped_and_counted(bad_file: Path):
    cfg = DataConfig(
        dataset_name="preference",
        train_data_path=str(bad_file),
        on_bad_row="skip",
        num_val_samples=2,
    )
    data = load_preference_data(cfg)
    assert data.num_skipped == 2
    assert len(data.train) + len(data.val) == len(GOOD)
    assert len(data.val) == 2
    assert any(f"{bad_file.name}:3:" in r and "empty" in r for r in data.skipped_reasons)
    assert any(f"{bad_file.name}:6:" in r and "identical" in r for r in data.skipped_reasons)


def test_separate_val_file_is_used(tmp_path: Path):
    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    val = write_jsonl(tmp_path / "val.jsonl", GOOD[:3])
    cfg = DataConfig(dataset_name="preference", train_data_path=str(train), val_data_path=str(val))
    data = load_preference_data(cfg)
    assert (len(data.train), len(data.val)) == (8, 3)


def test_unknown_dataset_and_missing_path_are_explained():
    with pytest.raises(ValueError, match="data.dataset_name='squad' is not a preference"):
        load_preference_data(DataConfig(dataset_name="squad"))
    with pytest.raises(ValueError, match="needs data.train_data_path"):
        load_preference_data(DataConfig(dataset_name="helpsteer3"))


def test_arithmetic_pairs_are_synthetic_correct_vs_corrupted():
    data = load_preference_data(DataConfig(num_train_samples=20, num_val_samples=10))
    assert (len(data.train), len(data.val), len(data.val_problems)) == (20, 10, 10)
    for pair, problem in zip(data.val, data.val_problems, strict=True):
        assert pair.prompt[0]["content"] == problem["prompt"]
        assert pair.chosen[0]["content"] == " " + problem["answer"]
        assert pair.rejected[0]["content"] != pair.chosen[0]["content"]


def test_batch_size_checks_name_the_values():
    check_pair_batch_sizes(64, 16, 2, "x")
    with pytest.raises(
        ValueError, match="global batch 30 rows .* multiple of 2 x data-parallel size \\(4\\)"
    ):
        check_pair_batch_sizes(30, 2, 2, "x")
    with pytest.raises(ValueError, match="micro batch 3 even"):
        check_pair_batch_sizes(64, 3, 1, "x")


# --------------------------------------------------------------------- metrics
def test_dpo_loss_type_and_label_smoothing_are_read_or_refused():
    """The loss the config names reaches DPOLoss; a smoothing the hinge or IPO loss would
    ignore is refused with the fix, as is an unknown loss."""
    from tempering.algorithms.dpo import make_loss
    from tempering.config.schemas import DPOMasterConfig

    cfg = DPOMasterConfig(dpo={"loss_type": "robust", "label_smoothing": 0.1})
    loss = make_loss(cfg)
    assert (loss.preference_loss_type, loss.label_smoothing) == ("robust", 0.1)
    with pytest.raises(ValueError, match=r"dpo.label_smoothing=0.1 has no effect with "
                                         r"dpo.loss_type=ipo.*dpo.label_smoothing=0"):  # fmt: skip
        DPOMasterConfig(dpo={"loss_type": "ipo", "label_smoothing": 0.1})
    with pytest.raises(ValueError, match="loss_type"):
        DPOMasterConfig(dpo={"loss_type": "kto"})
    with pytest.raises(ValueError, match="use one of sigmoid, hinge, ipo, robust, simpo, orpo"):
        DPOLoss(0.1, preference_loss_type="kto")
    with pytest.raises(ValueError, match=r"dpo.simpo_gamma=0.3 is read by dpo.loss_type=simpo"):
        DPOMasterConfig(dpo={"simpo_gamma": 0.3})
    with pytest.raises(ValueError, match=r"set dpo.preference_average_log_probs=true"):
        DPOMasterConfig(dpo={"loss_type": "simpo"})
    simpo = DPOMasterConfig(dpo={"loss_type": "simpo", "preference_average_log_probs": True,
                                 "simpo_gamma": 0.3})  # fmt: skip
    loss = make_loss(simpo)
    assert simpo.dpo.reference_free and not loss.needs_reference and loss.gamma == 0.3
    assert make_loss(cfg).needs_reference
    orpo = {"loss_type": "orpo", "preference_average_log_probs": True}
    with pytest.raises(ValueError, match=r"drops the SFT part: set dpo.sft_loss_weight=1"):
        DPOMasterConfig(dpo=orpo)
    with pytest.raises(ValueError, match=r"loss_type=orpo .*set dpo.label_smoothing=0"):
        DPOMasterConfig(dpo={**orpo, "sft_loss_weight": 1.0, "label_smoothing": 0.1})
    orpo = DPOMasterConfig(dpo={**orpo, "sft_loss_weight": 1.0})
    loss = make_loss(orpo)
    assert orpo.dpo.reference_free and not loss.needs_reference
    assert (loss.preference_loss_type, loss.sft_loss_weight) == ("orpo", 1.0)


def test_the_report_speaks_of_a_reference_only_where_there_is_one():
    from tempering.algorithms.dpo import report
    from tempering.config.schemas import DPOMasterConfig

    summary = {"steps": 4, "final_model": "out/final_hf",
               "start": {"logprob_accuracy": 0.5, "preference_accuracy": 0.0,
                         "reference_logprob_accuracy": 0.5},
               "end": {"logprob_accuracy": 0.9, "preference_accuracy": 0.8,
                       "reference_logprob_accuracy": 0.5}}  # fmt: skip
    dpo = report(summary, DPOMasterConfig())
    assert "frozen reference already ranks right): 0.500" in dpo and "0.500 -> 0.900" in dpo
    for m in summary.values():
        if isinstance(m, dict):
            m.pop("reference_logprob_accuracy")
            m["preference_accuracy"] = m["logprob_accuracy"]
    simpo = report(summary, DPOMasterConfig(dpo={"loss_type": "simpo",
                                                 "preference_average_log_probs": True}))  # fmt: skip
    assert "frozen reference" not in simpo and "by construction" not in simpo
    assert "no reference model: dpo.loss_type=simpo" in simpo and "0.500 -> 0.900" in simpo


def test_likelihood_preference_accuracy_hand_worked():
    # 3 pairs; response tokens at positions 1..2; pair 2 masked out
    logprobs = torch.tensor(
        [
            [0, -1.0, -1.0],
            [0, -2.0, -0.5],
            [0, -3.0, -0.1],
            [0, -1.0, -1.0],
            [0, -9.0, 0],
            [0, 0, 0],
        ]
    )
    token_mask = torch.tensor([[0, 1, 1]] * 6, dtype=torch.float)
    batch = {"token_mask": token_mask, "sample_mask": torch.tensor([1.0, 1, 1, 1, 0, 1])}
    # sums: pair0 -2 vs -2.5 (win), pair1 -3.1 vs -2 (loss), pair2 masked
    assert likelihood_preference_accuracy(logprobs, batch, average=False) == 0.5
    token_mask[0, 2] = 0  # chosen mean -1 vs rejected mean -1.25: still a win
    assert likelihood_preference_accuracy(logprobs, batch, average=True) == 0.5


# ------------------------------------------------------------------ DPOLoss
def test_dpo_loss_microbatch_split_equals_full_batch():
    """Two micro-batches of pairs, each divided by the GLOBAL pair count, sum to the full
    batch's loss and gradient (what the worker relies on)."""
    g = torch.Generator().manual_seed(3)
    B, S, V = 8, 6, 7
    ids = torch.randint(0, V, (B, S), generator=g)
    token_mask = torch.zeros(B, S)
    token_mask[:, 2:] = 1
    sample_mask = torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1])  # pair 1 invalid
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    ref = token_logprobs(logits, ids) + torch.rand(B, S, generator=g, dtype=torch.float64) - 0.5
    data = {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "reference_policy_logprobs": ref,
    }
    loss_fn = DPOLoss(0.2, sft_loss_weight=0.3)
    pairs = count_valid_pairs(sample_mask)
    full = logits.clone().requires_grad_(True)
    loss_full, _ = loss_fn(full, data, torch.tensor(0.0), pairs)
    loss_full.backward()
    split = logits.clone().requires_grad_(True)
    total = 0.0
    for lo, hi in ((0, 4), (4, 8)):
        part = {k: v[lo:hi] for k, v in data.items()}
        loss, _ = loss_fn(split[lo:hi], part, torch.tensor(0.0), pairs)
        total = total + loss
    total.backward()
    assert total.item() == pytest.approx(loss_full.item(), abs=1e-12)
    assert torch.allclose(split.grad, full.grad, atol=1e-12)


def test_dpo_loss_at_reference_is_log2_plus_sft():
    """Policy == reference: every margin is 0, so the preference loss is exactly log 2 and its
    gradient w.r.t. each margin is -1/2 (per pair, / number of pairs)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (4, 5), generator=g)
    logits = torch.randn(4, 5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    token_mask = torch.ones(4, 5)
    lp = token_logprobs(logits.detach(), ids)
    data = {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(4),
        "reference_policy_logprobs": lp,
    }
    loss, m = DPOLoss(0.5, sft_loss_weight=0.25)(logits, data, torch.tensor(0.0), torch.tensor(2.0))
    sft = -(lp[0] * token_mask[0]).sum() - (lp[2] * token_mask[2]).sum()
    assert m["preference_loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert loss.item() == pytest.approx(math.log(2) + 0.25 * sft.item() / 2, abs=1e-10)
    assert m["preference_accuracy"] == 0.0 and m["reward_margin"] == 0.0


# ------------------------------------------------------- dpo_step on a worker
@pytest.fixture(scope="module")
def tiny_arith_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tempering.models.tiny_arith import build_untrained

    return str(build_untrained(tmp_path_factory.mktemp("tiny_arith"), seed=0))


@pytest.fixture
def worker(tiny_arith_dir: str, monkeypatch: pytest.MonkeyPatch):
    """A single-rank FSDP2PolicyWorker in this process (no Ray needed for one rank)."""
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    w = FSDP2PolicyWorker(
        tiny_arith_dir, learning_rate=3e-3, init_reference_model=True, num_threads=1, seed=0
    )
    yield w
    w.shutdown()


def test_dpo_step_uses_frozen_reference_and_learns_a_fixed_batch(worker, tiny_arith_dir):
    from tempering.models.hf import load_tokenizer

    tokenizer = load_tokenizer(tiny_arith_dir)
    pairs = load_preference_data(DataConfig(num_train_samples=16, num_val_samples=1)).train
    batch = preference_batch(pairs, tokenizer, 32)
    assert batch.size == 32 and torch.equal(batch["sample_mask"], torch.ones(32))
    ref0 = worker.get_logprobs(batch)["logprobs"]
    loss_fn = DPOLoss(0.1)
    first = dpo_step(worker, batch, loss_fn, global_batch_size=32, micro_batch_size=8)
    # the reference log-probs (computed in the train call, before the update) equal the
    # initial policy's: every implicit reward is 0, so the loss is log 2
    assert first["preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    reference_accuracy = likelihood_preference_accuracy(ref0, batch, False)
    assert first["reference_logprob_accuracy"] == pytest.approx(reference_accuracy)
    last = first
    for _ in range(15):
        last = dpo_step(worker, batch, loss_fn, global_batch_size=32, micro_batch_size=8)
    ref_now = worker.get_reference_policy_logprobs(batch)["reference_policy_logprobs"]
    assert torch.allclose(ref_now, ref0, atol=1e-5)  # frozen
    assert last["reference_logprob_accuracy"] == pytest.approx(reference_accuracy)
    assert last["preference_loss"] < first["preference_loss"] - 0.1
    assert last["preference_accuracy"] >= 0.9
    assert last["reward_margin"] > 0
    # the implicit reward is beta * (logp - logp_ref): chosen up relative to rejected
    assert last["rewards_chosen_mean"] > last["rewards_rejected_mean"]
    # the policy's own ranking, from the loss (validation reads it there)
    evals = dpo_step(
        worker, batch, loss_fn, eval_mode=True, global_batch_size=32, micro_batch_size=8
    )
    policy_accuracy = likelihood_preference_accuracy(
        worker.get_logprobs(batch)["logprobs"], batch, False
    )
    assert evals["logprob_accuracy"] == pytest.approx(policy_accuracy)
    assert policy_accuracy > reference_accuracy  # it learnt: the two figures differ
    # validation's way: the reference's log-probs asked once and carried in the batch
    # (`preference.held_out_reference`) give what the per-micro-batch reference gives
    carried = preference_batch(pairs, tokenizer, 32)
    carried["reference_policy_logprobs"] = ref_now
    kept = worker.train(carried, loss_fn, eval_mode=True, global_batch_size=32, micro_batch_size=8)
    for key in ("loss", "preference_accuracy", "reward_margin", "logprob_accuracy",
                "reference_logprob_accuracy"):  # fmt: skip
        assert kept[key] == pytest.approx(evals[key], abs=1e-5), key


def test_held_out_reference_is_asked_once_a_run():
    """Neither the frozen reference nor the held-out rows change: validations after the first
    run the policy alone."""
    from types import SimpleNamespace

    from tempering.algorithms.preference import PreferenceRun, held_out_reference

    asked = []

    def reference_logprobs(batch):
        asked.append(batch)
        return {"reference_policy_logprobs": torch.full((2, 3), float(len(asked)))}

    run = PreferenceRun(None, {}, "dpo", None, None, None, None)
    run.model = SimpleNamespace(get_reference_policy_logprobs=reference_logprobs)
    first = held_out_reference(run, "rows")
    assert held_out_reference(run, "rows") is first and len(asked) == 1
    assert torch.equal(held_out_reference(run, "pairs", "pairs"), torch.full((2, 3), 2.0))
    assert held_out_reference(run, "rows") is first and len(asked) == 2


def parity_pairs(path: Path, n: int, seed: int) -> str:
    """Pairs whose chosen answer is an even number and rejected an odd one: a preference an
    untrained model holds at chance and learns in a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        even, odd = 2 * rng.randint(5, 49), 2 * rng.randint(5, 49) + 1
        rows.append({"prompt": f"Q: {a}+{b}=? A:", "chosen": f" {even}", "rejected": f" {odd}"})
    return str(write_jsonl(path, rows))


# (loss_type, label_smoothing, preference_average_log_probs): the held-out log-ratio
# difference d = (logp_c - ref_c) - (logp_r - ref_r) each one settles at, beta = 0.5
DPO_KIND_TARGETS = {
    ("sigmoid", 0.0, False): "unbounded",  # -logsigmoid keeps pulling: d grows
    ("sigmoid", 0.1, False): "smoothed",  # conservative DPO: optimum at beta*d = log(0.9/0.1)
    ("robust", 0.1, False): "unbounded",
    ("hinge", 0.0, False): "margin",  # no gradient once beta*d >= 1
    ("ipo", 0.0, True): "ipo",  # mean per-token d regressed to 1 / (2 beta)
    ("simpo", 0.0, True): "simpo",  # no reference: the policy's own mean margin past gamma/beta
    ("orpo", 0.0, True): "orpo",  # no reference: chosen's NLL down, and the log odds ratio up
}


@pytest.mark.parametrize("kind,eps,average", list(DPO_KIND_TARGETS))
def test_each_dpo_loss_learns_held_out_pairs_and_settles_where_its_paper_says(
    tiny_arith_dir, tmp_path, monkeypatch, kind, eps, average
):
    """40 steps of 16 parity pairs from an untrained tiny-arith: the held-out log-prob accuracy
    (the policy's own preference) rises from chance by >= 25 points under every loss type, and
    each loss leaves the held-out log-ratio difference where its objective puts it -- so a
    `dpo.loss_type` that fell back to another loss would fail here."""
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    beta = 0.5
    data = load_preference_data(DataConfig(
        dataset_name="preference", train_data_path=parity_pairs(tmp_path / "t.jsonl", 640, 0),
        val_data_path=parity_pairs(tmp_path / "v.jsonl", 128, 1)))  # fmt: skip
    tokenizer = load_tokenizer(tiny_arith_dir)
    val = preference_batch(data.val, tokenizer, 32)
    loss_fn = DPOLoss(beta, preference_average_log_probs=average, preference_loss_type=kind,
                      label_smoothing=eps, sft_loss_weight=1.0 if kind == "orpo" else 0.0)  # fmt: skip
    w = FSDP2PolicyWorker(tiny_arith_dir, learning_rate=1e-3, num_threads=1, seed=0,
                          init_reference_model=loss_fn.needs_reference)  # fmt: skip
    try:
        ref = w.get_logprobs(val)["logprobs"]
        for step in range(40):
            batch = preference_batch(data.train[16 * step : 16 * step + 16], tokenizer, 32)
            dpo_step(w, batch, loss_fn, global_batch_size=32, micro_batch_size=32)
        logprobs = w.get_logprobs(val)["logprobs"]
    finally:
        w.shutdown()
    start = likelihood_preference_accuracy(ref, val, False)
    end = likelihood_preference_accuracy(logprobs, val, False)
    assert 0.35 <= start <= 0.65 and end >= start + 0.25, (start, end)
    mask = val["token_mask"].float()
    per_seq = ((logprobs - (ref if loss_fn.needs_reference else 0)) * mask).sum(-1)
    if average:
        per_seq = per_seq / mask.sum(-1)
    d = float((per_seq[0::2] - per_seq[1::2]).mean())
    smoothed_optimum = math.log((1 - 0.1) / 0.1) / beta  # 4.39
    target = DPO_KIND_TARGETS[(kind, eps, average)]
    if target == "unbounded":
        assert d > 2 * smoothed_optimum, d
    elif target == "smoothed":
        assert abs(d - smoothed_optimum) < 1.5, d
    elif target == "margin":
        assert d >= 1 / beta, d
    elif target == "simpo":
        assert d > loss_fn.gamma / beta, d
    elif target == "orpo":  # measured: odds ratio 2.95, chosen +4.59 nats (others 0.25-1.77)
        lp_end, lp_start = per_seq, (ref * mask).sum(-1) / mask.sum(-1)
        odds = float(orpo_log_odds_ratio(lp_end[0::2], lp_end[1::2]).mean())
        chosen_gain = float((lp_end - lp_start)[0::2].mean())  # the SFT term's pull
        assert odds > 1 and chosen_gain > 3, (odds, chosen_gain)
    else:
        assert abs(d - 1 / (2 * beta)) < 0.3, d
