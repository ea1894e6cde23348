"""Your own problems as GRPO data (tempering/data/problems.py): JSONL and Hugging Face
sources, configurable keys, prompt/system-prompt files, and errors that name file:line (or
row) and the field."""

from __future__ import annotations

import json

import pytest

from tempering.algorithms.grpo import load_problems
from tempering.config.schemas import DataConfig
from tempering.data.problems import apply_prompt_template, load_problem_rows
from tempering.data.records import DataFormatError

# OpenMathInstruct-2's shape (NeMo RL's math example): problem, expected_answer, and more.
OMI2 = [
    {"problem": "What is 2+3?", "generated_solution": "2+3=5", "expected_answer": "5",
     "problem_source": "augmented_math"},
    {"problem": "Compute 7*6.", "generated_solution": "42", "expected_answer": 42,
     "problem_source": "math"},
    {"problem": "Half of 9?", "generated_solution": "4.5", "expected_answer": "\\frac{9}{2}",
     "problem_source": "gsm8k"},
]  # fmt: skip


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_openmathinstruct2_rows_load_with_the_default_keys(tmp_path):
    rows = load_problem_rows(_jsonl(tmp_path / "omi2.jsonl", OMI2))
    assert rows == [("What is 2+3?", "5"), ("Compute 7*6.", "42"), ("Half of 9?", "\\frac{9}{2}")]


def test_a_file_saved_with_a_byte_order_mark_and_crlf_loads(tmp_path):
    """Windows tools (Notepad, Excel's "UTF-8" export) start a file with a byte-order mark
    and end lines with CRLF; json.loads refused the first row of such a file."""
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl(path, OMI2).read_bytes().replace(b"\n", b"\r\n"))
    assert load_problem_rows(path) == load_problem_rows(_jsonl(tmp_path / "plain.jsonl", OMI2))


def test_other_keys_and_hugging_face_sources(tmp_path):
    import datasets

    custom = [{"question": r["problem"], "answer": r["expected_answer"]} for r in OMI2]
    assert len(load_problem_rows(_jsonl(tmp_path / "c.jsonl", custom), "question", "answer")) == 3
    table = datasets.Dataset.from_list(
        [{**r, "expected_answer": str(r["expected_answer"])} for r in OMI2]
    )
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(
        str(tmp_path / "hf")
    )
    assert len(load_problem_rows(tmp_path / "hf")) == 3
    assert load_problem_rows(tmp_path / "hf", split="test") == [("What is 2+3?", "5")]
    table.to_parquet(str(tmp_path / "p.parquet"))
    assert len(load_problem_rows(tmp_path / "p.parquet")) == 3
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_problem_rows(tmp_path / "hf", split="dev")


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"expected_answer": "5"}, r"omi2\.jsonl:2: missing field 'problem'"),
        ({"problem": "x"}, r"omi2\.jsonl:2: missing field 'expected_answer'.*data\.answer_key"),
        ({"problem": "", "expected_answer": "1"}, r":2: field 'problem' must be a non-empty"),
        ({"problem": "x", "expected_answer": [1]}, r":2: field 'expected_answer' must be a string"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, bad, needle):
    path = _jsonl(tmp_path / "omi2.jsonl", [OMI2[0], bad])
    with pytest.raises(DataFormatError, match=needle):
        load_problem_rows(path)
    assert len(load_problem_rows(path, on_bad_row="skip")) == 1  # skipped and counted instead


def test_hf_rows_name_the_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"problem": "a", "expected_answer": "1"},
                                {"problem": "b", "expected_answer": None}]).save_to_disk(str(tmp_path / "d"))  # fmt: skip
    with pytest.raises(DataFormatError, match=r"d:row 1: missing field 'expected_answer'"):
        load_problem_rows(tmp_path / "d")


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problem_rows(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nor a dataset in the local Hugging Face cache"):
        load_problem_rows("nobody/no-such-dataset-xyz")


def test_prompt_and_system_prompt_files_shape_every_problem(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Solve and box the answer.\n{}\nAnswer:")
    system = tmp_path / "system.txt"
    system.write_text("You are careful.")
    cfg = DataConfig(
        dataset_name="problems",
        train_data_path=str(_jsonl(tmp_path / "omi2.jsonl", OMI2 * 4)),
        num_val_samples=2,
        prompt_file=str(prompt),
        system_prompt_file=str(system),
        use_chat_template=True,
    )
    train, val = load_problems(cfg)
    assert len(train) == 10 and len(val) == 2  # held out of the training file
    assert all(p.task_name == "math" and p.system == "You are careful." for p in train + val)
    assert train[0].prompt == "Solve and box the answer.\nWhat is 2+3?\nAnswer:"
    assert load_problems(cfg)[1] == val  # the held-out split is deterministic
    with pytest.raises(ValueError, match="exactly one"):
        apply_prompt_template("no placeholder", "x")


def test_a_validation_share_larger_than_half_the_file_is_capped_and_said(tmp_path, caplog):
    path = _jsonl(tmp_path / "omi2.jsonl", OMI2 * 4)  # 12 problems, 256 asked for validation
    cfg = DataConfig(dataset_name="problems", train_data_path=str(path), num_val_samples=256)
    with caplog.at_level("WARNING", logger="tempering.data.grpo_problems"):
        train, val = load_problems(cfg)
    assert (len(train), len(val)) == (6, 6)
    (record,) = caplog.records
    assert "data.num_val_samples=256" in record.getMessage()
    assert "holds 12 problems: 6 (half) are held out" in record.getMessage()
    assert "data.val_data_path" in record.getMessage()
