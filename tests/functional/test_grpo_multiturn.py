"""Multi-turn GRPO through the real pieces: the FSDP2 policy in a Ray worker with the torch
engine colocated, the arithmetic_retry environment as a Ray actor, the rollout loop in-process
and over HTTP through the OpenAI-compatible server the run starts.

- log-prob parity: for multi-turn episodes, the trainer's log-probs of every generated token
  equal the sampler's within 1e-4 (fp32) — what splicing turns onto earlier ids is for;
- the same greedy episodes come back over HTTP as in-process;
- GRPO steps over HTTP train (finite loss, moving policy), refit bumps the server's
  weight_version, and the multi-turn metrics are logged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    from tempering.algorithms import grpo

    tmp = tmp_path_factory.mktemp("grpo_mt")
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_multiturn_tiny.yaml",
        [
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=32",
            "policy.train_micro_batch_size=16",
            "policy.num_threads=1",
            "grpo.max_val_samples=16",
            "policy.generation.http_server.enabled=true",
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    yield run
    run.close()


def test_multi_turn_sampler_and_trainer_logprobs_agree(run):
    from tempering.algorithms.grpo import rollout_batch
    from tempering.algorithms.grpo_learning import TRAIN_KEYS
    from tempering.distributed.batched_data_dict import BatchedDataDict

    batch = rollout_batch(run, run.train_problems[:8], group_size=4)
    assert (batch["turns"] > 1).sum() >= 4, "too few multi-turn episodes to test the splice"
    data = BatchedDataDict({k: batch[k] for k in TRAIN_KEYS})
    trainer = run.policy.get_logprobs(data)["logprobs"]
    multi = batch["turns"] > 1
    mask = data["token_mask"].bool() & multi[:, None]
    diff = float((trainer - data["generation_logprobs"]).abs()[mask].max())
    assert diff < 1e-4, f"multi-turn generation vs trainer log-probs differ by {diff:.2e}"


def test_http_transport_serves_the_same_episodes(run):
    from tempering.algorithms.grpo import rollouts
    from tempering.experience.rollouts import HttpTurnClient

    local = rollouts(run, run.val_problems[:12], greedy=True)
    in_process = run.turns
    try:
        run.turns = HttpTurnClient(run.server.base_url, run.chat.settings.model_name)
        remote = rollouts(run, run.val_problems[:12], greedy=True)
    finally:
        run.turns = in_process
    for key in ("input_ids", "token_mask", "rewards", "turns"):
        assert torch.equal(local[key], remote[key]), key


def test_grpo_steps_over_http_train_and_refit(run):
    from tempering.algorithms.grpo import grpo_step, rollout_batch
    from tempering.experience.rollouts import HttpTurnClient
    from tempering.losses import ClippedPGLoss

    in_process = run.turns
    run.turns = HttpTurnClient(run.server.base_url, run.chat.settings.model_name)
    try:
        probe = rollout_batch(run, run.val_problems[:2], group_size=2)
        before = run.policy.get_logprobs(probe)["logprobs"]
        version = run.chat.weight_version
        metrics = [grpo_step(run, ClippedPGLoss()) for _ in range(2)]
    finally:
        run.turns = in_process
    assert run.chat.weight_version == version + 2
    for m in metrics:
        assert torch.isfinite(torch.tensor(m["train/loss"]))
        assert 1.0 <= m["train/turns_mean"] <= 3.0
        assert m["server/requests"] > 0 and "env/retry_failed" in m
    after = run.policy.get_logprobs(probe)["logprobs"]
    assert (before - after).abs()[probe["token_mask"].bool()].max() > 1e-4
