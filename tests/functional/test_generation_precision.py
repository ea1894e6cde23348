"""Sampling in bfloat16 while the trainer stays float32 (`policy.generation.precision`), on
the committed tiny-arith model through the real pieces, once colocated (the engine inside the
policy worker) and once split (torch generation workers refitted through the object store):

- the engine really samples in bf16: its log-probs differ from the fp32 trainer's by more
  than fp32's 1e-4 agreement, yet stay close (the same model);
- split refits move bf16 bytes: half the fp32 state dict;
- a GRPO step logs the mismatch (`train/token_mult_prob_error` > 1) and, with the
  importance-sampling correction on, weights tokens by pi_trainer / pi_sampler
  (`train/is_weight_mean` != 1).

The learning claim (bf16 sampling learns as fp32 does) is a benchmark's, not a test's: 600
steps x 3 seeds (bench/bench_accuracy.py --variants bf16; README).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[2]
BF16_TIS = [
    "policy.generation.precision=bfloat16",
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_type=tis",
    "loss_fn.truncated_importance_sampling_ratio=2.0",
]


def _config(overrides: list[str]):
    return load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml", overrides, schema=GRPOMasterConfig
    )


@pytest.fixture(scope="module", params=["colocated", "split"])
def bf16_run(request, ray_session, tmp_path_factory):
    from tempering.algorithms import grpo

    tmp = tmp_path_factory.mktemp(f"bf16_{request.param}")
    split = ["policy.generation.colocated.enabled=false"] if request.param == "split" else []
    cfg, resolved = _config(
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.num_threads=1",
            "grpo.max_val_samples=16",
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
            *BF16_TIS,
            *split,
        ]
    )
    run = grpo.setup(cfg, resolved)
    yield request.param, run
    run.close()


def test_bf16_sampling_is_visible_and_corrected(bf16_run):
    from tempering.algorithms.grpo import grpo_step, rollout_batch
    from tempering.losses import ClippedPGLoss
    from tests.functional.test_grpo import generation_vs_trainer

    shape, run = bf16_run
    diff = generation_vs_trainer(run, rollout_batch(run, run.train_problems[:4], group_size=4))
    # fp32 sampling agrees within 1e-4 (test_grpo.py); bf16 rounds every weight and activation
    assert 1e-3 < diff < 0.5, f"{shape}: bf16 sampler vs fp32 trainer differ by {diff:.2e}"
    if shape == "split":  # weights travel in the engine's dtype: 2 bytes per element
        from tempering.models.hf import load_causal_lm

        weights = load_causal_lm("tiny-arith").state_dict().values()
        fp32_bytes = sum({t.data_ptr(): t.numel() * 4 for t in weights}.values())
        assert run.generation.last_refit_bytes == fp32_bytes // 2  # the tied embedding once

    loss_fn = ClippedPGLoss(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )
    metrics = grpo_step(run, loss_fn)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert metrics["train/token_mult_prob_error"] > 1.0 + 1e-3
    assert metrics["train/gen_kl_error"] > 0
    assert metrics["train/is_weight_mean"] != pytest.approx(1.0, abs=1e-6)


def test_precision_keys_are_checked_and_an_uncorrected_mismatch_is_said(caplog):
    from tempering.algorithms.grpo import _warn_uncorrected_precision
    from tempering.config.loader import ConfigError

    cfg, _ = _config([])
    assert cfg.policy.generation.precision is None
    assert cfg.policy.generation.torch_dtype_name == "float32"
    with pytest.raises(ConfigError, match="vllm_cfg.precision"):
        _config(["policy.generation.backend=vllm", "policy.generation.precision=bfloat16"])
    with pytest.raises(ConfigError, match="float16"):
        _config(["policy.generation.precision=float16"])

    with caplog.at_level(logging.WARNING, logger="tempering.algorithms.grpo"):
        _warn_uncorrected_precision(_config(BF16_TIS)[0])  # corrected: nothing to say
        assert not caplog.records
        _warn_uncorrected_precision(_config(["policy.generation.precision=bfloat16"])[0])
    assert "use_importance_sampling_correction=false" in caplog.text
