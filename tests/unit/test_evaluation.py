"""`tempering eval`'s statistics and its command line (the agreement with GRPO validation is
tested with a real run in tests/functional/test_final_models.py)."""

from __future__ import annotations

import json

import pytest

from tempering.cli import main
from tempering.evaluation import eval_settings, paired_difference, wilson_interval


def test_wilson_interval_matches_known_values():
    lo, hi = wilson_interval(102, 256)  # 39.8%
    assert abs(lo - 0.3404) < 1e-3 and abs(hi - 0.4590) < 1e-3
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_paired_difference_uses_the_per_problem_differences():
    a = [True] * 60 + [False] * 40
    b = [True] * 40 + [False] * 60
    d, lo, hi = paired_difference(a, b)  # 20 problems flipped, all in a's favour
    assert abs(d - 0.2) < 1e-12 and 0.12 < lo < d < hi < 0.28
    same = paired_difference(a, a)
    assert same == (0.0, 0.0, 0.0)


def test_eval_command_prints_and_reports(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["eval", "tiny-arith", "--baseline", "tiny-arith", "--task", "arithmetic",
                 "--samples", "32", "--report", str(report)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "accuracy" in out and "difference +0.0 points [+0.0, +0.0]" in out
    data = json.loads(report.read_text())
    assert data["model"]["samples"] == 32 and len(data["model"]["examples"]) == 32
    assert data["difference"]["value"] == 0.0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["eval", "tiny-arith", "--task", "poetry"], "--task 'poetry' is unknown"),
        (["eval", "tiny-arith", "--task", "problems"], "needs --data"),
        (["eval", "/nonexistent/model", "--task", "arithmetic"], "neither a local folder"),
    ],
)
def test_eval_errors_name_the_problem(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_folder_of_weights_only_is_named_and_scored_with_tokenizer(tmp_path, capsys):
    """It died in a transformers traceback ("Couldn't instantiate the backend tokenizer")."""
    import shutil

    from tempering.models.registry import resolve_model_path

    weights = tmp_path / "weights_only"
    shutil.copytree(resolve_model_path("tiny-arith"), weights,
                    ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))  # fmt: skip
    base = ["eval", str(weights), "--task", "arithmetic", "--samples", "16"]
    assert main([*base, "--report", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert f"MODEL '{weights}': no tokenizer can be read from {weights}" in err
    assert "Fix: pass --tokenizer FOLDER_OR_ID" in err and "Traceback" not in err
    assert main([*base, "--tokenizer", "tiny-arith", "--baseline", "tiny-arith",
                 "--report", str(tmp_path / "r.json")]) == 0  # fmt: skip
    assert "difference +0.0 points [+0.0, +0.0]" in capsys.readouterr().out  # the same model


def test_a_base_models_prompts_are_raw_unless_the_template_is_asked_for():
    """A tokenizer without a chat template (a base model's) reads gsm8k's prompts raw, where
    an instruct model's go through its template; asking for the template is an error."""
    assert eval_settings("gsm8k", {}, None, None, None, has_template=True).use_chat_template
    assert not eval_settings("gsm8k", {}, None, None, None, has_template=False).use_chat_template
    with pytest.raises(ValueError, match="--chat-template asks for it: pass --no-chat-template"):
        eval_settings("gsm8k", {}, None, True, None, has_template=False)
    run = {"data": {"use_chat_template": True}}
    with pytest.raises(ValueError, match="its run set data.use_chat_template"):
        eval_settings("arithmetic", run, None, None, None, has_template=False)


def test_the_calculator_task_needs_a_template_and_its_budget_fits_the_model():
    """Offering a tool takes chat messages; a budget past the model's positions (4096 for a
    folder without a run config, tiny-arith's 128) would run off its position table."""
    from tempering.evaluation import eval_settings

    with pytest.raises(ValueError, match="--task calculator offers .* --tokenizer FOLDER"):
        eval_settings("calculator", {}, None, None, None, has_template=False)
    from tempering.evaluation import _max_positions
    from tempering.models.registry import resolve_model_path

    assert _max_positions(resolve_model_path("tiny-arith")) == 128  # what `tempering eval` passes
    settings = eval_settings("calculator", {}, None, None, None, max_positions=128)
    assert (settings.max_turns, settings.max_len, settings.use_chat_template) == (4, 128, True)
    assert eval_settings("arithmetic", {}, None, None, None, has_template=False).max_len == 4096
