"""GRPO prompts: generated arithmetic, GSM8K, and reasoning-gym problems added by config."""

from __future__ import annotations

import pytest

from tempering.algorithms.grpo import load_problems
from tempering.config.schemas import DataConfig


def test_reasoning_gym_problems_join_the_train_set_seeded():
    cfg = DataConfig(
        dataset_name="gsm8k", reasoning_gym_tasks=["chain_sum"], reasoning_gym_samples=5
    )
    train, val = load_problems(cfg)
    base_train, base_val = load_problems(DataConfig(dataset_name="gsm8k"))
    assert len(train) == len(base_train) + 5 and val == base_val
    added = train[len(base_train) :]
    assert all(p.task_name == "math" and p.answer.lstrip("-").isdigit() for p in added)
    assert all("arithmetic problem" in p.prompt and "####" in p.prompt for p in added)
    assert train[len(base_train) :] == load_problems(cfg)[0][len(base_train) :]  # seeded


def test_unknown_reasoning_gym_task_names_the_value():
    with pytest.raises(ValueError, match="'chainsum', which reasoning-gym does not know"):
        load_problems(DataConfig(dataset_name="arithmetic", reasoning_gym_tasks=["chainsum"]))
