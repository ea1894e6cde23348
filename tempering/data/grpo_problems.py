"""GRPO's problems: prompts with ground-truth answers and the environment that scores them,
from a built-in dataset (arithmetic, gsm8k), your file (JSONL, JSON, Parquet, CSV / Hugging
Face), NeMo Gym rows, or reasoning-gym generators; `data.prompt_file` and
`data.system_prompt_file` applied."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tempering.config.schemas import GENERATED_TRAIN_SAMPLES, DataConfig
from tempering.data.records import data_source, first_n, first_val


@dataclass
class Problem:
    prompt: str
    answer: str
    task_name: str
    row: dict[str, Any] | None = None  # a NeMo Gym row (task "nemo_gym")
    system: str | None = None  # a system message before the prompt (data.system_prompt_file)
    blend: str | None = None  # the data.blend entry it came from (its name in metrics)


def load_problems(
    data_cfg: DataConfig, gym_route: str | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) prompts with ground-truth answers and their environment's name; the
    train prompts gain `data.reasoning_gym_tasks` problems when that list is set. NeMo Gym rows
    without routing fields go to `gym_route` (env.nemo_gym.default_route)."""
    from tempering.data.problems import apply_prompt_template, read_prompt_file

    train, val = _dataset_problems(data_cfg, gym_route)
    if data_cfg.dataset_name != "arithmetic":  # generated to data.num_train_samples already
        train = first_n(
            train,
            data_cfg.num_train_samples,
            data_source(data_cfg.train_data_path, data_cfg.dataset_name),
            "problems",
        )
    for task in data_cfg.reasoning_gym_tasks:
        train += reasoning_gym_problems(task, data_cfg.reasoning_gym_samples, data_cfg.seed)
    template = read_prompt_file(data_cfg.prompt_file, "prompt_file")
    system = read_prompt_file(data_cfg.system_prompt_file, "system_prompt_file")
    for p in train + val:
        if p.row is None:  # NeMo Gym rows carry their own messages
            p.prompt, p.system = apply_prompt_template(template, p.prompt), system
    return train, val


