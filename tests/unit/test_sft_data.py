"""SFT loaders: SQuAD JSON, messages JSONL, prompt/response JSONL, HF datasets, GSM8K, arithmetic."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from tempering.data.gsm8k import (
    GSM8K_INSTRUCTION,
    extract_final_answer,
    gsm8k_rl_pairs,
    gsm8k_sft_message_logs,
    load_gsm8k,
)
from tempering.data.records import DataFormatError, split_train_val
from tempering.data.sft_datasets import (
    load_hf_sft,
    load_messages_jsonl,
    load_prompt_response_jsonl,
    load_squad_json,
)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n",
        encoding="utf-8",
    )
    return path


SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Nile flows north into the Mediterranean.",
                    "qas": [
                        {
                            "id": "a",
                            "question": "Where does the Nile flow?",
                            "answers": [{"text": "north", "answer_start": 14}, {"text": "x"}],
                        },
                        {
                            "id": "b",
                            "question": "Into which sea?",
                            "answers": [{"text": "the Mediterranean", "answer_start": 25}],
                        },
                    ],
                }
            ],
        },
        {
            "title": "Cats",
            "paragraphs": [
                {
                    "context": "Cats sleep a lot.",
                    "qas": [{"id": "c", "question": "Do cats sleep?", "answers": []}],
                }
            ],
        },
    ],
}


def test_squad_json_user_is_context_and_question(tmp_path):
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(SQUAD))
    with pytest.raises(DataFormatError, match=r"squad.json:data\[1\].paragraphs\[0\].qas\[0\]"):
        load_squad_json(path)  # the unanswerable question
    data = load_squad_json(path, on_bad_row="skip")
    assert data.name == "squad" and len(data) == 2 and data.num_skipped == 1
    first = data.examples[0]
    assert [m["role"] for m in first] == ["user", "assistant"]
    assert "The Nile flows north" in first[0]["content"]
    assert "Where does the Nile flow?" in first[0]["content"]
    assert first[1]["content"] == "north"  # the first answer
    assert data.examples[1][1]["content"] == "the Mediterranean"


def test_messages_jsonl(tmp_path):
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}, {"messages": convo[:2]}])
    with pytest.raises(DataFormatError, match=r"chat.jsonl:2: .*no assistant message"):
        load_messages_jsonl(path)
    data = load_messages_jsonl(path, on_bad_row="skip")
    assert data.examples == [convo] and data.num_skipped == 1
    bad_role = write_jsonl(
        tmp_path / "role.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}]
    )
    with pytest.raises(DataFormatError, match=r"role.jsonl:1: field 'messages'\[0\].role"):
        load_messages_jsonl(bad_role)


def test_prompt_response_jsonl_custom_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "pr.jsonl",
        [{"input": "2+2?", "output": "4"}, {"input": "3+3?", "output": "6", "extra": 1}],
    )
    data = load_prompt_response_jsonl(path, prompt_key="input", response_key="output")
    assert data.examples[1] == [
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert data.num_skipped == 0


def test_bad_rows_name_file_line_and_field(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "a", "response": "b"},
            "",  # blank lines are not rows but still count as lines
            {"prompt": "c"},
            "{not json",
            {"prompt": "d", "response": 5},
            {"prompt": "e", "response": "f"},
        ],
    )
    with pytest.raises(DataFormatError) as err:
        load_prompt_response_jsonl(path)
    assert str(err.value).startswith(
        f"{path}:3: missing field 'response' (expected keys: prompt, response)"
    )
    data = load_prompt_response_jsonl(path, on_bad_row="skip")
    assert [log[0]["content"] for log in data.examples] == ["a", "e"]
    assert data.num_skipped == 3
    assert any(":4: not valid JSON" in r for r in data.skipped_reasons)
    assert any(
        ":5: field 'response' must be str or list, got int" in r for r in data.skipped_reasons
    )


def test_skipped_rows_are_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b", "response": "c"}])
    with caplog.at_level(logging.WARNING):
        data = load_prompt_response_jsonl(path, on_bad_row="skip")
    assert data.num_skipped == 1
    assert "skipped 1 bad row" in caplog.text


def test_hf_datasets_from_disk_and_data_files(tmp_path):
    import datasets

    rows = {"q": ["one", "two", "three"], "a": ["1", "2", None]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataFormatError, match=r"saved:row 2: missing field 'a'"):
        load_hf_sft(tmp_path / "saved", prompt_key="q", response_key="a")
    data = load_hf_sft(tmp_path / "saved", prompt_key="q", response_key="a", on_bad_row="skip")
    assert [log[1]["content"] for log in data.examples] == ["1", "2"]
    assert data.num_skipped == 1

    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    f1 = write_jsonl(tmp_path / "a.jsonl", [{"messages": convo}])
    f2 = write_jsonl(
        tmp_path / "b.jsonl", [{"messages": convo[:1] + [convo[1] | {"content": "hey"}]}]
    )
    data = load_hf_sft([str(f1), str(f2)], messages_key="messages")
    assert [log[1]["content"] for log in data.examples] == ["yo", "hey"]
    # one Parquet file: it was parsed as JSON ("JSON parse error: Invalid value. in row 0")
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "t.parquet"))
    data = load_hf_sft(tmp_path / "t.parquet", prompt_key="q", response_key="a", on_bad_row="skip")
    assert [log[1]["content"] for log in data.examples] == ["1", "2"]
    assert data.num_skipped == 1 and "t.parquet:row 2: missing field 'a'" in data.skipped_reasons[0]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_sft(tmp_path / "nope.parquet")


def test_gsm8k_split_is_deterministic_and_disjoint():
    train, heldout, everything = load_gsm8k("train"), load_gsm8k("heldout"), load_gsm8k("all")
    assert (len(train), len(heldout), len(everything)) == (1000, 319, 1319)
    assert {p.question for p in train}.isdisjoint(p.question for p in heldout)
    assert {p.question for p in train} | {p.question for p in heldout} == {
        p.question for p in everything
    }
    assert [p.question for p in load_gsm8k("train")] == [p.question for p in train]
    assert load_gsm8k("test") == heldout  # alias, the name tiny-arith uses
    with pytest.raises(ValueError, match="split 'dev'"):
        load_gsm8k("dev")  # type: ignore[arg-type]


def test_gsm8k_sft_and_rl_views():
    sft = gsm8k_sft_message_logs("heldout")
    assert len(sft) == 319
    user, assistant = sft.examples[0]
    assert user["content"].endswith(GSM8K_INSTRUCTION)
    assert re.search(r"#### -?\d+\s*$", assistant["content"])
    pairs = gsm8k_rl_pairs("train")
    assert len(pairs) == 1000
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", answer) for _, answer in pairs)
    janet = next(p for p in load_gsm8k("all") if p.question.startswith("Janet’s ducks"))
    assert janet.final_answer == "18"


def test_extract_final_answer_strips_commas():
    assert extract_final_answer("so 1,000+200=1,200\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_final_answer("the answer is 5")


def test_split_train_val_is_deterministic():
    items = list(range(100))
    train, val = split_train_val(items, 0.1, seed=1)
    assert len(val) == 10 and sorted(train + val) == items
    assert split_train_val(items, 0.1, seed=1) == (train, val)
    assert split_train_val(items, 0.1, seed=2)[1] != val


def test_arithmetic_sft_examples():
    from tempering.data.arithmetic import arithmetic_sft_message_logs
    from tempering.models import tiny_arith

    data = arithmetic_sft_message_logs(20, seed=3)
    problems = tiny_arith.make_problems(20, 3)
    assert all(p["answer"].lstrip("-").isdigit() for p in problems)
    assert len(data) == 20
    for log, problem in zip(data.examples, problems, strict=True):
        assert log == [
            {"role": "user", "content": problem["prompt"]},
            {"role": "assistant", "content": " " + problem["answer"]},
        ]
    assert arithmetic_sft_message_logs(20, seed=3).examples == data.examples


def test_arithmetic_tokenization_matches_tiny_arith_training_format():
    from tempering.data.arithmetic import arithmetic_sft_message_logs
    from tempering.data.processing import tokenize_message_log
    from tempering.models import tiny_arith

    tokenizer = tiny_arith.build_tokenizer()
    plain = tiny_arith.build_tokenizer()
    plain.chat_template = None
    logs = arithmetic_sft_message_logs(10, seed=0, ops=("+", "-")).examples
    for log, problem in zip(logs, tiny_arith.make_problems(10, 0, ops=("+", "-")), strict=True):
        expected = tiny_arith.format_sft_example(problem, tokenizer)
        for tok in (tokenizer, plain):  # chat-template path and concatenation fallback
            got = tokenize_message_log(log, tok, max_seq_len=64)
            assert got["input_ids"] == expected["input_ids"]
            assert got["token_mask"] == expected["token_mask"]


def test_load_sft_splits_by_dataset_name(tmp_path, caplog):
    from tempering.data.sft_datasets import load_sft_splits

    rows = [{"q": f"p{i}", "a": f"r{i}"} for i in range(10)]
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    val_file = write_jsonl(tmp_path / "val.jsonl", rows[:2])
    train, val = load_sft_splits("prompt_response", str(train_file), str(val_file), "q", "a")
    assert len(train) == 10 and [log[0]["content"] for log in val] == ["p0", "p1"]

    with caplog.at_level(logging.WARNING):
        train, val = load_sft_splits("prompt_response", str(train_file), None, "q", "a", num_val=8)
    assert (len(train), len(val)) == (5, 5)  # capped at half, and said so
    assert "data.num_val_samples=8, but data.train_data_path=" in caplog.text
    assert "holds 10 examples: 5 (half) are held out for validation and 5 train" in caplog.text
    assert {log[0]["content"] for log in train}.isdisjoint(log[0]["content"] for log in val)
    assert load_sft_splits("prompt_response", str(train_file), None, "q", "a", num_val=3) == (
        load_sft_splits("prompt_response", str(train_file), None, "q", "a", num_val=3)
    )
    with pytest.raises(ValueError, match="data.dataset_name='csv'"):
        load_sft_splits("csv", str(train_file))
    with pytest.raises(ValueError, match="needs data.train_data_path"):
        load_sft_splits("squad", None)


def test_plain_text_rows_train_every_token_and_hf_datasets_pick_their_format(tmp_path):
    """TRL's language-modelling rows (``{"text": ...}``, continued pretraining) were refused
    ("missing field 'prompt'"); now ``data.dataset_name=text`` reads them, and ``hf`` reads a
    dataset's rows by their columns as TRL does: ``messages``, prompt/response, or text."""
    import datasets

    from tempering.data.messages import Text
    from tempering.data.processing import tokenize_message_logs
    from tempering.data.sft_datasets import load_sft_splits, load_text_rows
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    lines = [{"text": f"Q: {i}+1=? A: {i + 1}"} for i in range(10)]
    path = write_jsonl(tmp_path / "corpus.jsonl", [*lines, {"text": "  "}, {"body": "x"}])
    with pytest.raises(DataFormatError, match=r"corpus.jsonl:11: field 'text' is empty"):
        load_text_rows(path)
    data = load_text_rows(path, on_bad_row="skip")
    assert data.examples[:2] == [Text("Q: 0+1=? A: 1"), Text("Q: 1+1=? A: 2")]
    assert data.num_skipped == 2 and "corpus.jsonl:12: missing field 'text'" in (
        data.skipped_reasons[1])  # fmt: skip
    train, val = load_sft_splits("text", str(path), num_val=2, on_bad_row="skip")
    assert (len(train), len(val)) == (8, 2)

    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    (example,), _ = tokenize_message_logs([Text("Q: 2+3=? A: 5")], tokenizer, 64)
    ids = tokenizer("Q: 2+3=? A: 5", add_special_tokens=True)["input_ids"]
    assert example["input_ids"] == [*ids, tokenizer.eos_token_id]  # ends its text
    assert example["token_mask"] == [0] + [1] * len(ids)  # every token after the first
    (cut,), n = tokenize_message_logs([Text("Q: 2+3=? A: 5")], tokenizer, 4)
    assert n == 1 and cut["truncated"] and len(cut["input_ids"]) == 4

    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = {"messages": [convo, None, None], "prompt": ["hi", "q", None],
            "response": [None, "a", None], "text": [None, None, "plain words"]}  # fmt: skip
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "mixed"))
    examples = load_hf_sft(tmp_path / "mixed").examples
    assert examples == [convo, [{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}], Text("plain words")]  # fmt: skip
    with pytest.raises(DataFormatError, match=r"no columns to train on: expected 'messages'"):
        load_hf_sft([str(write_jsonl(tmp_path / "odd.jsonl", [{"body": "x"}]))])


