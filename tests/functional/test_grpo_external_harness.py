"""GRPO on episodes an external harness runs learns (slow tier): examples/harness_calculator.py
(the plain `openai` client, no tempering code, run as a confined subprocess each step) makes
every model call through the run's generation server under a rollout id; the trainer rebuilds
each episode from the recorded calls and trains on it.

The shipped config (grpo_external_harness_tiny.yaml: tiny-arith, 32 prompts x 8, exact-answer
reward reported by the harness), with the harness's single-attempt episodes here (its retry,
the config's ``--attempts 2``, doubles the calls per step; the fast tier tests the multi-turn
splice), for STEPS steps. Held-out greedy accuracy (256 problems, also through the harness)
starts at the committed model's ~39.8% and must gain at least MARGIN; every episode of every
step is accounted for in the counters, none failed, none non-contiguous, none of mixed weight
versions, and every model call the server answered was captured under some rollout id.

Measured (2026-12-07, 2-core CPU shared with other jobs): 39.8% -> 57.4% after 20 steps
(68 s of training, 94 s for the test with Ray's start), and 39.8% -> 57.4% after 30 steps
(109 s, beside a unit-test run); ~3.4 s a step, most of it the harness process's start
(importing `openai`) and 256 HTTP calls.
"""

from __future__ import annotations

import json

import pytest

from tests.grpo_runs import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 20
MARGIN = 0.08


def test_grpo_on_the_example_harness_learns_and_counts(ray_session, tmp_path):
    harness = '[python,examples/harness_calculator.py,--attempts,"1"]'
    s = train("grpo_external_harness_tiny.yaml", STEPS, tmp_path,
              [f"grpo.external_harness.command={harness}"])  # fmt: skip
    print(f"external harness: {s['start_accuracy']:.1%} -> {s['end_accuracy']:.1%} "
          f"in {s['wall_time_s']:.0f} s")  # fmt: skip
    assert s["steps"] == STEPS
    assert abs(s["start_accuracy"] - 0.398) < 0.03, s  # the committed model, through the harness
    assert s["end_accuracy"] - s["start_accuracy"] >= MARGIN, s
    rows = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollouts/external_episodes" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert r["rollouts/external_episodes"] == 256
        assert r["rollouts/external_model_calls"] == r["server/requests"] == 256  # one call each
        for key in ("failed", "noncontiguous", "mixed_weight_versions"):
            assert r[f"rollouts/external_{key}"] == 0, (r["step"], key)
