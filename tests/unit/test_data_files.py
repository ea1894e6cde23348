"""Every file-based loader (SFT, DPO/RM pairs, GRPO problems, NeMo Gym rows) reads the same
rows from JSON Lines, a JSON array, Parquet and CSV (tempering/data/records.py `iter_rows`).
SFT and preference files were JSONL only: a Parquet file (what a Hugging Face dataset is made
of) died with a `UnicodeDecodeError` traceback, and an Alpaca-style JSON array was "line 1: not
valid JSON" with advice to skip bad rows."""

from __future__ import annotations

import csv
import json

import pytest

from tempering.data.preference_datasets import load_preference_jsonl
from tempering.data.problems import load_problem_rows
from tempering.data.records import DataFormatError
from tempering.data.sft_datasets import load_prompt_response_jsonl

ROWS = [
    {"prompt": "What is 2+3?", "response": "5", "chosen": "5", "rejected": "6",
     "problem": "What is 2+3?", "expected_answer": "5"},
    {"prompt": "Name a colour.\u2028(one word)", "response": "blue", "chosen": "blue",
     "rejected": "seven", "problem": "Compute 7*6.", "expected_answer": "42"},
    {"prompt": "Café, «quoted», \"escaped\"", "response": "ok, done", "chosen": "ok",
     "rejected": "no", "problem": "Half of 9?", "expected_answer": "\\frac{9}{2}"},
]  # fmt: skip


