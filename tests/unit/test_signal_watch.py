"""The no-learning-signal warning (tempering/algorithms/signal_watch.py; issue 27 item 8).

A GRPO run on a user's problems without a prompt template generated empty answers for every
prompt: all groups had zero reward variance, loss and gradients were 0 for 40 steps, and the
run said nothing. The watch is a pure class fed per-step stats; the last test drives the
function `grpo_step` calls (the functional GRPO run in test_final_models.py checks that
every step reaches it).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tempering.algorithms.signal_watch import (
    NO_SIGNAL_FRACTION,
    NO_SIGNAL_STEPS,
    SignalWatch,
    StepSignal,
    parse_failures,
    step_signal,
)


def stats(flat: int, groups: int = 32, failed: int = 0, answers: int = 128) -> StepSignal:
    return StepSignal(groups, flat, answers, failed, 0.0, "'Q: 2+2' -> '' -> '4'")


DEAD = stats(flat=32, failed=127)  # the run: nothing varies, nothing parses
HEALTHY = stats(flat=10, failed=3)


def test_thresholds_are_the_documented_ones():
    assert (NO_SIGNAL_FRACTION, NO_SIGNAL_STEPS) == (0.8, 5)


def test_fires_after_n_consecutive_dead_steps_with_counts_and_sample():
    watch = SignalWatch(steps=3)
    assert watch.observe(1, DEAD) is None and watch.observe(2, DEAD) is None
    text = watch.observe(3, DEAD)
    assert text and "3 steps in a row (to step 3)" in text
    assert "32 of 32 groups had zero reward variance" in text
    assert "127 of 128 answers failed to parse" in text
    assert "'Q: 2+2' -> '' -> '4'" in text and "data.prompt_file" in text
    assert watch.warning == text


def test_fires_only_once():
    watch = SignalWatch(steps=2)
    given = [watch.observe(s, DEAD) for s in range(1, 10)]
    assert sum(g is not None for g in given) == 1 and given[1] is not None


def test_either_condition_alone_counts():
    flat_only = stats(flat=26, failed=0)  # 26/32 >= 0.8: rewards all equal, answers parse
    unparsed_only = stats(flat=5, failed=103)  # 103/128 >= 0.8
    for s in (flat_only, unparsed_only):
        watch = SignalWatch(steps=2)
        watch.observe(1, s)
        assert watch.observe(2, s) is not None


def test_healthy_steps_never_fire_and_reset_the_count():
    watch = SignalWatch(steps=3)
    assert all(watch.observe(s, HEALTHY) is None for s in range(1, 20))
    below = stats(flat=25, failed=102)  # just under 0.8 of each
    assert all(watch.observe(s, below) is None for s in range(20, 30))
    watch.observe(30, DEAD)
    watch.observe(31, DEAD)
    watch.observe(32, HEALTHY)  # resets
    assert watch.observe(33, DEAD) is None and watch.observe(34, DEAD) is None
    assert watch.observe(35, DEAD) is not None


def test_steps_without_parse_counters_judge_by_variance_alone():
    watch = SignalWatch(steps=1)
    assert watch.observe(1, stats(flat=3, failed=0, answers=0)) is None  # reward_fn: no parsing
    assert watch.observe(2, stats(flat=32, failed=0, answers=0)) is not None


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="fraction=0"):
        SignalWatch(fraction=0)


def test_parse_counters_are_summed_over_environments():
    metrics = {"env/math_parse_failures": 5.0, "env/math_samples": 8.0,
               "env/arithmetic_no_integer": 2.0, "env/arithmetic_samples": 4.0}  # fmt: skip
    assert parse_failures(metrics) == (7, 12)
    s = step_signal(torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0]), 2, metrics, str)
    assert (s.groups, s.zero_variance_groups, s.answers, s.parse_failures) == (3, 2, 12, 7)
    assert s.sample == "0"  # the first sample of the first zero-variance group
    s = step_signal(torch.tensor([0.0, 1.0, 1.0, 0.0]), 2, {}, str)
    assert s.zero_variance_groups == 0 and s.sample == "0" and s.answers == 0


def test_grpo_logs_the_warning_once_and_its_summary_repeats_it(caplog):
    from tempering.algorithms import grpo
    from tempering.config import GRPOMasterConfig

    cfg = GRPOMasterConfig()
    G = cfg.grpo.num_generations_per_prompt
    run = SimpleNamespace(cfg=cfg, signal=SignalWatch())
    problems = [grpo.Problem("23+45", "68", "math"), grpo.Problem("1+2", "3", "math")]
    logs = [[{"role": "user", "content": p.prompt}, {"role": "assistant", "content": ""}]
            for p in problems for _ in range(G)]  # fmt: skip
    metrics = {"env/math_parse_failures": 2.0 * G, "env/math_samples": 2.0 * G}
    with caplog.at_level(logging.WARNING, logger="tempering.algorithms.grpo"):
        for step in range(1, 2 * NO_SIGNAL_STEPS):
            grpo.watch_signal(run, step, problems, logs, torch.zeros(2 * G), metrics)
    warnings = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"to step {NO_SIGNAL_STEPS}" in warnings[0]
    assert "'23+45' -> '' -> '68'" in warnings[0]
    summary = {"steps": 9, "steps_this_run": 9, "wall_time_s": 1.0, "start_accuracy": 0.0,
               "end_accuracy": 0.0, "final_model": "x", "warning": run.signal.warning}  # fmt: skip
    assert f"WARNING: {warnings[0].removeprefix('GRPO: ')}" in grpo.summary_text(summary, cfg)


def test_with_a_critic_the_batch_is_one_group(caplog):
    """PPO (critic.enabled) learns from any difference between the batch's rewards: one
    sample per prompt is no missing signal (each "group" of one has zero variance), a batch
    of equal rewards is."""
    from tempering.algorithms import grpo
    from tempering.config import GRPOMasterConfig

    cfg = GRPOMasterConfig(critic={"enabled": True}, grpo={
        "num_prompts_per_step": 32, "num_generations_per_prompt": 1,
        "use_leave_one_out_baseline": False})  # fmt: skip
    problems = [grpo.Problem(f"{i}+1", str(i + 1), "math") for i in range(4)]
    logs = [[{"role": "assistant", "content": "1"}] for _ in problems]

    def warned(rewards: torch.Tensor) -> bool:
        run = SimpleNamespace(cfg=cfg, signal=SignalWatch())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tempering.algorithms.grpo"):
            for step in range(1, 2 * NO_SIGNAL_STEPS):
                grpo.watch_signal(run, step, problems, logs, rewards, {})
        return any("no learning signal" in r.getMessage() for r in caplog.records)

    assert not warned(torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert warned(torch.zeros(4))
