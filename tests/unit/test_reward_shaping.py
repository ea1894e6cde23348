"""GRPO's reward scaling and shaping (``grpo.reward_scaling``, ``grpo.reward_shaping``: NeMo
RL's keys, DAPO's soft overlong punishment), and the configs they refuse. The batch-level
check on real rollouts is tests/functional/test_grpo.py's."""

from __future__ import annotations

import pytest
import torch

from tempering.algorithms.reward_shaping import shape_rewards
from tempering.config import GRPOMasterConfig, load_config
from tempering.config.loader import ConfigError
from tempering.config.rl_sections import RewardScalingConfig, RewardShapingConfig

OFF_SCALING, OFF_SHAPING = RewardScalingConfig(), RewardShapingConfig()


def test_the_overlong_penalty_grows_across_the_buffer_and_scaling_clamps_first():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0])
    generated = torch.tensor([10, 50, 75, 100, 40])
    shaping = RewardShapingConfig(enabled=True, overlong_buffer_length=50,
                                  overlong_buffer_penalty=2.0, max_response_length=100)  # fmt: skip
    out = shape_rewards(rewards, generated, torch.zeros(5), OFF_SCALING, shaping, limit=100)
    # the buffer starts at 100 - 50 = 50 tokens: 0 up to it, -2 at the limit, linear between
    torch.testing.assert_close(out["reward_penalty"], torch.tensor([0.0, 0.0, -1.0, -2.0, 0.0]))
    torch.testing.assert_close(out["shaped_rewards"], torch.tensor([1.0, 1.0, -1.0, -1.0, 3.0]))

    scaling = RewardScalingConfig(enabled=True, source_min=0.0, source_max=2.0,
                                  target_min=-1.0, target_max=1.0)  # fmt: skip
    out = shape_rewards(rewards, generated, torch.zeros(5), scaling, shaping, limit=100)
    # 3.0 is clamped to 2.0 (counted), then [0, 2] -> [-1, 1], then the length penalty
    assert out["reward_clamped"].tolist() == [False, False, False, False, True]
    torch.testing.assert_close(out["shaped_rewards"], torch.tensor([0.0, 0.0, -2.0, -2.0, 1.0]))


def test_stop_properly_scales_the_truncated_episodes_rewards():
    shaping = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.25)
    out = shape_rewards(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([5, 9, 9]),
                        torch.tensor([False, True, True]), OFF_SCALING, shaping, limit=9)  # fmt: skip
    torch.testing.assert_close(out["shaped_rewards"], torch.tensor([1.0, 0.25, 0.125]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.reward_shaping.overlong_buffer_length=4"],
         "grpo.reward_shaping.overlong_buffer_length=4 is read only with "
         "grpo.reward_shaping.enabled=true"),
        (["grpo.reward_scaling.target_min=-1"], "grpo.reward_scaling.target_min=-1.0 is read only"),
        (["grpo.reward_shaping.enabled=true"], "needs exactly one of overlong_buffer_length"),
        (["grpo.reward_shaping={enabled: true, overlong_buffer_length: 4, "
          "stop_properly_penalty_coef: 0.5}"], "needs exactly one of overlong_buffer_length"),
        (["grpo.reward_shaping={enabled: true, overlong_buffer_length: 9, "
          "max_response_length: 8}"], "overlong_buffer_length=9 is longer than "
         "max_response_length=8"),
        (["grpo.reward_shaping={enabled: true, overlong_buffer_length: 2, "
          "max_response_length: 40}"], "longer than max_response_length - overlong_buffer_length "
         "= 38 generated tokens, and no episode can generate more than 6"),
        (["grpo.reward_shaping={enabled: true, overlong_buffer_length: 2}",
          "grpo.max_rollout_turns=2"], "max_response_length=null stands for one turn's"),
        (["grpo.reward_shaping={enabled: true, overlong_buffer_length: 2}",
          "env.task_name=nemo_gym"], "and NeMo Gym episodes generate over several turns"),
        (["grpo.reward_scaling={enabled: true, source_min: 1, source_max: 1}"],
         "source_max=1.0 must be greater than source_min=1.0"),
    ],
    ids=["key-while-off", "scaling-key-while-off", "neither-kind", "both-kinds",
         "buffer-past-limit", "never-reached", "multi-turn-needs-a-limit", "gym-needs-a-limit",
         "empty-range"],
)  # fmt: skip
def test_a_shaping_config_that_cannot_work_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("examples/configs/grpo_math_tiny.yaml", overrides, schema=GRPOMasterConfig)
    assert message in str(err.value)


def test_the_main_job_with_dapo_shaping_loads_and_the_limit_defaults_to_max_new_tokens():
    from tempering.config.schemas import overlong_limit

    cfg, _ = load_config("examples/configs/grpo_math_tiny.yaml",
                         ["grpo.reward_shaping={enabled: true, overlong_buffer_length: 3}"],
                         schema=GRPOMasterConfig)  # fmt: skip
    assert overlong_limit(cfg) == cfg.policy.generation.max_new_tokens == 6
    # NeMo Gym's episodes may outgrow one turn's max_new_tokens: only the sequence bounds them
    cfg, _ = load_config("examples/configs/grpo_nemo_gym_tiny.yaml",
                         ["grpo.reward_shaping={enabled: true, overlong_buffer_length: 2, "
                          f"max_response_length: {cfg.policy.max_total_sequence_length - 1}}}"],
                         schema=GRPOMasterConfig)  # fmt: skip
    assert cfg.policy.generation.max_new_tokens < overlong_limit(cfg) - 2
