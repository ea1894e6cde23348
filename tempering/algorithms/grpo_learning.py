"""What a GRPO step learns from its scored batch -- synchronous and asynchronous GRPO alike
(`grpo.grpo_step`, `async_grpo.AsyncSteps.step`).

`learn_from`: with a critic (PPO), its GAE advantages first (`ppo_critic.advantages`); the
behaviour log-probs when the step makes several optimizer steps (`behaviour_logprobs`); the
policy's update (`train_policy`: every pass of ``grpo.num_iterations`` in one call; none in the
critic's warm-up); then the critic's value steps. `samples_per_step` is what the lr schedules
count a loop step as.
"""

from __future__ import annotations

from typing import Any

from tempering.algorithms import ppo_critic
from tempering.config.schemas import GRPOMasterConfig
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.utils import faults

TRAIN_KEYS = (
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "advantages",
    "generation_logprobs",
)


def samples_per_step(cfg: GRPOMasterConfig) -> int:
    """The samples a loop step trains on, each pass over the batch counted
    (``grpo.num_iterations``): the models' lr schedules count their optimizer steps by it."""
    g = cfg.grpo
    return g.num_prompts_per_step * g.num_generations_per_prompt * g.num_iterations


def learn_from(
    run: Any, batch: Any, loss_fn: Any, timer: Any, step: int | None
) -> tuple[Any, dict[str, float], dict[str, float]]:
    """What a step learns from its scored batch (synchronous and asynchronous GRPO alike):
    with a critic (PPO), its GAE advantages first and its value steps last; the policy's
    update between, except in the critic's warm-up. Returns (the policy's train data, its
    metrics, the ``critic/*`` metrics)."""
    critic_metrics: dict[str, float] = {}
    warming = ppo_critic.warming_up(run.cfg, step)  # PPO's first steps: the critic's only
    if run.critic is not None:  # PPO: GAE advantages from the critic's values
        with timer.time("values"):
            critic_metrics = ppo_critic.advantages(run.cfg, run.critic, batch, run.policy)
        critic_metrics["critic/warming_up"] = float(warming)
    data = BatchedDataDict({k: batch[k] for k in TRAIN_KEYS})
    if "reference_policy_logprobs" in batch and run.cfg.loss_fn.reference_policy_kl_penalty:
        data["reference_policy_logprobs"] = batch["reference_policy_logprobs"]  # PPO's, reused
    train_metrics: dict[str, float] = {}
    if not warming:
        behaviour_logprobs(run, data, timer)
        train_metrics = train_policy(run, data, loss_fn, timer)
    if run.critic is not None:
        with timer.time("critic"):
            critic_metrics.update(ppo_critic.train(run.critic, batch))
    return data, train_metrics, critic_metrics


def behaviour_logprobs(run: Any, data: Any, timer: Any) -> None:
    """``data["prev_logprobs"]`` from the trainer, when the batch spans several optimizer steps.

    One optimizer step per rollout batch (the usual case) trains on-policy: the behaviour
    policy IS the current one, and ClippedPGLoss takes its log-probs from the train forward
    itself (detached), which saves a whole forward pass per step. More steps per batch train
    later steps on older samples and need the recomputed log-probs."""
    with timer.time("logprobs"):
        faults.maybe_fault("controller", "logprobs")
        if data.size * run.cfg.grpo.num_iterations > run.cfg.policy.train_global_batch_size:
            data["prev_logprobs"] = run.policy.get_logprobs(
                data, temperature=run.cfg.policy.generation.temperature
            )["logprobs"]


def train_policy(run: Any, data: Any, loss_fn: Any, timer: Any) -> dict[str, float]:
    """`policy.train` on the batch. The KL term's reference log-probs are computed by the
    workers per micro-batch, right before its forward (the reference is frozen, so when does
    not matter), unless the batch has them already (PPO's KL in the reward). With
    ``grpo.num_iterations`` the batch is walked that many times in one call, the reference's
    log-probs asked once before it rather than once a pass."""
    with timer.time("train"):
        faults.maybe_fault("controller", "train")
        kl = run.cfg.loss_fn.reference_policy_kl_penalty > 0
        kl = kl and "reference_policy_logprobs" not in data
        passes = run.cfg.grpo.num_iterations
        if passes > 1:
            if kl:
                temperature = run.cfg.policy.generation.temperature
                data["reference_policy_logprobs"] = run.policy.get_reference_policy_logprobs(
                    data, temperature
                )["reference_policy_logprobs"]
                kl = False
            data = BatchedDataDict.from_batches([data] * passes)
        return run.policy.train(data, loss_fn, with_reference=kl)