def test_split_long_texts_keeps_every_token_in_consecutive_windows(tmp_path):
    """Continued pretraining on documents longer than the sequence: with
    data.split_long_texts each text becomes windows of max_seq_len tokens whose concatenation
    is the whole text; each window trains every token but its first, none is truncated."""
    from tempering.data.messages import Text
    from tempering.data.processing import tokenize_message_logs
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("tiny-arith"))
    long_text, short_text = "Q: 12+34=? A: 46 Q: 5+6=? A: 11", "1+1"
    whole = [*tokenizer(long_text)["input_ids"], tokenizer.eos_token_id]
    assert len(whole) > 3 * 8 and len(whole) % 8 != 1  # several windows, a real last one
    examples, n = tokenize_message_logs([Text(long_text), Text(short_text)], tokenizer, 8, True)
    windows, short = examples[:-1], examples[-1]
    assert n == 0 and not any(e["truncated"] for e in examples)
    assert [t for w in windows for t in w["input_ids"]] == whole
    assert all(len(w["input_ids"]) == 8 for w in windows[:-1])
    assert all(w["token_mask"] == [0] + [1] * (len(w["input_ids"]) - 1) for w in windows)
    assert short["input_ids"] == [*tokenizer(short_text)["input_ids"], tokenizer.eos_token_id]
    # a last window of a single token would train nothing: left out
    one_over = Text("Q: 1+1=? A: 2 Q: 3+3=? A: 6")
    ids = [*tokenizer(one_over.text)["input_ids"], tokenizer.eos_token_id]
    size = len(ids) - 1  # one window of this size leaves one token over
    pieces, _ = tokenize_message_logs([one_over], tokenizer, size, True)
    assert [p["input_ids"] for p in pieces] == [ids[:size]]
    cut, n = tokenize_message_logs([Text(long_text)], tokenizer, 8)  # the default: cut, counted
    assert n == 1 and len(cut) == 1 and cut[0]["input_ids"] == whole[:8]

    # SFT's data loading reads the key, for the training and the validation rows alike
    from tempering.algorithms.sft import load_sft_data
    from tempering.config.schemas import DataConfig

    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": long_text}] * 6)
    for split, per_text in ((False, 1), (True, len(windows))):
        cfg = DataConfig(dataset_name="text", train_data_path=str(path), num_val_samples=2,
                         split_long_texts=split)  # fmt: skip
        data = load_sft_data(cfg, tokenizer, 8)
        assert (len(data.train), len(data.val)) == (4 * per_text, 2 * per_text)
