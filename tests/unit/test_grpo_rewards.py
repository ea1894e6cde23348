"""Which rewards are correct answers (`EnvironmentInterface.correct_above`): GRPO's accuracy
metrics, pass@k and the summary read it, and a run scored by a reward model or custom reward
functions -- scores, not correctness -- reports its mean reward instead of an "accuracy" that
counted the scores above 0.5. The slow tier's reward-model run (test_dpo_rm.py) checks the
same on a real run."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tempering.algorithms import distillation, grpo, grpo_scoring
from tempering.config import DistillationMasterConfig, GRPOMasterConfig
from tempering.environments import registry
from tempering.environments.arithmetic import ArithmeticEnvironment


def cfg(**env) -> GRPOMasterConfig:
    return GRPOMasterConfig(env=env)


def test_the_scoring_environments_say_which_rewards_are_correct(monkeypatch, caplog):
    assert grpo_scoring.reward_threshold(cfg(), {"arithmetic", "math"}) == 0.5
    assert grpo_scoring.reward_threshold(cfg(), {"nemo_gym"}) == 0.5  # Gym's verifiers: 0 or 1
    with caplog.at_level(logging.WARNING, logger="tempering.algorithms.grpo"):
        assert grpo_scoring.reward_threshold(cfg(reward_fn="m:f"), {"arithmetic"}) is None
        assert grpo_scoring.reward_threshold(cfg(reward_model_path="rm"), {"arithmetic"}) is None
    said = [r.getMessage() for r in caplog.records]
    assert "the rewards of reward_fn are scores, not correct answers" in said[0]
    assert "the rewards of reward_model are scores" in said[1]

    class Strict(ArithmeticEnvironment):
        correct_above = 0.9

    monkeypatch.setitem(registry.ENVIRONMENT_REGISTRY, "strict", Strict)
    assert grpo_scoring.reward_threshold(cfg(), {"strict"}) == 0.9
    assert grpo_scoring.reward_threshold(cfg(), {"strict", "arithmetic"}) is None  # they disagree


def test_pass_at_k_of_scores_is_refused_with_the_fix():
    bad = GRPOMasterConfig(env={"reward_fn": "m:f"}, grpo={"val_pass_at_k": 4})
    with pytest.raises(ValueError, match=r"grpo.val_pass_at_k=4 .* reward_fn are scores .* "
                                         r"set grpo.val_pass_at_k=0"):  # fmt: skip
        grpo_scoring.reward_threshold(bad, {"arithmetic"})


def test_checkpoints_ranked_by_accuracy_rank_by_mean_reward_when_there_is_none(caplog):
    c = GRPOMasterConfig(checkpointing={"keep_top_k": 2, "metric_name": "val/accuracy"})
    assert grpo_scoring.checkpoint_ranking(c, 0.5) is c.checkpointing
    with caplog.at_level(logging.WARNING, logger="tempering.algorithms.grpo"):
        ranked = grpo_scoring.checkpoint_ranking(c, None)
    assert (ranked.metric_name, ranked.higher_is_better) == ("val/reward_mean", True)
    assert "ranks checkpoints by val/reward_mean instead" in caplog.text
    other = GRPOMasterConfig(checkpointing={"metric_name": "val/loss"}).checkpointing
    assert grpo_scoring.checkpoint_ranking(GRPOMasterConfig(checkpointing=other), None) is other


def step(threshold: float | None) -> dict[str, float]:
    run = SimpleNamespace(cfg=GRPOMasterConfig(grpo={"num_generations_per_prompt": 2}),
                          correct_above=threshold)  # fmt: skip
    batch = {"generation_lengths": torch.tensor([3, 4, 5, 6]), "finish_reasons": ["stop"] * 4,
             "turns": torch.ones(4), "truncated": torch.zeros(4)}  # fmt: skip
    timer = SimpleNamespace(get_timing_metrics=lambda: {"timing/generation_s": 1.0})
    data = {"input_lengths": torch.tensor([8, 8, 8, 8])}
    rewards = torch.tensor([0.2, 0.7, 1.0, 3.0])
    return grpo.step_metrics(run, batch, data, rewards, {}, timer, 1.0)


def test_train_accuracy_counts_rewards_above_the_threshold_and_only_with_one():
    assert step(0.5)["train/accuracy"] == 0.75
    assert step(0.9)["train/accuracy"] == 0.5
    scores = step(None)
    assert "train/accuracy" not in scores and scores["train/reward_mean"] == pytest.approx(1.225)


def test_the_summary_reports_mean_reward_where_rewards_are_scores():
    base = {"steps": 5, "steps_this_run": 5, "wall_time_s": 3.0, "final_model": "out",
            "warning": None, "start_success": None, "end_success": None}  # fmt: skip
    acc = {**base, "start_accuracy": 0.398, "end_accuracy": 0.723,
           "start_reward_mean": 0.4, "end_reward_mean": 0.7}  # fmt: skip
    assert "held-out greedy accuracy 39.8% -> 72.3%" in grpo.summary_text(acc, GRPOMasterConfig())
    scores = {**base, "start_accuracy": None, "end_accuracy": None,
              "start_reward_mean": -1.25, "end_reward_mean": 0.5}  # fmt: skip
    text = grpo.summary_text(scores, GRPOMasterConfig())
    assert "held-out greedy mean reward -1.25 -> 0.5" in text and "accuracy" not in text
    no_start = grpo.summary_text({**scores, "start_reward_mean": None}, GRPOMasterConfig())
    assert "held-out greedy mean reward n/a -> 0.5" in no_start  # grpo.val_at_start=false
    student = distillation.summary_text(scores, DistillationMasterConfig())
    assert "student held-out greedy mean reward -1.25 -> 0.5 (teacher" in student
