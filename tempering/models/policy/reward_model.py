"""Reward models: the policy worker with a score head, trained with the Bradley-Terry loss.

A reward model is ``AutoModelForSequenceClassification`` with one label, built from a
causal-LM folder (the body is the LM's, the ``score`` head is new) or from an exported reward
model. It runs in the same `FSDP2PolicyWorker` as a policy, built with ``head="score"``: the
same distributed set-up, device choice, sharding, micro-batching, numerics guard, checkpoints
(DCP) and HF export; only the forward differs (one score per sequence, pooled by HF at the last
token that is not ``pad_token_id``). `RewardModel` is the controller's handle over a `Policy`
of such workers:

    rm = build_reward_model(cluster, "tiny-arith", pad_token_id=0, train_global_batch_size=64,
                            train_micro_batch_size=32, learning_rate=1e-3)
    metrics = rm.train(batch)            # {"loss", "accuracy", "margin", "grad_norm", ...}
    scores = rm.score(batch)["scores"]   # [B]
    rm.export_hf("results/rm/final_hf")  # AutoModelForSequenceClassification loads it

Batches interleave pairs: row ``2i`` chosen, ``2i + 1`` rejected. Padding: rows are
right-padded with ``pad_token_id``; when a tokenizer's pad token equals its EOS token, a
trailing EOS counts as padding, so the score sits on the token before it -- the same in
training, here and in `tempering.environments.reward_model`.
"""

from __future__ import annotations

from typing import Any

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.policy.lm_policy import Policy, build_policy, sharded
from tempering.preference_losses import BradleyTerryLoss


class RewardModel:
    """Bradley-Terry training and scoring over a `Policy` whose workers have a score head."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.worker_group = policy.worker_group
        self.loss_fn = BradleyTerryLoss()

    def train(
        self,
        data: BatchedDataDict,
        *,
        eval_mode: bool = False,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """Bradley-Terry optimizer steps (or, with ``eval_mode``, metrics only) on `data`."""
        return self.policy.train(
            data,
            self.loss_fn,
            eval_mode=eval_mode,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
        )

    def score(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"scores": [B]}`` in the order of `data`."""
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        size = micro_batch_size or self.policy.train_micro_batch_size
        return sharded(self.policy, "score", view, micro_batch_size=size)

    def save_checkpoint(self, path: str) -> None:
        self.policy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.policy.load_checkpoint(path)

    def export_hf(self, path: str) -> None:
        """An HF folder (config with num_labels=1 and pad_token_id, weights, tokenizer) that
        ``AutoModelForSequenceClassification.from_pretrained`` loads."""
        self.policy.export_hf(path)

    def shutdown(self) -> None:
        self.policy.shutdown()


def build_reward_model(
    cluster: Any,
    model_path: str,
    *,
    pad_token_id: int,
    train_global_batch_size: int,
    train_micro_batch_size: int,
    name_prefix: str = "reward_model",
    **policy_kwargs: Any,
) -> RewardModel:
    """One score-head `FSDP2PolicyWorker` per bundle of `cluster` (kwargs: `build_policy`)."""
    dp = sum(cluster.bundle_ct_per_node_list)
    if train_global_batch_size % (2 * dp) or train_micro_batch_size % 2:
        raise ValueError(
            f"policy.train_global_batch_size={train_global_batch_size} must be a multiple of "
            f"2 x data-parallel size ({2 * dp}) and policy.train_micro_batch_size="
            f"{train_micro_batch_size} even: reward-model batches are chosen/rejected pairs"
        )
    policy = build_policy(
        cluster,
        model_path,
        train_global_batch_size=train_global_batch_size,
        train_micro_batch_size=train_micro_batch_size,
        head="score",
        pad_token_id=pad_token_id,
        name_prefix=name_prefix,
        **policy_kwargs,
    )
    return RewardModel(policy)


__all__ = ["RewardModel", "build_reward_model"]
