"""GRPO through the real pieces (Ray worker group, FSDP2 policy, colocated torch engine,
environment actors) on the committed tiny-arith model, checking that the numbers agree with
each other rather than only that a step ran:

- the sampling log-probs reported by generation equal the trainer's log-probs of the same
  tokens (the fp32 torch engine samples from exactly the policy's distribution);
- the rewards equal an independent re-check of the decoded completions;
- a train step sees `token_mult_prob_error` of 1 (no generator/trainer mismatch), finite loss,
  and a refit makes the generator's log-probs follow the trained weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def grpo_run(ray_session, tmp_path_factory):
    from tempering.algorithms import grpo

    tmp = tmp_path_factory.mktemp("grpo")
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.num_threads=1",
            "grpo.max_val_samples=32",
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    yield run
    run.close()


def test_rollout_logprobs_and_rewards_are_consistent(grpo_run):
    from tempering.algorithms.grpo import TRAIN_KEYS, rollout_batch
    from tempering.algorithms.sft import decode_generations
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.environments.arithmetic import first_integer

    problems = grpo_run.train_problems[:4]
    batch = rollout_batch(grpo_run, problems, group_size=4)
    data = BatchedDataDict({k: batch[k] for k in TRAIN_KEYS})
    mask = data["token_mask"].bool()
    assert mask.sum() > 0

    trainer_lp = grpo_run.policy.get_logprobs(data)["logprobs"]
    diff = (trainer_lp - data["generation_logprobs"]).abs()[mask]
    assert diff.max() < 1e-4, f"generation vs trainer log-probs differ by {diff.max():.2e}"

    # rewards == an independent re-check of the decoded completions
    prompt_lens = mask.float().argmax(dim=1)  # first generated position
    texts = decode_generations(
        {"output_ids": data["input_ids"], "generation_lengths": batch["generation_lengths"]},
        {"input_lengths": prompt_lens},
        grpo_run.tokenizer,
    )
    answers = [p.answer for p in problems for _ in range(4)]
    expected = torch.tensor(
        [float(first_integer(t) == int(a)) for t, a in zip(texts, answers, strict=True)]
    )
    assert torch.equal(batch["rewards"], expected)


def test_train_step_metrics_and_refit(grpo_run):
    from tempering.algorithms.grpo import grpo_step, rollout_batch
    from tempering.algorithms.loss_functions import ClippedPGLoss

    probe = rollout_batch(grpo_run, grpo_run.val_problems[:2], group_size=2)
    before = grpo_run.policy.get_logprobs(probe)["logprobs"]

    loss_fn = ClippedPGLoss(ratio_clip_min=0.2, ratio_clip_max=0.28)
    metrics = grpo_step(grpo_run, loss_fn)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert abs(metrics["train/token_mult_prob_error"] - 1.0) < 1e-3
    assert metrics["timing/refit_s"] >= 0 and metrics["timing/generation_s"] > 0
    for key in (
        "train/reward_mean",
        "train/clip_fraction",
        "train/entropy",
        "throughput/tokens_per_s",
    ):
        assert key in metrics, key

    after = grpo_run.policy.get_logprobs(probe)["logprobs"]
    mask = probe["token_mask"].bool()
    if metrics["train/grad_norm"] > 0:  # the step changed the policy...
        assert not torch.allclose(before[mask], after[mask])
    # ...and after refit the generator samples from the updated policy
    again = rollout_batch(grpo_run, grpo_run.val_problems[:2], group_size=2)
    m2 = again["token_mask"].bool()
    trainer_lp = grpo_run.policy.get_logprobs(again)["logprobs"]
    assert (trainer_lp - again["generation_logprobs"]).abs()[m2].max() < 1e-4
