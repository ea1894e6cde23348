"""PPO's critic: the policy worker with a value head, trained with `ValueLoss`.

A critic is ``AutoModelForTokenClassification`` with one label, built from a causal-LM
folder (the body is the LM's, the ``score`` head is new and starts random) with no dropout
before the head. It runs in the same `FSDP2PolicyWorker` as a policy, built with
``head="value"``: the same sharding, micro-batching, numerics guard and checkpoints (DCP); only
the forward differs (a value per token, in the log-probs' layout: token t's value is read at
position t - 1, the state before the token was chosen). `Critic` is the controller's handle
over such a `Policy` (`tempering.algorithms.ppo_critic.build` makes one from the config):

    critic = Critic(policy, value_clip=0.2)
    values = critic.values(batch)["values"]            # [B, S]
    metrics = critic.train(batch_with_returns)         # {"loss", "value_clip_fraction", ...}

Its micro-batches are the policy's: padded rows, token budgets (``policy.dynamic_batching``)
or packed rows (``policy.sequence_packing``), with a GRPO group's shared prompt computed once.
"""

from __future__ import annotations

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.losses import ValueLoss
from tempering.models.policy.lm_policy import Policy, sharded

# What a critic's training step reads of a batch.
CRITIC_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "returns", "prev_values")


class Critic:
    """Values and `ValueLoss` steps over a `Policy` whose workers have a value head."""

    def __init__(self, policy: Policy, value_clip: float | None = 0.2, passes: int = 1) -> None:
        self.policy = policy
        self.loss_fn = ValueLoss(value_clip)
        self.passes = passes  # over each batch (grpo.num_iterations)

    def values(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"values": [B, S]}`` in the order of `data` (each data-parallel rank its shard,
        micro-batched as the log-probs are)."""
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        p = self.policy
        return sharded(p, "values", view, micro_batch_size=p.logprob_micro_batch_size,
                       max_tokens_per_microbatch=p.logprob_max_tokens_per_microbatch,
                       pack_sequences=p.sequence_packing)  # fmt: skip

    def train(self, data: BatchedDataDict) -> dict[str, float]:
        """`ValueLoss` optimizer steps on `data` (`CRITIC_KEYS`), as the policy's batch sizes
        split it, ``passes`` times over."""
        rows = BatchedDataDict({k: data[k] for k in CRITIC_KEYS})
        if self.passes > 1:
            rows = BatchedDataDict.from_batches([rows] * self.passes)
        return self.policy.train(rows, self.loss_fn)

    def save_checkpoint(self, path: str) -> None:
        self.policy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.policy.load_checkpoint(path)

    def shutdown(self) -> None:
        self.policy.shutdown()


__all__ = ["CRITIC_KEYS", "Critic"]
