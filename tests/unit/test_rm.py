"""Reward model without Ray: the policy worker with a score head (``FSDP2PolicyWorker(head=
"score")``, what `RewardModel` runs) built in this process (one rank, gloo, CPU),
its HF export, and `RewardModelEnvironment` loading that export.

- pooling at the last non-pad token: a row's score does not depend on the padding after it;
- micro-batching: one SGD step over 2-row micro-batches equals one over the full batch;
- training on a fixed batch of synthetic arithmetic pairs raises pair accuracy;
- export: ``AutoModelForSequenceClassification.from_pretrained`` gives the worker's scores,
  and the environment scores the correct completion above the corrupted one.
"""

from __future__ import annotations

import math

import pytest
import torch

from tempering.algorithms.preference import load_preference_data, preference_batch
from tempering.config.schemas import DataConfig
from tempering.environments.interfaces import EnvironmentInterface
from tempering.environments.registry import get_environment_class
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.preference_losses import BradleyTerryLoss

BT = BradleyTerryLoss()


@pytest.fixture(scope="module")
def tiny_arith_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tempering.models.tiny_arith import build_untrained

    return str(build_untrained(tmp_path_factory.mktemp("tiny_arith"), seed=0))


@pytest.fixture(scope="module")
def tokenizer(tiny_arith_dir: str):
    from tempering.models.hf import load_tokenizer

    return load_tokenizer(tiny_arith_dir)


@pytest.fixture(scope="module")
def pairs():
    return load_preference_data(DataConfig(num_train_samples=16, num_val_samples=1)).train


@pytest.fixture
def make_worker(tiny_arith_dir: str, tokenizer, monkeypatch: pytest.MonkeyPatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    built: list = []

    def build(**kwargs):
        if built:  # one process group per process
            built[-1].shutdown()
        kwargs.setdefault("learning_rate", 3e-3)
        built.append(
            FSDP2PolicyWorker(
                tiny_arith_dir,
                head="score",
                pad_token_id=tokenizer.pad_token_id,
                num_threads=1,
                seed=0,
                **kwargs,
            )
        )
        return built[-1]

    yield build
    if built:
        built[-1].shutdown()


def test_score_is_read_at_the_last_real_token(make_worker, tokenizer, pairs):
    worker = make_worker()
    batch = preference_batch(pairs[:4], tokenizer, 32)
    scores = worker.score(batch, micro_batch_size=8)["scores"]
    assert scores.shape == (8,)
    for i in (0, 3):  # each row alone, without padding, scores the same
        n = int(batch["input_lengths"][i])
        alone = batch.select_indices([i])
        alone["input_ids"] = alone["input_ids"][:, :n]
        assert worker.score(alone, 2)["scores"][0].item() == pytest.approx(
            scores[i].item(), abs=1e-5
        )
    assert len(set(scores.tolist())) > 1  # the head reads the sequence, not a constant


def test_microbatches_sum_to_the_full_batch_gradient(make_worker, tokenizer, pairs):
    batch = preference_batch(pairs[:8], tokenizer, 32)
    batch["sample_mask"][2:4] = 0  # one invalid pair
    params = []
    for mbs in (16, 2):
        worker = make_worker(optimizer="sgd", learning_rate=0.5, max_grad_norm=None)
        m = worker.train(batch, BT, global_batch_size=16, micro_batch_size=mbs)
        sd = {k: v.clone() for k, v in worker.refit.state_dict().items()}
        params.append((m, sd))
    (m_full, sd_full), (m_mb, sd_mb) = params
    assert m_full["loss"] == pytest.approx(m_mb["loss"], abs=1e-6)
    assert m_full["num_valid_pairs"] == m_mb["num_valid_pairs"] == 7
    for k in sd_full:
        assert torch.allclose(sd_full[k], sd_mb[k], atol=1e-6), k
    assert m_full["loss"] == pytest.approx(math.log(2), abs=0.1)  # fresh head: scores ~ equal


@pytest.fixture(scope="module")
def trained_export(tiny_arith_dir, tokenizer, pairs, tmp_path_factory):
    """Train on a fixed batch until it separates the pairs; export; return (path, scores)."""
    mp = pytest.MonkeyPatch()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        mp.delenv(var, raising=False)
    worker = FSDP2PolicyWorker(
        tiny_arith_dir,
        head="score",
        pad_token_id=tokenizer.pad_token_id,
        learning_rate=3e-3,
        num_threads=1,
        seed=0,
    )
    try:
        batch = preference_batch(pairs, tokenizer, 32)
        first = worker.train(batch, BT, global_batch_size=32, micro_batch_size=16, eval_mode=True)
        history = [
            worker.train(batch, BT, global_batch_size=32, micro_batch_size=16) for _ in range(40)
        ]
        last = worker.train(batch, BT, global_batch_size=32, micro_batch_size=16, eval_mode=True)
        path = tmp_path_factory.mktemp("rm_export") / "final_hf"
        worker.checkpoint.export_hf(str(path))
        scores = worker.score(batch, 16)["scores"]
    finally:
        worker.shutdown()
        mp.undo()
    return {
        "path": str(path),
        "scores": scores,
        "batch": batch,
        "first": first,
        "last": last,
        "history": history,
    }


def test_training_separates_a_fixed_batch(trained_export):
    first, last = trained_export["first"], trained_export["last"]
    assert last["loss"] < first["loss"] - 0.2
    assert last["accuracy"] >= 0.9
    assert last["margin"] > first["margin"]
    assert "grad_norm" in trained_export["history"][0] and "grad_norm" not in last  # eval: no step


def test_export_loads_with_auto_class_and_matches_worker(trained_export):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(trained_export["path"]).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    batch = trained_export["batch"]
    mask = (
        torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]
    ).long()
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=mask).logits[:, 0]
    assert torch.allclose(scores, trained_export["scores"], atol=1e-4)


def test_environment_scores_correct_above_corrupted(trained_export, pairs):
    cls = get_environment_class("reward_model")
    assert issubclass(cls, EnvironmentInterface)
    env = cls(trained_export["path"], num_threads=1)
    logs = []
    for p in pairs:
        logs.append(p.prompt + [{**p.chosen[0], "token_ids": torch.tensor([1])}])  # extra keys ok
        logs.append(p.prompt + p.rejected)
    ret = env.step(logs, [{}] * len(logs))
    assert torch.allclose(
        ret.rewards, trained_export["scores"], atol=1e-4
    )  # same tokens as training
    wins = (ret.rewards[0::2] > ret.rewards[1::2]).float().mean().item()
    assert wins >= 0.9
    assert bool(ret.terminateds.all()) and ret.answers[0] == pairs[0].chosen[0]["content"]
    sig = cls(trained_export["path"], reward_transform="sigmoid").step(logs[:4], [{}] * 4)
    assert torch.allclose(sig.rewards, torch.sigmoid(ret.rewards[:4]), atol=1e-6)
    assert bool(((sig.rewards > 0) & (sig.rewards < 1)).all())


def test_environment_rejects_bad_folder_and_transform(tmp_path, trained_export):
    cls = get_environment_class("reward_model")
    with pytest.raises(ValueError, match="reward_transform='tanh'"):
        cls(trained_export["path"], reward_transform="tanh")
    with pytest.raises((FileNotFoundError, OSError)):
        cls(str(tmp_path / "missing"))
