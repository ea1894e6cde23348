"""SFT teaches a model to use a tool (slow tier): the shipped config
(examples/configs/sft_tiny_arith_calculator.yaml: tiny-arith-chat, calculator-call
demonstrations, the run's own chat template) through the real loop (Ray worker group, FSDP2
worker), then ``tempering eval --task calculator`` on held-out problems: the exported model
calls the calculator, the tool runs, and its final answer is scored.

The start is tiny-arith-chat answering the same held-out problems itself (~40%); with the
learned tool use it must solve at least 30 points more.
"""

from __future__ import annotations

import pytest

from tests.sft_runs import train_sft

pytestmark = pytest.mark.slow


def test_sft_on_tool_calls_teaches_the_calculator(ray_session, tmp_path):
    from tempering.evaluation import evaluate

    model = train_sft("sft_tiny_arith_calculator.yaml", tmp_path)
    alone = evaluate("tiny-arith-chat", "arithmetic", samples=128, progress=False)
    tuned = evaluate(str(model), "calculator", samples=128, progress=False)
    assert 0.2 < alone.accuracy < 0.7, alone.accuracy  # a start that is not trivial
    assert tuned.accuracy >= alone.accuracy + 0.30, (alone.accuracy, tuned.accuracy)
    # it got there by calling the tool, and answering from its result
    called = sum(e["completions"][0].startswith("calculator(") for e in tuned.examples)
    assert called >= 0.9 * len(tuned.examples), tuned.examples[:3]
