"""``grpo.num_iterations`` (the GRPO paper's mu, TRL's num_iterations, verl's ppo_epochs): a step
walks its batch that many times, the behaviour log-probs taken once before, and the lr
schedules count every pass (fast tier; the policy's calls counted through a stand-in)."""

from __future__ import annotations

import torch

from tempering.algorithms import grpo_learning
from tempering.config.schemas import GRPOMasterConfig
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.policy.critic import Critic
from tempering.utils.timers import Timer


class _Policy:
    """Records what the step asks of the policy's workers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.trained: BatchedDataDict | None = None

    def get_logprobs(self, data, temperature):
        self.calls.append(("logprobs", data.size))
        return {"logprobs": -torch.ones(data["input_ids"].shape)}

    def get_reference_policy_logprobs(self, data, temperature):
        self.calls.append(("reference", data.size))
        return {"reference_policy_logprobs": -2 * torch.ones(data["input_ids"].shape)}

    def train(self, data, loss_fn, with_reference=False):
        self.calls.append(("train", data.size) + (("with_reference",) if with_reference else ()))
        self.trained = data
        return {}


def _run(passes: int, gbs: int = 4, kl: float = 0.0) -> tuple[object, BatchedDataDict]:
    cfg = GRPOMasterConfig(
        grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "num_iterations": passes},
        policy={"train_global_batch_size": gbs, "train_micro_batch_size": gbs},
        loss_fn={"reference_policy_kl_penalty": kl},
    )  # fmt: skip
    from types import SimpleNamespace

    data = BatchedDataDict(input_ids=torch.arange(12).view(4, 3), advantages=torch.arange(4.0))
    return SimpleNamespace(cfg=cfg, policy=_Policy()), data


def test_each_pass_walks_the_batch_after_one_behaviour_log_prob_call():
    run, data = _run(passes=3)
    grpo_learning.behaviour_logprobs(run, data, Timer())
    grpo_learning.train_policy(run, data, None, Timer())
    # the log-probs the policy had before the step (each later pass is clipped against them),
    # then one train call over the batch three times: 3 optimizer steps of 4 samples
    assert run.policy.calls == [("logprobs", 4), ("train", 12)]
    trained = run.policy.trained
    for k in range(3):
        torch.testing.assert_close(trained["advantages"][4 * k : 4 * k + 4], data["advantages"])
        torch.testing.assert_close(trained["prev_logprobs"][4 * k : 4 * k + 4], -torch.ones(4, 3))
    assert grpo_learning.samples_per_step(run.cfg) == 12  # the lr schedules count the three passes


def test_one_pass_of_one_global_batch_trains_on_policy():
    run, data = _run(passes=1)
    grpo_learning.behaviour_logprobs(run, data, Timer())
    grpo_learning.train_policy(run, data, None, Timer())
    assert run.policy.calls == [("train", 4)]  # no log-prob call: the train forward's own
    assert grpo_learning.samples_per_step(run.cfg) == 4


def test_a_critic_takes_as_many_passes():
    policy = _Policy()
    rows = {k: torch.zeros(4, 3) for k in ("input_ids", "input_lengths", "token_mask",
                                           "sample_mask", "returns", "prev_values")}  # fmt: skip
    Critic(policy, passes=2).train(BatchedDataDict(rows))
    assert policy.calls == [("train", 8)]


def test_the_kl_terms_reference_is_asked_once_for_every_pass():
    """The reference is frozen: with a KL penalty its log-probs come in one call before the
    passes, not from the workers once per pass (one pass: the workers' own, per micro-batch)."""
    run, data = _run(passes=2, kl=0.01)
    grpo_learning.train_policy(run, data, None, Timer())
    assert run.policy.calls == [("reference", 4), ("train", 8)]
    torch.testing.assert_close(run.policy.trained["reference_policy_logprobs"],
                               -2 * torch.ones(8, 3))  # fmt: skip
    run, data = _run(passes=1, kl=0.01)
    grpo_learning.train_policy(run, data, None, Timer())
    assert run.policy.calls == [("train", 4, "with_reference")]
