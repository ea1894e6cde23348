"""On-policy distillation through the real pieces (fast tier): the student's FSDP2 worker with
its colocated torch generation, the teacher's own FSDP2 worker group (no optimizer), the
arithmetic environment actor, checkpoints -- one short run shared by the tests below, and one
run resumed from its middle checkpoint.

- the teacher's top-k reach the loss (KL and top-k mass metrics, the bytes that travelled);
- the teacher is frozen and the student moves;
- a run resumed from step 2's checkpoint reproduces steps 3 and 4 exactly (the teacher holds
  no state; the student's weights, optimizer, data order and sampling seeds come back);
- checkpoints hold the student alone, and the final model is the student's;
- multi-turn rollouts over the generation server, and NeMo Gym rollouts (protocol stand-in),
  are distilled through the same loop (one step each).

The loss's arithmetic (each kl_type against a hand-computed KL, k = vocabulary gives the full
KL) is tests/unit/test_distillation_loss.py; sharded teacher top-k against one rank is in
tests/unit/test_lora.py (DP 2 and TP 2); the teacher's placement and the vocabulary check are
tests/unit/test_placement.py.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from tempering.config import DistillationMasterConfig, load_config
from tests.grpo_runs import assert_documented

REPO = Path(__file__).parents[2]
STEPS = 4
COMPARED = ("train/loss", "train/kl_forward", "train/kl_reverse", "train/teacher_topk_mass",
            "train/reward_mean", "train/gen_length_mean", "train/grad_norm")  # fmt: skip


def _config(tmp: Path, *extra: str):
    return load_config(
        REPO / "examples/configs/distillation_math_tiny.yaml",
        [
            "distillation.num_prompts_per_step=4",
            "distillation.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.num_threads=1",
            "teacher.num_threads=1",
            "distillation.max_val_samples=32",
            "distillation.val_period=2",
            f"distillation.max_num_steps={STEPS}",
            "distillation.max_wall_time_s=null",
            "checkpointing.save_period=2",
            "checkpointing.keep_top_k=null",
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
            *extra,
        ],
        schema=DistillationMasterConfig,
    )


def _steps(log_dir: Path) -> dict[int, dict[str, float]]:
    assert_documented(log_dir)
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def distilled(ray_session, tmp_path_factory):
    """A 4-step run (checkpoints at 2 and 4), the teacher's top-k on a fixed batch before and
    after it, and a second run resumed from the step-2 checkpoint."""
    from tempering.algorithms import distillation

    tmp = tmp_path_factory.mktemp("distill")
    cfg, resolved = _config(tmp)
    run = distillation.setup(cfg, resolved)
    try:
        probe = _probe_batch(run)
        before = run.teacher.get_topk_logprobs(probe, k=8)
        student_before = run.student.policy.get_logprobs(probe)["logprobs"]
        summary = distillation.train(run)
        after = run.teacher.get_topk_logprobs(probe, k=8)
        student_after = run.student.policy.get_logprobs(probe)["logprobs"]
    finally:
        run.close()
    resumed_dir = tmp / "resumed"
    shutil.copytree(tmp / "ckpt", resumed_dir / "ckpt")
    shutil.rmtree(resumed_dir / "ckpt" / f"step_{STEPS}")  # killed after step 3: resume at 2
    cfg2, resolved2 = _config(resumed_dir)
    run2 = distillation.setup(cfg2, resolved2)
    try:
        assert run2.student.start_step == 2
        distillation.train(run2)
    finally:
        run2.close()
    return {
        "tmp": tmp, "summary": summary, "steps": _steps(tmp / "logs"),
        "resumed": _steps(resumed_dir / "logs"), "teacher": (before, after),
        "student": (student_before, student_after, probe),
    }  # fmt: skip


def _probe_batch(run):
    """A fixed batch of prompt + answer rows in the training layout."""
    from tempering.distributed.batched_data_dict import BatchedDataDict

    tok = run.student.tokenizer
    rows = [tok(f"Q: {a}+{b}=? A: {a + b}")["input_ids"] for a, b in ((12, 34), (56, 7), (9, 90))]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=mask)


def test_the_teachers_topk_reach_the_loss(distilled):
    steps = distilled["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    for m in steps.values():
        assert m["train/kl_forward"] > 0 and m["train/kl_reverse"] > 0
        assert 0 < m["train/teacher_topk_mass"] <= 1.0 + 1e-6
        assert m["timing/teacher_s"] > 0
        # 16 rows x width x k=64 x (fp32 log-probs + int32 ids): only these travel
        width = m["train/teacher_topk_mb"] * 2**20 / (16 * 64 * 8)
        assert width == int(width) and 8 <= width <= 32, width
    s = distilled["summary"]
    assert s["steps"] == STEPS and s["start_accuracy"] is not None
    assert (Path(s["final_model"]) / "config.json").is_file()


def test_the_teacher_is_frozen_and_the_student_moves(distilled):
    before, after = distilled["teacher"]
    assert torch.equal(before["teacher_topk_indices"], after["teacher_topk_indices"])
    assert torch.equal(before["teacher_topk_logprobs"], after["teacher_topk_logprobs"])
    student_before, student_after, probe = distilled["student"]
    valid = probe["token_mask"].bool()
    valid[:, 0] = False
    assert (student_after - student_before)[valid].abs().max() > 1e-3


def test_a_resumed_run_repeats_the_uninterrupted_steps_exactly(distilled):
    full, resumed = distilled["steps"], distilled["resumed"]
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == full[step][key], (step, key)


def test_checkpoints_hold_the_student_alone(distilled):
    ckpt = distilled["tmp"] / "ckpt" / f"step_{STEPS}"
    names = [p.name for p in ckpt.rglob("*")]
    assert names and not any("teacher" in n for n in names)


def test_self_distillation_is_allowed_and_said(tmp_path, caplog):
    """The student's own checkpoint as teacher is allowed and logged (checked without workers:
    the message comes before any start)."""
    from tempering.algorithms import distillation

    cfg, _ = _config(tmp_path, "teacher.model_name=tiny-arith")
    with caplog.at_level(logging.INFO, logger="tempering.algorithms.distillation"):
        distillation.say_if_self_distillation(cfg)
    assert "self-distillation" in caplog.text
    caplog.clear()
    cfg, _ = _config(tmp_path)
    distillation.say_if_self_distillation(cfg)
    assert "self-distillation" not in caplog.text


def _one_step(tmp: Path, *extra: str) -> dict[str, float]:
    """One distillation step (no validation, no checkpoint) with ``extra``; its metrics."""
    from tempering.algorithms import distillation

    cfg, resolved = _config(
        tmp, *extra, "distillation.max_num_steps=1", "distillation.val_at_start=false",
        "distillation.val_period=0", "checkpointing.enabled=false",
    )  # fmt: skip
    run = distillation.setup(cfg, resolved)
    try:
        distillation.train(run)
    finally:
        run.close()
    return _steps(tmp / "logs")[1]


def test_multi_turn_rollouts_over_http_are_distilled(ray_session, tmp_path):
    """GRPO's multi-turn loop over the generation server feeds distillation unchanged: the
    student (tiny-arith-chat) gets the question again after a wrong answer, and the teacher
    scores every assistant turn of the spliced sequences."""

    m = _one_step(
        tmp_path,
        "policy.model_name=tiny-arith-chat",
        "policy.max_total_sequence_length=64",
        "distillation.max_rollout_turns=3",
        "distillation.rollout_transport=http",
        "policy.generation.http_server.enabled=true",
        "env.task_name=arithmetic_retry",
    )
    assert m["train/turns_mean"] > 1.0  # some episodes were asked again
    assert m["server/requests"] > 16  # 16 episodes, some of several turns: one request each
    assert m["train/kl_forward"] > 0 and math.isfinite(m["train/loss"])


def test_nemo_gym_rollouts_are_distilled(ray_session, tmp_path):
    """NeMo Gym's protocol feeds distillation unchanged: Gym's agent calls the trainer's
    generation server for every episode (our protocol stand-in here; the real package is
    exercised by the GRPO tests of the slow tier, through the same rollout path)."""
    from tests.grpo_runs import gym_standin

    with gym_standin() as (gym, via_gym):
        m = _one_step(tmp_path, *via_gym)
        assert gym.chat_request_count() >= 16  # every episode went through Gym's agent
    assert m["train/kl_forward"] > 0 and math.isfinite(m["train/loss"])
