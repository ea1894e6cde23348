"""SFT on plain text teaches (slow tier): tiny-arith (about 40% on held-out sums) trained on
``{"text": "Q: 95+44=? A: 139"}`` rows (``data.dataset_name=text``: no roles, no template, the
loss on every token) through the real loop, then scored by ``tempering eval``'s arithmetic
task. Measured 2026-11-30: 39.8% -> 72.3% in 150 steps; it must gain at least 20 points.
"""

from __future__ import annotations

import json

import pytest

from tests.sft_runs import train_sft

pytestmark = pytest.mark.slow


def test_continued_pretraining_on_text_rows_teaches_the_sums(ray_session, tmp_path):
    from tempering.evaluation import evaluate
    from tempering.models.tiny_arith import make_problems

    corpus = tmp_path / "sums.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{p['prompt']} {p['answer']}"}) + "\n"
                              for p in make_problems(20000, seed=0, split="train")))  # fmt: skip
    model = train_sft("sft.yaml", tmp_path, [
        "policy.model_name=tiny-arith", "data.dataset_name=text",
        f"data.train_data_path={corpus}", "data.num_train_samples=null",
        "sft.stop_val_accuracy_range=null", "sft.val_period=0", "sft.max_num_steps=150",
        "policy.optimizer.kwargs.lr=3.0e-4",
    ])  # fmt: skip
    start = evaluate("tiny-arith", "arithmetic", samples=256, progress=False)
    tuned = evaluate(str(model), "arithmetic", samples=256, progress=False)
    assert 0.2 < start.accuracy < 0.7, start.accuracy  # a start that is not trivial
    assert tuned.accuracy >= start.accuracy + 0.20, (start.accuracy, tuned.accuracy)
