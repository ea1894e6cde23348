"""PPO with a learned critic (examples/configs/grpo_math_tiny_ppo.yaml) learns, keeps its critic in
its checkpoints, and resumes exactly after kill -9 (slow tier).

One uninterrupted run of 60 steps (validated at 0, 30 and 60; checkpoints at 20, 40, 60) is
the baseline for every assertion: the held-out accuracy moves (measured 39.8% -> 60.5-62.5%
at 60 steps; GRPO on the same batch shape: 58.2%), the critic's values follow the rewards, both lr
schedules span the run though the critic takes 4 optimizer steps a step, the reward's KL
penalty starts at 0 and grows as the policy leaves its reference, the critic's warm-up
(``critic.warmup_steps=3``) leaves the policy where it started for its steps, and a run killed
in step 45's training and rerun from its step-40 checkpoint (policy and critic) logs what the
baseline logged, number for number. A second run, asynchronous (the next batch generated
while a step trains, the critic scoring each batch when the trainer takes it), learns as well
(measured 39.8% -> 63.3% at 60 steps) and checkpoints its critic beside the buffer.
"""

from __future__ import annotations

import math

import pytest

from tests.grpo_runs import ASYNC, assert_same_run, records, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 60
WARMUP = 3  # critic.warmup_steps: the critic trains alone in steps 1-3
ARGS = [
    "--config", "examples/configs/grpo_math_tiny_ppo.yaml", f"grpo.max_num_steps={STEPS}",
    "grpo.val_period=30", "grpo.max_wall_time_s=null", "checkpointing.save_period=20",
    "checkpointing.keep_top_k=null", "logger.tensorboard_enabled=false",
    "critic.reward_kl_coef=0.05",  # TRL's kl_coef: the KL penalty in the reward, tested too
    f"critic.warmup_steps={WARMUP}",  # verl's critic_warmup, tested too
]  # fmt: skip


def _run(out, env=None):
    return run_job([*ARGS, f"logger.log_dir={out}/logs", f"checkpointing.checkpoint_dir={out}/ckpt"],
                   env)  # fmt: skip


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo")
    done = _run(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, records(out)


def test_ppo_learns_and_its_critic_follows_the_rewards(baseline):
    out, rows = baseline
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    assert 0.3 < val[0] < 0.5, val  # tiny-arith's start: neither trivially low nor high
    assert val[STEPS] >= val[0] + 0.10, val
    steps = [r for r in rows if "critic/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # A new head starts near 0; trained, the values track the mean reward (a critic that never
    # trained stays near 0 while the rewards' mean is ~0.2-0.3).
    late = steps[-10:]
    gap = sum(abs(r["critic/values_mean"] - r["train/reward_mean"]) for r in late) / len(late)
    assert gap < 0.08, gap
    assert sum(r["critic/loss"] for r in late) / len(late) < steps[0]["critic/loss"]
    # the KL penalty in the reward (reward_kl_coef): 0 while the policy is its reference (the
    # sampler's log-probs against the reference's, fp32: 1e-4), then the policy moves away
    # (measured ~0.02-0.05 nats a token from step 5)
    kl = [r["critic/reward_kl"] for r in steps]
    assert min(kl[10:]) > 0.005, kl
    # the warm-up: the policy, so the sampler, is its reference through step WARMUP + 1's
    # rollouts (measured without warm-up: 0.012 nats a token already at step 2, after one
    # policy step), and its first update comes in step WARMUP + 1
    assert max(abs(k) for k in kl[: WARMUP + 1]) < 1e-3, kl
    assert [r["critic/warming_up"] for r in steps] == [1.0] * WARMUP + [0.0] * (STEPS - WARMUP)
    trained = [r for r in steps if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(WARMUP + 1, STEPS + 1))
    # cosine to 0.1 x the peak over the steps each model trains: the policy's 57 (the update
    # k of n at 0.1 + 0.45 (1 + cos(pi (k - 1) / n)) of its peak) and the critic's 60 x 4
    # optimizer steps (a schedule counting optimizer steps as the run's would sit at its
    # floor from step 15 on)
    for k, r in enumerate(trained):
        want = 5e-5 * (0.1 + 0.45 * (1 + math.cos(math.pi * k / len(trained))))
        assert r["train/lr"] == pytest.approx(want, rel=1e-6), (r["step"], r["train/lr"], want)
    mid, last = steps[STEPS // 2 - 1]["critic/lr"] / 1e-3, steps[-1]["critic/lr"] / 1e-3
    assert 0.4 < mid < 0.7 and last < 0.15, (mid, last)
    assert (out / "ckpt" / f"step_{STEPS}" / "critic").is_dir()
    _check_exported_critic(out / "ckpt" / "final_critic_hf", late)


def _check_exported_critic(folder, late):
    """``final_critic_hf`` loads as a token classifier whose values are the trained critic's:
    on prompts, its mean value near the late steps' (a new head gives ~0.03 here, the trained
    one the mean reward, ~0.2-0.3)."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.num_labels == 1
    from tempering.models.tiny_arith import make_problems

    prompts = [p["prompt"] for p in make_problems(16, seed=0, split="test")]
    ids = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        values = model(**ids).logits[..., 0]
    last = ids["attention_mask"].sum(1) - 1  # the state before the answer's first token
    mean = float(values[torch.arange(len(prompts)), last].mean())
    want = sum(r["critic/values_mean"] for r in late) / len(late)
    assert abs(mean - want) < 0.1 and mean > 0.1, (mean, want)


def test_a_killed_ppo_run_resumes_its_policy_and_critic_exactly(baseline, tmp_path):
    _, want = baseline
    killed = _run(tmp_path, env={"TEMPERING_FAULT": f"controller:train:{45 - WARMUP}:0"})
    assert killed.returncode != 0, "the fault never fired"
    rerun = _run(tmp_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr
    assert_same_run(records(tmp_path), want, "PPO killed in step 45, rerun from step 40")


def test_asynchronous_ppo_learns_with_a_critic_scoring_each_batch_it_takes(tmp_path):
    done = run_job([*ARGS, *ASYNC, "checkpointing.save_period=60", f"logger.log_dir={tmp_path}/logs",
                    f"checkpointing.checkpoint_dir={tmp_path}/ckpt"])  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = records(tmp_path)
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    assert val[STEPS] >= val[0] + 0.10, val
    steps = [r for r in rows if "critic/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # the collector ran ahead: most batches were made by weights a step older than the trainer's
    ages = [r["train/max_trajectory_age"] for r in steps]
    assert sum(a >= 1 for a in ages) > STEPS // 2, ages
    # trained policy steps only after the warm-up; the sampler the reference until one is
    # taken (one batch more than in the synchronous run: the collector is a step ahead)
    assert [r["step"] for r in steps if "train/loss" in r] == list(range(WARMUP + 1, STEPS + 1))
    kl = [r["critic/reward_kl"] for r in steps]
    assert max(abs(k) for k in kl[: WARMUP + 1]) < 1e-3 and min(kl[10:]) > 0.005, kl
    late = steps[-10:]
    gap = sum(abs(r["critic/values_mean"] - r["train/reward_mean"]) for r in late) / len(late)
    assert gap < 0.08, gap
    final = tmp_path / "ckpt" / f"step_{STEPS}"
    assert (final / "critic").is_dir() and (final / "async_state.pt").is_file()