def reasoning_gym_problems(task: str, n: int, seed: int) -> list[Problem]:
    """`n` seeded problems from the `reasoning-gym` generator `task`, for the math environment."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    from tempering.data.gsm8k import gsm8k_user_prompt

    if task not in DATASETS:
        raise ValueError(
            f"data.reasoning_gym_tasks has {task!r}, which reasoning-gym does not know; pick "
            f"from {sorted(DATASETS)[:12]}... (e.g. basic_arithmetic, chain_sum)"
        )
    rows = reasoning_gym.create_dataset(task, size=n, seed=seed)
    return [Problem(gsm8k_user_prompt(r["question"]), str(r["answer"]), "math") for r in rows]


SINGLE_DIGIT_HELD_OUT = 54  # of the 162 single-digit problems (`single_digit_problems`)


def single_digit_problems(folder: Path) -> tuple[Path, Path]:
    """``folder/train.jsonl`` and ``folder/val.jsonl`` (``problem``/``expected_answer``) for
    ``data.dataset_name=problems``: "What is a + b?" and "a - b" for a, b in 1..9 in the GSM8K
    prompt, shuffled (seed 0), 54 of the 162 held out and the other 108 to train on. What
    SmolLM2-135M can partly do (61% greedy held out), where its GSM8K and chain sums score ~0-5%
    (bench_accuracy.py --scale smollm2, tests/functional/test_smollm2.py)."""
    from tempering.data.gsm8k import gsm8k_user_prompt
    from tempering.utils.atomic import atomic_write_text

    pairs = [(a, op, b) for a in range(1, 10) for b in range(1, 10) for op in "+-"]
    random.Random(0).shuffle(pairs)
    paths = folder / "train.jsonl", folder / "val.jsonl"
    held_out = SINGLE_DIGIT_HELD_OUT
    for path, part in zip(paths, (pairs[held_out:], pairs[:held_out]), strict=True):
        rows = [
            {"problem": gsm8k_user_prompt(f"What is {a} {op} {b}?"),
             "expected_answer": str(a + b if op == "+" else a - b)}
            for a, op, b in part
        ]  # fmt: skip
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return paths


def _dataset_problems(
    data_cfg: DataConfig, gym_route: str | None
) -> tuple[list[Problem], list[Problem]]:
    name = data_cfg.dataset_name
    if name == "arithmetic":
        from tempering.models.tiny_arith import make_problems

        def mk(n: int, split: str) -> list[Problem]:
            rows = make_problems(n, seed=data_cfg.seed, split=split)
            return [Problem(r["prompt"], r["answer"], "arithmetic") for r in rows]

        return mk(data_cfg.num_train_samples or GENERATED_TRAIN_SAMPLES, "train"), mk(
            data_cfg.num_val_samples, "test"
        )
    if name == "gsm8k":
        from tempering.data.gsm8k import gsm8k_rl_pairs, gsm8k_user_prompt

        def gsm(split: str) -> list[Problem]:
            return [Problem(gsm8k_user_prompt(q), a, "math") for q, a in gsm8k_rl_pairs(split)]

        val = first_val(gsm("test"), data_cfg.num_val_samples, "gsm8k's held-out split", "problems")
        return gsm("train"), val
    if name == "problems":
        return _file_problems(data_cfg)
    if name == "nemo_gym":
        train = _gym_problems(data_cfg.train_data_path, "train_data_path", gym_route)
        val = _gym_problems(data_cfg.val_data_path, "val_data_path", gym_route)
        source = f"data.val_data_path={data_cfg.val_data_path!r}"
        return train, first_val(val, data_cfg.num_val_samples, source, "rows")
    raise ValueError(
        f"data.dataset_name={name!r} has no GRPO prompts; use 'arithmetic', 'gsm8k', 'problems' "
        "(your data file / Hugging Face dataset) or 'nemo_gym'"
    )


def _file_problems(data_cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    """Your problems (tempering/data/problems.py), scored by math-verify unless
    env.task_name says otherwise; without a validation file, num_val_samples are held out of
    the training file (deterministically)."""
    from tempering.data.problems import load_problem_rows
    from tempering.data.records import hold_out

    if not data_cfg.train_data_path:
        raise ValueError(
            "data.dataset_name=problems needs data.train_data_path (a data file or a Hugging "
            "Face dataset)"
        )

    def rows(path: str, split: str) -> list[Problem]:
        pairs = load_problem_rows(
            path, data_cfg.problem_key, data_cfg.answer_key, split, data_cfg.on_bad_row
        )
        return [Problem(q, a, "math") for q, a in pairs]

    train = rows(data_cfg.train_data_path, data_cfg.train_split)
    if data_cfg.val_data_path:
        val = rows(data_cfg.val_data_path, data_cfg.val_split)
        source = f"data.val_data_path={data_cfg.val_data_path!r}"
        return train, first_val(val, data_cfg.num_val_samples, source, "problems")
    source = f"data.train_data_path={data_cfg.train_data_path!r}"
    return hold_out(train, data_cfg.num_val_samples, data_cfg.seed, source, "problems")


def _gym_problems(path: str | None, key: str, default_route: str | None) -> list[Problem]:
    """NeMo Gym JSONL rows (checked with file:line errors) as problems for task nemo_gym;
    ``key`` names the `data` setting ``path`` came from."""
    from tempering.data.nemo_gym import load_gym_rows, row_prompt_text
    from tempering.errors import DataFileNotFoundError

    if path is None:
        return []
    try:
        rows = load_gym_rows(path, default_route=default_route)
    except DataFileNotFoundError:
        raise DataFileNotFoundError(
            f"data.{key}={path!r} does not exist; write the example rows NeMo Gym ships there "
            f"with `uv run tempering gym-examples {path}`, or set data.{key} to your Gym JSONL"
        ) from None
    return [
        Problem(row_prompt_text(r), str(r.get("expected_answer", "")), "nemo_gym", r) for r in rows
    ]
