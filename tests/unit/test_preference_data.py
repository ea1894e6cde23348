"""Preference loaders (prompt/chosen/rejected, HelpSteer3, OpenAI messages), synthetic pairs,
and the interleaved preference collation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tempering.data.collate import collate_preference
from tempering.data.gsm8k import load_gsm8k
from tempering.data.preference_datasets import (
    PreferencePair,
    arithmetic_preference_pairs,
    corrupt_gsm8k_answer,
    corrupt_number,
    gsm8k_preference_pairs,
    load_helpsteer3_jsonl,
    load_messages_preference_jsonl,
    load_preference_jsonl,
    split_train_val,
)
from tempering.data.records import DataFormatError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE with a ChatML template (same recipe as test_processing)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["what is two plus two? four. five. user assistant"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHATML
    return fast


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_prompt_chosen_rejected_strings_and_messages(tmp_path):
    path = write_jsonl(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
            {"prompt": [user("hi")], "chosen": [assistant("hello")], "rejected": [assistant("go")]},
        ],
    )
    data = load_preference_jsonl(path)
    assert data.examples[0] == PreferencePair([user("2+2?")], [assistant("4")], [assistant("5")])
    assert data.examples[1].chosen == [assistant("hello")]
    renamed = write_jsonl(
        tmp_path / "nemo.jsonl",
        [{"prompt": "q", "chosen_response": "a", "rejected_response": "b"}],
    )
    data = load_preference_jsonl(
        renamed, chosen_key="chosen_response", rejected_key="rejected_response"
    )
    assert data.examples[0].rejected == [assistant("b")]


def test_bad_preference_rows_are_reported_or_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "pref.jsonl",
        [
            {"prompt": "a", "chosen": "x", "rejected": "y"},
            {"prompt": "b", "chosen": "  ", "rejected": "y"},
            {"prompt": "c", "chosen": "same", "rejected": "same"},
            {"prompt": "d", "chosen": "x"},
            {"prompt": "e", "chosen": [user("not an answer")], "rejected": "y"},
        ],
    )
    with pytest.raises(DataFormatError, match=r"pref.jsonl:2: field 'chosen' is empty"):
        load_preference_jsonl(path)
    data = load_preference_jsonl(path, on_bad_row="skip")
    assert len(data) == 1 and data.num_skipped == 4
    reasons = "\n".join(data.skipped_reasons)
    assert ":3: 'chosen' is identical to 'rejected'" in reasons
    assert ":4: missing field 'rejected' (expected keys: prompt, chosen, rejected)" in reasons
    assert ":5: field 'chosen' must end with an assistant message" in reasons


def test_helpsteer3_negative_preference_means_response1(tmp_path):
    context = [user("pick one"), assistant("ok"), user("now?")]
    path = write_jsonl(
        tmp_path / "hs3.jsonl",
        [
            {"context": context, "response1": "A", "response2": "B", "overall_preference": -2},
            {"context": "plain", "response1": "A", "response2": "B", "overall_preference": 3},
            {"context": "tie", "response1": "A", "response2": "B", "overall_preference": 0},
            {"context": "t", "response1": "A", "response2": "B", "overall_preference": "1"},
        ],
    )
    with pytest.raises(DataFormatError, match=r"hs3.jsonl:3: .*tie"):
        load_helpsteer3_jsonl(path)
    data = load_helpsteer3_jsonl(path, on_bad_row="skip")
    assert data.num_skipped == 2
    first, second = data.examples
    assert first.prompt == context
    assert (first.chosen, first.rejected) == ([assistant("A")], [assistant("B")])
    assert (second.chosen, second.rejected) == ([assistant("B")], [assistant("A")])
    assert "overall_preference' must be int, got str" in data.skipped_reasons[1]


def test_openai_messages_variant_splits_at_shared_prefix(tmp_path):
    prefix = [{"role": "system", "content": "be kind"}, user("help?")]
    path = write_jsonl(
        tmp_path / "msgs.jsonl",
        [
            {"chosen": prefix + [assistant("sure")], "rejected": prefix + [assistant("no")]},
            {"chosen": [user("x"), assistant("a")], "rejected": [user("y"), assistant("b")]},
        ],
    )
    with pytest.raises(DataFormatError, match=r"msgs.jsonl:2: .*share no prompt"):
        load_messages_preference_jsonl(path)
    data = load_messages_preference_jsonl(path, on_bad_row="skip")
    assert data.examples == [PreferencePair(prefix, [assistant("sure")], [assistant("no")])]


def test_validation_split_of_pairs(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(20)]
    data = load_preference_jsonl(write_jsonl(tmp_path / "p.jsonl", rows))
    train, val = split_train_val(data.examples, 0.25, seed=0)
    assert len(train) == 15 and len(val) == 5
    assert {p.prompt[0]["content"] for p in train}.isdisjoint(p.prompt[0]["content"] for p in val)


def test_corrupt_number_never_returns_input():
    for value in ["0", "7", "68", "-3", "1,200", "2.5"]:
        outs = {corrupt_number(value, f"s{i}") for i in range(50)}
        assert value.replace(",", "") not in outs
        if not value.startswith("-"):
            assert all(not o.startswith("-") for o in outs)
    assert corrupt_number("68", "k") == corrupt_number("68", "k")


def test_gsm8k_synthetic_pairs_corrupt_final_and_sometimes_a_step():
    data = gsm8k_preference_pairs("train")
    problems = load_gsm8k("train")
    assert len(data) == 1000 and "preference" in data.name
    step_changed = 0
    for pair, problem in zip(data.examples, problems, strict=True):
        chosen, rejected = pair.chosen[0]["content"], pair.rejected[0]["content"]
        assert chosen == problem.worked_answer
        wrong_final = rejected.rsplit("####", 1)[1].strip()
        assert wrong_final != problem.final_answer
        steps = re.findall(r"<<[^<>]*>>", chosen)
        step_changed += steps != re.findall(r"<<[^<>]*>>", rejected)
        assert len(re.findall(r"<<[^<>]*>>", rejected)) == len(steps)
    assert 300 < step_changed < 700  # about half the problems also get a wrong step
    assert gsm8k_preference_pairs("train").examples == data.examples


def test_corrupt_gsm8k_step_changes_annotation_and_visible_result():
    answer = "She has 3 * 4 = <<3*4=12>>12 apples.\n#### 12"
    variants = {corrupt_gsm8k_answer(answer, f"salt{i}") for i in range(20)}
    with_step = [v for v in variants if "<<3*4=12>>" not in v]
    assert with_step, "some salts must corrupt the step"
    for v in with_step:
        m = re.search(r"<<3\*4=(\d+)>>(\d+) apples", v)
        assert m and m.group(1) == m.group(2) != "12"


def test_collate_preference_interleaves_and_masks_responses(tokenizer):
    pairs = [
        PreferencePair([user("what is two plus two?")], [assistant("four.")], [assistant("five.")]),
        PreferencePair(
            [user("two?"), assistant("two."), user("plus two?")],
            [assistant("four.")],
            [assistant("five. five.")],
        ),
    ]
    batch = collate_preference(pairs, tokenizer, max_seq_len=128)
    assert batch["input_ids"].shape[0] == 4
    for row, expected in enumerate(["four.", "five.", "four.", "five. five."]):
        ids = batch["input_ids"][row].tolist()
        mask = batch["token_mask"][row].tolist()
        response_ids = [i for i, m in zip(ids, mask, strict=True) if m]
        # Only the final response (and its end-of-turn) is loss; the earlier "two." turn is not.
        assert tokenizer.decode(response_ids) == expected + "<|im_end|>\n"
        n = int(batch["input_lengths"][row])
        assert tokenizer.decode(ids[:n]).startswith("<|im_start|>user\n")
    assert batch["sample_mask"].tolist() == [1.0] * 4


def test_collate_preference_drops_pair_when_one_side_truncated_away(tokenizer):
    short = PreferencePair([user("two?")], [assistant("four.")], [assistant("five.")])
    long_prompt = PreferencePair(
        [user("what is two plus two? " * 3)], [assistant("four.")], [assistant("five.")]
    )
    fits = int(collate_preference([short], tokenizer, 1024)["input_lengths"].max())
    batch = collate_preference([short, long_prompt], tokenizer, max_seq_len=fits)
    # The long prompt alone exceeds `fits`, so both of its rows lose every response token.
    assert batch["token_mask"][2:].sum() == 0
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_arithmetic_synthetic_pairs():
    from tempering.models import tiny_arith

    data = arithmetic_preference_pairs(50, seed=1)
    problems = tiny_arith.make_problems(50, 1)
    for pair, problem in zip(data.examples, problems, strict=True):
        assert pair.prompt == [user(problem["prompt"])]
        assert pair.chosen == [assistant(" " + problem["answer"])]
        wrong = pair.rejected[0]["content"]
        assert wrong.startswith(" ") and wrong.strip() != problem["answer"]
        assert wrong.strip().lstrip("-").isdigit()
    assert arithmetic_preference_pairs(50, seed=1).examples == data.examples


def test_load_preference_splits(tmp_path):
    from tempering.data.preference_datasets import load_preference_splits

    rows = [
        {"context": f"c{i}", "response1": "a", "response2": "b", "overall_preference": 1}
        for i in range(6)
    ]
    path = write_jsonl(tmp_path / "hs3.jsonl", rows)
    train, val = load_preference_splits("helpsteer3", str(path), num_val=2, seed=5)
    assert (len(train), len(val)) == (4, 2)
    assert all(p.chosen == [assistant("b")] for p in train + val)
    train, val = load_preference_splits("gsm8k", num_val=10)
    assert (len(train), len(val)) == (1000, 10)
    with pytest.raises(ValueError, match="not a preference dataset"):
        load_preference_splits("squad", str(path))


def test_parity_pairs_reward_only_parity():
    from tempering.data.preference_datasets import arithmetic_parity_pairs
    from tempering.environments.arithmetic import first_integer
    from tempering.models.tiny_arith import make_problems

    pairs = arithmetic_parity_pairs(200, seed=3, split="test").examples
    answers = [p["answer"] for p in make_problems(200, 3, "test")]
    for pair, answer in zip(pairs, answers, strict=True):
        chosen = first_integer(pair.chosen[-1]["content"])
        rejected = first_integer(pair.rejected[-1]["content"])
        assert chosen % 2 == 0 and rejected % 2 == 1
        assert str(chosen) != answer and str(rejected) != answer
    assert [p.chosen for p in arithmetic_parity_pairs(200, 3, "test").examples] == [
        p.chosen for p in pairs
    ]  # deterministic
