"""FSDP2PolicyWorker built directly in the test process (one rank, gloo, CPU, fp32), and the
LR schedules of `tempering.models.policy.optim`.

Multi-rank behaviour (DP gradient parity, sharded checkpoints) is in test_policy_parity.py and
test_lm_policy.py, which run workers in Ray actors.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.logits import as_logits
from tempering.losses import NLLLoss
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.models.policy.optim import build_lr_scheduler, build_optimizer, lr_multiplier
from tests.tiny_models import save_tiny_llama

VOCAB = 100


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path, max_position_embeddings=64)
    return str(path)


def make_batch(lengths: list[int], seed: int = 1, width: int = 12) -> BatchedDataDict:
    """Right-padded random tokens; loss on positions >= 3 (a 'prompt' of 3), one masked sample."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(1, VOCAB, (b, width), generator=g)
    lens = torch.tensor(lengths)
    valid = torch.arange(width)[None, :] < lens[:, None]
    ids = ids * valid  # padding token 0
    token_mask = valid.float()
    token_mask[:, :3] = 0
    sample_mask = torch.ones(b)
    sample_mask[1] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=token_mask, sample_mask=sample_mask
    )


def reference_logprobs(
    model_dir: str, data: BatchedDataDict, temperature: float = 1.0
) -> torch.Tensor:
    """Independent computation: plain unsharded HF forward + log_softmax + gather."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, lens = data["input_ids"], data["input_lengths"]
    valid = torch.arange(ids.shape[1])[None, :] < lens[:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=valid.long()).logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = torch.zeros(ids.shape)
    for b in range(ids.shape[0]):
        for t in range(1, int(lens[b])):
            out[b, t] = logp[b, t - 1, ids[b, t]]
    return out


LENGTHS = [12, 7, 9, 4, 11, 5]


@pytest.mark.parametrize(
    "mb_kwargs",
    [
        {"micro_batch_size": 4},
        {"max_tokens_per_microbatch": 24},
        {"max_tokens_per_microbatch": 24, "pack_sequences": True},
    ],
    ids=["fixed", "dynamic", "packed"],
)
def test_get_logprobs_matches_unsharded_forward(make_worker, tiny_llama_dir, mb_kwargs) -> None:
    worker = make_worker(init_optimizer=False)
    data = make_batch(LENGTHS)
    for temperature in (1.0, 0.7):
        got = worker.get_logprobs(data, temperature=temperature, **mb_kwargs)["logprobs"]
        want = reference_logprobs(tiny_llama_dir, data, temperature)
        assert got.shape == data["input_ids"].shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert torch.all(got[:, 0] == 0)


def _weights(worker: FSDP2PolicyWorker) -> dict[str, torch.Tensor]:
    """Copies of the full weights: on CPU the gathered state dict can alias the parameters,
    so a dict taken before a step would change with it."""
    return {k: v.clone() for k, v in worker.refit.state_dict().items()}


def _params_after_one_step(worker: FSDP2PolicyWorker, data: BatchedDataDict, **kw) -> dict:
    metrics = worker.train(data, NLLLoss(), global_batch_size=data.size, **kw)
    return {"metrics": metrics, "params": worker.refit.state_dict()}


def test_micro_batching_equals_one_big_batch(make_worker) -> None:
    """Gradient accumulation over micro-batches (fixed, by tokens, packed) == one batch (SGD)."""
    data = make_batch(LENGTHS)
    runs = {}
    for name, kw in {
        "one": {"micro_batch_size": 6},
        "three": {"micro_batch_size": 2},
        "tokens": {"max_tokens_per_microbatch": 20},
        "packed": {"max_tokens_per_microbatch": 20, "pack_sequences": True},
    }.items():
        worker = make_worker(optimizer="sgd", learning_rate=1.0, max_grad_norm=None)
        runs[name] = _params_after_one_step(worker, data, **kw)
    initial = AutoModelForCausalLM.from_pretrained(worker.state.source.model_path).state_dict()
    base = runs["one"]
    # The step moved the weights (so the comparison below is not vacuous).
    moved = max((base["params"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3
    for name in ("three", "tokens", "packed"):
        assert runs[name]["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], abs=1e-6)
        for key, value in base["params"].items():
            torch.testing.assert_close(runs[name]["params"][key], value, atol=1e-5, rtol=0)


def test_train_metrics_and_multiple_global_batches(make_worker) -> None:
    data = make_batch(LENGTHS)
    worker = make_worker(learning_rate=1e-2, max_grad_norm=0.5)
    first = worker.train(data, NLLLoss(), global_batch_size=3, micro_batch_size=2)
    assert first["num_steps"] == 2.0
    assert first["num_tokens"] == float(sum(LENGTHS))
    # valid tokens: positions >= 3 inside each length, sample 1 masked out
    assert first["num_valid_tokens"] == float(sum(L - 3 for i, L in enumerate(LENGTHS) if i != 1))
    assert first["tokens_per_s"] > 0
    assert math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0
    assert first["lr"] == pytest.approx(1e-2)
    # Initial loss of a random model over 100 tokens is about ln(100).
    assert 3.0 < first["loss"] < 6.0
    for _ in range(5):
        last = worker.train(data, NLLLoss(), global_batch_size=6, micro_batch_size=3)
    assert last["loss"] < first["loss"] - 0.3
    # eval_mode computes the loss without changing the weights
    before = _weights(worker)
    ev1 = worker.train(data, NLLLoss(), global_batch_size=6, eval_mode=True)
    ev2 = worker.train(data, NLLLoss(), global_batch_size=6, eval_mode=True)
    assert ev1["loss"] == pytest.approx(ev2["loss"], abs=1e-7)
    after = _weights(worker)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_global_batch_size_errors_name_the_fix(make_worker) -> None:
    worker = make_worker()
    with pytest.raises(ValueError, match="global_batch_size=4"):
        worker.train(make_batch(LENGTHS), NLLLoss(), global_batch_size=4)


def test_reference_model_stays_frozen(make_worker, tiny_llama_dir) -> None:
    data = make_batch(LENGTHS)
    worker = make_worker(init_reference_model=True, learning_rate=1e-2)
    for _ in range(2):
        worker.train(data, NLLLoss(), global_batch_size=6, micro_batch_size=6)
    want = reference_logprobs(tiny_llama_dir, data)
    ref = worker.get_reference_policy_logprobs(data, micro_batch_size=4)[
        "reference_policy_logprobs"
    ]
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=0)
    cur = worker.get_logprobs(data, micro_batch_size=4)["logprobs"]
    assert (cur - want).abs().max() > 1e-2


def test_reference_logprobs_without_reference_model_errors(make_worker) -> None:
    worker = make_worker(init_optimizer=False)
    with pytest.raises(RuntimeError, match="init_reference_model=True"):
        worker.get_reference_policy_logprobs(make_batch(LENGTHS))


# ------------------------------------------------------------------- LR schedules
def test_lr_schedules_shapes() -> None:
    kw = dict(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_multiplier(s, schedule="constant", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, schedule="constant", **kw) == 1.0
    assert lr_multiplier(100, schedule="constant", **kw) == 1.0
    assert lr_multiplier(4, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(9, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(14, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(50, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(6, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.8)


def test_scheduler_drives_optimizer_lr_and_validates() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], lr=1.0)
    sched = build_lr_scheduler(opt, schedule="linear", warmup_steps=2, total_steps=6)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="total_steps"):
        build_lr_scheduler(opt, schedule="cosine", warmup_steps=5, total_steps=None)
    with pytest.raises(ValueError, match="unknown"):
        build_lr_scheduler(opt, schedule="exp")


class _PoisonedNLL(NLLLoss):
    """NLL made non-finite on purpose: ``"loss"`` turns the loss into NaN, ``"grad"`` keeps
    the loss finite but makes the gradient infinite (d sqrt(u)/du at u = 0)."""

    reads_token_mask_only = False  # "grad" reads every row of the logits

    def __init__(self, where: str | None) -> None:
        self.where = where

    def __call__(self, logits, data, global_valid_toks, global_valid_seqs):
        loss, metrics = super().__call__(logits, data, global_valid_toks, global_valid_seqs)
        if self.where == "loss":
            loss = loss * float("nan")
        elif self.where == "grad":
            whole = as_logits(logits)  # the contract: logits may come as HiddenLogits
            loss = loss + torch.sqrt(whole.sum() - whole.sum().detach())
        return loss, metrics


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(make_worker) -> None:
    from tempering.models.policy.training import NonFiniteTrainingError

    worker = make_worker(learning_rate=1e-2, max_consecutive_nonfinite=3)
    data = make_batch(LENGTHS)
    before = _weights(worker)
    lr_before = worker.state.scheduler.last_epoch
    for where in ("loss", "grad"):
        m = worker.train(data, _PoisonedNLL(where), global_batch_size=data.size)
        assert m["num_nonfinite_skipped"] == 1.0, where
        assert not math.isfinite(m["loss"] if where == "loss" else m["grad_norm"])
    after = _weights(worker)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update at all
    assert worker.state.scheduler.last_epoch == lr_before  # nor a schedule step
    assert not worker.state.optimizer.state  # AdamW moments untouched (no step ever taken)

    good = worker.train(data, _PoisonedNLL(None), global_batch_size=data.size)
    assert good["num_nonfinite_skipped"] == 0.0 and math.isfinite(good["loss"])
    moved = _weights(worker)
    assert any(not torch.equal(before[k], moved[k]) for k in before)  # the streak was reset

    worker.train(data, _PoisonedNLL("grad"), global_batch_size=data.size)
    worker.train(data, _PoisonedNLL("grad"), global_batch_size=data.size)
    with pytest.raises(NonFiniteTrainingError) as info:
        worker.train(data, _PoisonedNLL("grad"), global_batch_size=data.size)
    text = str(info.value)
    assert "3 consecutive" in text and "max_consecutive_nonfinite_steps=3" in text
    assert "grad_norm=" in text and "model.layers." in text  # names the non-finite gradients