def _write(path, rows):
    """``rows`` in the file format ``path``'s name asks for."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    else:  # ensure_ascii=False writes U+2028 raw, as many tools do
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


LOADERS = {
    "sft": load_prompt_response_jsonl,
    "preference": load_preference_jsonl,
    "problems": lambda path: load_problem_rows(path),
}


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv", ".txt"])
def test_each_format_loads_the_rows_jsonl_gives(tmp_path, kind, suffix):
    load = LOADERS[kind]
    expected = load(_write(tmp_path / "rows.jsonl", ROWS))
    got = load(_write(tmp_path / f"rows{suffix}", ROWS))
    if kind != "problems":
        expected, got = expected.examples, got.examples
    assert len(expected) == 3 and got == expected
    if kind == "sft":  # the line separator inside a string stayed in its row
        assert expected[1][0]["content"] == "Name a colour.\u2028(one word)"


def test_bad_rows_in_each_format_name_the_row_and_field(tmp_path):
    rows = [ROWS[0], {"prompt": "x"}]  # the second lacks 'response'
    for suffix, where in ((".jsonl", ":2: missing field"), (".json", ":row 1: missing field"),
                          (".parquet", ":row 1: missing field"),
                          (".csv", ":row 1: field"),  # a CSV cell is never absent, only empty
                          ):  # fmt: skip
        path = _write(tmp_path / f"bad{suffix}", rows)
        with pytest.raises(DataFormatError, match=f"{where} 'response'"):
            load_prompt_response_jsonl(path)
        assert len(load_prompt_response_jsonl(path, on_bad_row="skip")) == 1
    lines = tmp_path / "lines.jsonl"  # a .jsonl is read by lines even when one starts with '['
    lines.write_text('[1, 2]\n{"prompt": "a", "response": "b"}\n')
    with pytest.raises(DataFormatError, match=r"lines\.jsonl:1: expected a JSON object, got list"):
        load_prompt_response_jsonl(lines)
    assert len(load_prompt_response_jsonl(lines, on_bad_row="skip")) == 1
    array = tmp_path / "mixed.json"
    array.write_text(json.dumps([ROWS[0], ["not", "an", "object"]]))
    with pytest.raises(DataFormatError, match=r"mixed\.json:row 1: expected a JSON object"):
        load_prompt_response_jsonl(array)


def test_unreadable_files_are_named_with_the_fix(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9", "response": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"latin\.jsonl: not UTF-8 text \(byte 0xe9 at"):
        load_prompt_response_jsonl(latin)
    parquet_named_jsonl = tmp_path / "data.jsonl"
    parquet_named_jsonl.write_bytes(_write(tmp_path / "x.parquet", ROWS).read_bytes())
    with pytest.raises(DataFormatError, match="give a binary file its format's suffix"):
        load_prompt_response_jsonl(parquet_named_jsonl)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DataFormatError, match=r"broken\.parquet: not a readable Parquet file"):
        load_prompt_response_jsonl(broken)
    truncated = tmp_path / "cut.json"
    truncated.write_text(json.dumps(ROWS)[:-40])
    with pytest.raises(DataFormatError, match=r"cut\.json:1: not valid JSON .*one JSON array"):
        load_prompt_response_jsonl(truncated)


def test_num_train_samples_takes_the_first_rows_of_any_dataset_and_says_so(tmp_path, caplog):
    """data.num_train_samples made only the generated datasets to size: set with a file (or
    gsm8k) it was accepted and silently read nowhere."""
    import logging

    from tempering.algorithms.preference import load_preference_data
    from tempering.algorithms.sft import load_sft_data
    from tempering.config.schemas import DataConfig
    from tempering.data.grpo_problems import load_problems
    from tempering.models.hf import load_tokenizer

    rows = [{**ROWS[i % 3], "problem": f"What is {i}+1?", "expected_answer": str(i + 1),
             "response": str(i + 1)} for i in range(12)]  # fmt: skip
    path = str(_write(tmp_path / "rows.parquet", rows))
    tokenizer = load_tokenizer("tiny-arith")

    def loaded(n):
        common = {"train_data_path": path, "num_val_samples": 2, "num_train_samples": n}
        problems = DataConfig(dataset_name="problems", reasoning_gym_tasks=[], **common)
        sft = DataConfig(dataset_name="prompt_response", **common)
        pairs = DataConfig(dataset_name="preference", **common)
        return (load_problems(problems)[0], load_sft_data(sft, tokenizer, 64).train,
                load_preference_data(pairs).train)  # fmt: skip

    everything = loaded(None)
    assert [len(x) for x in everything] == [10, 10, 10]  # 12 rows, 2 held out
    with caplog.at_level(logging.WARNING, logger="tempering.data.records"):
        four = loaded(4)
    assert [len(x) for x in four] == [4, 4, 4]
    assert [x[:4] for x in everything] == list(four)  # the first rows, in the file's order
    assert f"data.num_train_samples=4: data.train_data_path={path!r} holds 10 problems; " \
        "training on the first 4" in caplog.text  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tempering.data.records"):
        assert [len(x) for x in loaded(50)] == [10, 10, 10]
    assert "holds 10 examples; training on all of them" in caplog.text
    # the generated datasets are made to that size, as before
    made = load_problems(DataConfig(num_train_samples=7, reasoning_gym_tasks=[]))[0]
    assert len(made) == 7
    assert len(load_problems(DataConfig(reasoning_gym_tasks=[]))[0]) == 20000


def test_a_validation_that_reads_part_of_its_data_says_so(tmp_path, caplog):
    """data.num_val_samples cut a validation file (or gsm8k's held-out split) without a word,
    and SFT/DPO/RM validation read only val_batches whole batches of what was held out."""
    import logging

    from tempering.algorithms.common import check_validation_batch
    from tempering.config.schemas import DataConfig
    from tempering.data.grpo_problems import load_problems

    rows = [{"problem": f"What is {i}+1?", "expected_answer": str(i + 1)} for i in range(12)]
    train, val = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "val.csv", rows)
    cfg = DataConfig(dataset_name="problems", train_data_path=str(train),
                     val_data_path=str(val), num_val_samples=5, reasoning_gym_tasks=[])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert [p.prompt for p in load_problems(cfg)[1]] == [r["problem"] for r in rows[:5]]
        check_validation_batch(300, 128, 2, "sft", 10, cfg, "examples")
        check_validation_batch(256, 128, 2, "sft", 10, cfg, "examples")  # reads them all
    assert f"data.num_val_samples=5: data.val_data_path='{val}' holds 12 problems; " \
        "validating on the first 5" in caplog.text  # fmt: skip
    assert caplog.text.count("each validation reads") == 1
    assert "each validation reads 256 of the 300 held-out examples (sft.val_batches=2 whole " \
        "batches of 128)" in caplog.text  # fmt: skip


def test_grpo_says_when_max_val_samples_reads_part_of_the_held_out_problems(caplog):
    import logging
    from pathlib import Path

    from tempering.algorithms.grpo import _problems
    from tempering.config import GRPOMasterConfig, load_config
    from tempering.models.hf import load_tokenizer

    config = Path(__file__).parents[2] / "examples/configs/grpo_math_tiny.yaml"
    tokenizer = load_tokenizer("tiny-arith")
    for num_val, warned in ((300, True), (256, False)):
        cfg, _ = load_config(config, [f"data.num_val_samples={num_val}"], schema=GRPOMasterConfig)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert len(_problems(cfg, tokenizer)[1]) == num_val
        said = "grpo.max_val_samples=256: each validation reads the first 256 of the 300"
        assert (said in caplog.text) == warned
