"""DPO and reward-model training end to end through `setup()`/`train()` (Ray worker group,
FSDP2 workers, JSONL preference loader, checkpoints), then GRPO steps scored by the exported
reward model through `RewardModelEnvironment`.

The preference file is built here and has a rule a tiny model learns in a few dozen steps
and that carries over to held-out prompts: for an arithmetic prompt, the chosen answer is an
even number and the rejected one odd. (tiny-arith's real arithmetic pairs need the trained
checkpoint and minutes; `examples/run_dpo.py` is that run.) Asserted margins:

- DPO: held-out likelihood preference accuracy (policy's own log p(chosen) > log p(rejected))
  rises by >= 0.25 and the DPO implicit-reward accuracy ends >= 0.8; run again once finished,
  it makes no step and reports the same start and end (from its records and checkpoint);
- RM: held-out pair accuracy rises by >= 0.25 and ends >= 0.8;
- GRPO: the rewards of a step equal the environment's own scores of the decoded completions
  (so they are reward-model scores, not exact-match), two train steps run with finite loss,
  and neither they nor validation report an accuracy of scores (the mean reward instead).
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import pytest
import torch

from tempering.config import DPOMasterConfig, GRPOMasterConfig, RMMasterConfig, load_config
from tests.grpo_runs import assert_documented

REPO = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def parity_pairs(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            even, odd = 2 * rng.randint(5, 49), 2 * rng.randint(5, 49) + 1
            row = {"prompt": f"Q: {a}+{b}=? A:", "chosen": f" {even}", "rejected": f" {odd}"}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("prefs")
    return parity_pairs(tmp / "train.jsonl", 2000, 0), parity_pairs(tmp / "val.jsonl", 128, 1)


def overrides(tmp: Path, data_files: tuple[Path, Path]) -> list[str]:
    train, val = data_files
    return [
        "data.dataset_name=preference",
        f"data.train_data_path={train}",
        f"data.val_data_path={val}",
        "policy.num_threads=1",
        f"logger.log_dir={tmp}/logs",
        "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
        "checkpointing.save_period=1000",
    ]


def test_dpo_learns_held_out_preference(ray_session, data_files, tmp_path, caplog):
    from tempering.algorithms import dpo

    cfg, resolved = load_config(
        REPO / "examples/configs/dpo.yaml",
        [
            *overrides(tmp_path, data_files),
            "dpo.max_num_steps=40",
            "dpo.val_period=40",
            "dpo.sft_loss_weight=0.0",
            "dpo.reference_policy_kl_penalty=0.1",
            "policy.optimizer.kwargs.lr=1e-3",
            "policy.scheduler.name=constant",
        ],
        schema=DPOMasterConfig,
    )
    run = dpo.setup(cfg, resolved)
    try:
        summary = dpo.train(run)
    finally:
        run.close()
    start, end = summary["start"], summary["end"]
    print(f"DPO held-out: start {start}\nend {end}")
    assert summary["steps"] == 40
    assert start["preference_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    assert end["logprob_accuracy"] >= start["logprob_accuracy"] + 0.25
    assert end["preference_accuracy"] >= 0.8
    assert end["rewards_chosen_mean"] > end["rewards_rejected_mean"]
    assert (tmp_path / "ckpt" / "step_40").is_dir()  # last step is checkpointed
    assert_documented(tmp_path / "logs")
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(x) for x in lines]
    assert any("train/preference_accuracy" in m for m in logged)
    assert any(m.get("data/num_skipped") == 0 for m in logged)

    run = dpo.setup(cfg, resolved)  # the same command again, the run finished: no step
    try:
        with caplog.at_level(logging.WARNING, logger="tempering.algorithms.common"):
            again = dpo.train(run)
    finally:
        run.close()
    assert (again["steps"], again["start"], again["end"]) == (40, start, end)
    assert "has already finished (step 40, dpo.max_num_steps=40)" in caplog.text


@pytest.fixture(scope="module")
def rm_export(ray_session, data_files, tmp_path_factory) -> dict:
    from tempering.algorithms import rm

    tmp = tmp_path_factory.mktemp("rm")
    cfg, resolved = load_config(
        REPO / "examples/configs/rm.yaml",
        [
            *overrides(tmp, data_files),
            "rm.max_num_steps=40",
            "rm.val_period=40",
            "policy.optimizer.kwargs.lr=1e-3",
            "policy.scheduler.name=constant",
            "policy.scheduler.warmup_steps=0",
        ],
        schema=RMMasterConfig,
    )
    run = rm.setup(cfg, resolved)
    try:
        summary = rm.train(run)
        path = rm.export(run)
    finally:
        run.close()
    assert_documented(tmp / "logs")
    return {"summary": summary, "path": path}


def test_rm_learns_held_out_pairs_and_exports(rm_export):
    from transformers import AutoModelForSequenceClassification

    start, end = rm_export["summary"]["start"], rm_export["summary"]["end"]
    print(f"RM held-out: start {start}\nend {end}")
    assert end["accuracy"] >= start["accuracy"] + 0.25
    assert end["accuracy"] >= 0.8
    model = AutoModelForSequenceClassification.from_pretrained(rm_export["path"])
    assert model.config.num_labels == 1


def test_grpo_steps_scored_by_reward_model(rm_export, tmp_path):
    from tempering.algorithms import grpo
    from tempering.algorithms.sft import decode_generations
    from tempering.environments.reward_model import RewardModelEnvironment
    from tempering.losses import ClippedPGLoss

    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.num_threads=1",
            "grpo.val_period=0",
            "grpo.max_val_samples=8",
            f"env.reward_model_path={rm_export['path']}",
            f"logger.log_dir={tmp_path}/logs",
            "logger.tensorboard_enabled=false",
            "checkpointing.enabled=false",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    try:
        # setup() routed the arithmetic task to a RewardModelEnvironment actor (env.reward_model_path);
        # a second, local copy re-scores the decoded completions independently.
        env = RewardModelEnvironment(str(cfg.env.reward_model_path), num_threads=1)
        problems = run.train_problems[:4]
        batch = grpo.rollout_batch(run, problems, group_size=4)
        mask = batch["token_mask"].bool()
        texts = decode_generations(
            {"output_ids": batch["input_ids"], "generation_lengths": batch["generation_lengths"]},
            {"input_lengths": mask.float().argmax(dim=1)},
            run.tokenizer,
        )
        logs = [
            [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": t}]
            for p, t in zip([p for p in problems for _ in range(4)], texts, strict=True)
        ]
        assert torch.allclose(batch["rewards"], env.score(logs), atol=1e-5)
        assert not set(batch["rewards"].tolist()) <= {0.0, 1.0}  # scores, not exact match
        lf = cfg.loss_fn
        loss_fn = ClippedPGLoss(ratio_clip_min=lf.ratio_clip_min, ratio_clip_max=lf.ratio_clip_max)
        for _ in range(2):
            metrics = grpo.grpo_step(run, loss_fn)
            assert math.isfinite(metrics["train/loss"])
            assert math.isfinite(metrics["train/reward_mean"])
            assert "train/accuracy" not in metrics  # scores: no share "above 0.5" to call one
        # validation reports the held-out mean reward and no accuracy (the run's summary too)
        assert run.correct_above is None
        val = grpo.validate(run, 2)
        assert "accuracy" not in val and "success" not in val and math.isfinite(val["reward_mean"])
    finally:
        run.close()


def test_dpo_parity_config_learns_a_preference_the_reference_does_not_hold(ray_session, tmp_path):
    """examples/configs/dpo_parity.yaml: the reference ranks the held-out pairs near chance,
    and the policy's held-out log-prob accuracy rises >= 25 points above that."""
    from tempering.algorithms import dpo

    cfg, resolved = load_config(
        REPO / "examples/configs/dpo_parity.yaml",
        ["dpo.max_num_steps=80", "dpo.val_period=80", f"logger.log_dir={tmp_path}/logs",
         "logger.tensorboard_enabled=false", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
         "dpo.val_greedy_accuracy=false"],
        schema=DPOMasterConfig,
    )  # fmt: skip
    run = dpo.setup(cfg, resolved)
    try:
        summary = dpo.train(run)
    finally:
        run.close()
    start, end = summary["start"], summary["end"]
    reference = end["reference_logprob_accuracy"]
    # the same pairs counted two ways (the controller's log-prob call; the loss's metric in
    # the train call's micro-batches): equal up to the float of a weighted mean
    assert start["logprob_accuracy"] == pytest.approx(start["reference_logprob_accuracy"])
    assert start["reference_logprob_accuracy"] == pytest.approx(reference)
    assert reference <= 0.65, "the reference already holds this preference"
    assert end["logprob_accuracy"] >= reference + 0.25, summary
