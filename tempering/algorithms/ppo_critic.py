"""PPO with a learned critic in GRPO's loop (``critic.enabled``; verl's and OpenRLHF's PPO).

Everything else is GRPO's: the rollouts, rewards, clipped policy loss, refit, validation and
checkpoints. What the critic changes, per step (`grpo.grpo_step`):
  1. after the rollouts, the critic's values of every generated token (`advantages`): GAE over
     each episode's own tokens (`tempering.algorithms.advantages.gae_advantages`, the reward at
     its last token, and with ``critic.reward_kl_coef`` a KL penalty on every token) gives
     per-token advantages, whitened over the batch with
     ``grpo.normalize_rewards``, in place of the group baseline -- one sample per prompt is
     enough (``grpo.num_generations_per_prompt=1``);
  2. after the policy's step, the critic's (`train`): `ValueLoss` toward the returns, each
     value's move clipped around the one the advantages used (``critic.value_clip``).
With ``critic.warmup_steps`` the run's first steps train the critic only (verl's
``critic_warmup``): the policy, and so the sampler, stays as it started until the values it
will learn from have seen that many batches; its lr schedule spans the steps left.
Asynchronous GRPO (``grpo.async_grpo.enabled``) works the same: the critic scores a batch
when the trainer takes it from the buffer (this step's critic, the samples of the weights
that made them; the policy's loss corrects their age as GRPO's does), and a warm-up step
still refits, with unchanged weights, to keep the collector's schedule of weight versions.
The critic (`tempering.models.policy.critic`) is built from the policy's body (or
``critic.model_name``) with a new value head, on the policy's bundles, with the policy's batch
sizes (``critic.train_global_batch_size``: its own, for more value updates per rollout),
precision and schedule and ``critic.learning_rate``; checkpoints hold it beside the
policy (``step_N/critic``), so a resumed run continues it exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tempering.config.schemas import GRPOMasterConfig


def build(cfg: GRPOMasterConfig, cluster: Any, plan: Any, samples_per_step: int) -> Any:
    """The run's `Critic` on the policy's bundles, or None without ``critic.enabled``;
    ``samples_per_step`` (`grpo_learning.samples_per_step`) sizes its lr schedule."""
    from tempering.algorithms.common import build_policy_from_config
    from tempering.models.policy.critic import Critic

    if not cfg.critic.enabled:
        return None
    pol = cfg.policy
    gbs = cfg.critic.train_global_batch_size or pol.train_global_batch_size
    kwargs = pol.optimizer.kwargs.model_copy(update={"lr": cfg.critic.learning_rate})
    lora = pol.dtensor_cfg.lora_cfg.model_copy(update={"enabled": False})  # trained whole
    critic_cfg = pol.model_copy(update={
        "model_name": cfg.critic.model_name or pol.model_name,
        "train_global_batch_size": gbs,
        "train_micro_batch_size": min(pol.train_micro_batch_size, gbs),
        "optimizer": pol.optimizer.model_copy(update={"kwargs": kwargs}),
        "dtensor_cfg": pol.dtensor_cfg.model_copy(update={"lora_cfg": lora}),
    })  # fmt: skip
    policy = build_policy_from_config(
        critic_cfg, cluster, total_steps=cfg.grpo.max_num_steps, seed=cfg.grpo.seed,
        name_prefix="critic", head="value", gpu_share=plan.gpu_share, cpu_share=0,
        samples_per_step=samples_per_step,
    )  # fmt: skip
    return Critic(policy, cfg.critic.value_clip, passes=cfg.grpo.num_iterations)


def warming_up(cfg: GRPOMasterConfig, step: int | None) -> bool:
    """Whether loop step ``step`` (1-based) trains the critic only (``critic.warmup_steps``);
    a step without a number (a direct `grpo_step` call) never does."""
    return cfg.critic.enabled and step is not None and step <= cfg.critic.warmup_steps


def advantages(cfg: GRPOMasterConfig, critic: Any, batch: Any, policy: Any) -> dict[str, float]:
    """Sets ``batch["advantages"]`` (GAE from the critic's values, whitened with
    ``grpo.normalize_rewards``), ``batch["returns"]`` and ``batch["prev_values"]``; returns
    ``critic/*`` metrics of the values before this step's update. With
    ``critic.reward_kl_coef``, each generated token's reward is less that x its KL estimate
    against ``policy``'s frozen reference (the sampler's log-prob less the reference's); those
    log-probs stay in ``batch["reference_policy_logprobs"]`` for the loss's KL term."""
    from tempering.algorithms.advantages import gae_advantages, whiten

    values = critic.values(batch)["values"]
    rewards = batch["shaped_rewards"] if "shaped_rewards" in batch else batch["rewards"]
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    metrics, penalty = {}, None
    if cfg.critic.reward_kl_coef > 0:
        temperature = cfg.policy.generation.temperature
        ref = policy.get_reference_policy_logprobs(batch, temperature)["reference_policy_logprobs"]
        batch["reference_policy_logprobs"] = ref  # a KL term in the loss reads them too
        kl = (batch["generation_logprobs"] - ref) * mask
        penalty = -cfg.critic.reward_kl_coef * kl
        metrics["critic/reward_kl"] = float(kl.sum() / mask.sum().clamp(min=1))  # per token
    adv, returns = gae_advantages(
        rewards, values, mask, cfg.critic.gamma, cfg.critic.lam, token_rewards=penalty
    )
    batch["advantages"] = whiten(adv, mask) if cfg.grpo.normalize_rewards else adv
    batch["returns"], batch["prev_values"] = returns, values * mask
    on = mask > 0
    v, r = values[on], returns[on]
    explained = 1 - (r - v).var() / r.var() if r.numel() > 1 and r.var() > 0 else 0.0
    return metrics | {
        "critic/values_mean": float(v.mean()) if v.numel() else 0.0,
        "critic/returns_mean": float(r.mean()) if r.numel() else 0.0,
        "critic/explained_variance": float(explained),
    }


def train(critic: Any, batch: Any) -> dict[str, float]:
    """One round of `ValueLoss` steps on the batch's returns: ``critic/*`` metrics."""
    return {f"critic/{k}": v for k, v in critic.train(batch).items()}


def writer(critic: Any) -> Any:
    """What writes the critic into a checkpoint folder (None without a critic)."""
    if critic is None:
        return None
    return lambda folder: critic.save_checkpoint(str(Path(folder) / "critic"))


def export(critic: Any, checkpoint_dir: str) -> str | None:
    """The trained critic as an HF folder, ``<checkpoint_dir>/final_critic_hf`` (atomic), that
    ``AutoModelForTokenClassification`` loads and ``critic.model_name`` starts a run from
    (OpenRLHF's ``--save_value_network``); None without a critic."""
    if critic is None:
        return None
    path = Path(checkpoint_dir) / "final_critic_hf"
    critic.policy.export_hf(str(path))
    return str(path)


def resume(critic: Any, checkpointer: Any, step: int) -> None:
    """The critic of checkpoint ``step`` (a resumed run), named when the checkpoint has none."""
    if critic is None or not step:
        return
    folder = checkpointer.step_dir(step) / "critic"
    if not folder.is_dir():
        raise ValueError(
            f"critic.enabled=true, but checkpoint {checkpointer.step_dir(step)} holds no "
            "critic (it was saved with critic.enabled=false): resume with critic.enabled=false, "
            "or start the PPO run in another checkpointing.checkpoint_dir"
        )
    critic.load_checkpoint(str(folder))
