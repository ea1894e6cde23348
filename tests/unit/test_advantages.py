"""GRPO advantages on hand-worked groups (numbers written out)."""

from __future__ import annotations

import pytest
import torch

from tempering.algorithms.advantages import (
    group_advantages,
    group_std,
)


def test_leave_one_out_without_std():
    # group A = [1, 0, 0, 1]: baseline for a 1 is (0+0+1)/3 = 1/3, for a 0 it is (1+0+1)/3 = 2/3
    # group B = [0, 0, 0, 0]: everything 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    out = group_advantages(rewards, group_size=4, normalize_std=False)
    third = 1 / 3
    expected_baseline = [third, 2 * third, 2 * third, third, 0, 0, 0, 0]
    expected_adv = [2 * third, -2 * third, -2 * third, 2 * third, 0, 0, 0, 0]
    assert out.baselines.tolist() == pytest.approx(expected_baseline)
    assert out.advantages.tolist() == pytest.approx(expected_adv)
    # sample std of [1,0,0,1]: mean 0.5, squared deviations 4 * 0.25 = 1, / (4-1) -> sqrt(1/3)
    assert out.group_std.tolist() == pytest.approx([0.5773503, 0.0], abs=1e-6)


def test_leave_one_out_with_std():
    # group [1, 2, 3]: baselines 2.5, 2, 1.5 -> raw -1.5, 0, 1.5; sample std = 1
    # group [1, 0, 0, 1] padded to G=3 is not possible, so use [4, 4, 1]:
    #   baselines (4+1)/2 = 2.5, 2.5, 4 -> raw 1.5, 1.5, -3
    #   mean 3, squared deviations 1 + 1 + 4 = 6, / 2 = 3 -> std sqrt(3) = 1.7320508
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 1.0])
    out = group_advantages(rewards, group_size=3, normalize_std=True, eps=0.0)
    s3 = 3**0.5
    assert out.advantages.tolist() == pytest.approx([-1.5, 0.0, 1.5, 1.5 / s3, 1.5 / s3, -3 / s3])
    assert out.group_std.tolist() == pytest.approx([1.0, s3])
    # eps is added to the std
    out_eps = group_advantages(rewards, group_size=3, normalize_std=True, eps=1.0)
    assert out_eps.advantages[0].item() == pytest.approx(-1.5 / 2.0)


def test_constant_group_gets_zero_advantage_even_normalized():
    out = group_advantages(torch.tensor([0.7, 0.7, 0.7]), group_size=3)
    assert torch.equal(out.advantages, torch.zeros(3))
    assert out.group_std.item() == 0.0


def test_mean_baseline():
    # [1, 2, 3] -> mean 2 -> -1, 0, 1 (std 1);  [0, 1] -> mean 0.5 -> -0.5, 0.5 (std 0.7071068)
    out = group_advantages(torch.tensor([1.0, 2.0, 3.0]), 3, False, normalize_std=False)
    assert out.advantages.tolist() == pytest.approx([-1.0, 0.0, 1.0])
    out = group_advantages(torch.tensor([0.0, 1.0]), 2, False, normalize_std=True, eps=0.0)
    assert out.advantages.tolist() == pytest.approx([-0.5 / 0.7071068, 0.5 / 0.7071068])


def test_integer_rewards_and_errors():
    out = group_advantages(torch.tensor([1, 0]), group_size=2, normalize_std=False)
    assert out.advantages.tolist() == [1.0, -1.0]
    assert group_std(torch.tensor([5.0, 6.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), group_size=1)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_dropped_samples_leave_their_group_as_if_absent(leave_one_out):
    def fn(*args, **kw):
        return group_advantages(*args, leave_one_out=leave_one_out, **kw)

    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups of 4
    valid = torch.tensor([True, True, False, True, True, True, False, True])
    out = fn(rewards, 4, normalize_std=True, valid=valid)
    # group 1 without its dropped 5.0 is [1, 0, 1]; group 2 without its 0 is [0, 1, 0]
    ref1 = fn(torch.tensor([1.0, 0.0, 1.0]), 3, normalize_std=True)
    ref2 = fn(torch.tensor([0.0, 1.0, 0.0]), 3, normalize_std=True)
    assert torch.allclose(out.advantages[[0, 1, 3]], ref1.advantages)
    assert torch.allclose(out.advantages[[4, 5, 7]], ref2.advantages)
    assert out.advantages[2] == 0 and out.advantages[6] == 0
    assert torch.allclose(out.group_std, torch.stack([ref1.group_std[0], ref2.group_std[0]]))
