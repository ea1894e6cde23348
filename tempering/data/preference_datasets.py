"""Preference data for DPO and reward models: local JSONL loaders and synthetic pairs.

Every loader returns a :class:`~tempering.data.records.LoadedData` of :class:`PreferencePair`
(``prompt``, ``chosen``, ``rejected``: message logs; chosen/rejected continue the prompt and
end with an assistant message). Formats, one JSON object per row (of any data file
`records.iter_rows` reads: JSON Lines, a JSON array, Parquet, CSV):

- :func:`load_preference_jsonl`: ``{"prompt": str | messages, "chosen": str | messages,
  "rejected": str | messages}`` (keys configurable, e.g. NeMo RL's ``chosen_response`` /
  ``rejected_response``). A string prompt becomes one user message, a string response one
  assistant message.
- :func:`load_helpsteer3_jsonl`: HelpSteer3 ``{"context": str | messages, "response1": str,
  "response2": str, "overall_preference": int}``; as in NeMo RL, a negative preference means
  response1 is better, a positive one response2. 0 is a tie and is a bad row here (there is
  no preferred response to learn from).
- :func:`load_messages_preference_jsonl`: OpenAI-messages ``{"chosen": messages,
  "rejected": messages}``, two full conversations; their longest shared prefix is the
  prompt and the remainders are the responses.

Bad rows (missing or mistyped field, empty chosen, chosen identical to rejected) raise
:class:`~tempering.data.records.DataFormatError` naming file, line and field, or are
skipped and counted with ``on_bad_row="skip"``. :func:`split_train_val` makes a
deterministic validation split; :func:`load_preference_splits` is the config entry point
(``data.dataset_name`` in :data:`PREFERENCE_LOADERS`, or the synthetic "arithmetic" / "gsm8k").

**Synthetic data** (no preference dataset can be downloaded here; these are built from real
problems and are clearly not human preferences):

- :func:`arithmetic_preference_pairs`: tiny-arith problems, chosen = the correct answer,
  rejected = the same answer with its number corrupted.
- :func:`gsm8k_preference_pairs`: GSM8K worked answers, chosen = the worked answer,
  rejected = the same solution with the final ``#### N`` corrupted and, for about half the
  problems, also one intermediate calculator step ``<<a*b=c>>c`` changed.

Corruption is deterministic (keyed by sha256 of a salt) and never returns the input number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from tempering.data.messages import (
    as_prompt,
    as_response,
    check_message_log,
    check_tool_turns,
    row_tools,
)
from tempering.data.records import (
    LoadedData,
    MessageLog,
    OnBadRow,
    RowError,
    hold_out,
    load_rows,
    require,
    split_train_val,
    stable_hash,
)

__all__ = [
    "PreferencePair",
    "arithmetic_preference_pairs",
    "corrupt_gsm8k_answer",
    "corrupt_number",
    "gsm8k_preference_pairs",
    "load_helpsteer3_jsonl",
    "load_messages_preference_jsonl",
    "load_preference_jsonl",
    "load_preference_splits",
    "split_train_val",
]


@dataclass(frozen=True)
class PreferencePair:
    prompt: MessageLog
    chosen: MessageLog
    rejected: MessageLog
    tools: list[dict[str, Any]] | None = None  # function specs the assistant may call


# ---------------------------------------------------------------- validation helpers


def _checked_pair(
    prompt: MessageLog, chosen: MessageLog, rejected: MessageLog, row: dict[str, Any]
) -> PreferencePair:
    """The pair, with the row's ``tools`` (data/messages.py) when it has them."""
    if chosen == rejected:
        raise RowError("'chosen' is identical to 'rejected' (no preference to learn)")
    check_tool_turns(prompt + chosen, "prompt + chosen")
    check_tool_turns(prompt + rejected, "prompt + rejected")
    return PreferencePair(prompt, chosen, rejected, row_tools(row) or None)


# ---------------------------------------------------------------- loaders


def load_preference_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    on_bad_row: OnBadRow = "error",
) -> LoadedData:
    """``{prompt, chosen, rejected}`` JSONL; each a string or a list of messages."""
    keys = [prompt_key, chosen_key, rejected_key]
    kinds = (str, list)

    def convert(row: dict[str, Any]) -> PreferencePair:
        prompt = as_prompt(require(row, prompt_key, keys, kinds), prompt_key)
        chosen = as_response(require(row, chosen_key, keys, kinds), chosen_key)
        rejected = as_response(require(row, rejected_key, keys, kinds), rejected_key)
        return _checked_pair(prompt, chosen, rejected, row)

    return load_rows(path, on_bad_row, convert)


def load_helpsteer3_jsonl(path: str | Path, on_bad_row: OnBadRow = "error") -> LoadedData:
    """HelpSteer3 preference JSONL (``context``, ``response1``, ``response2``,
    ``overall_preference``)."""
    keys = ["context", "response1", "response2", "overall_preference"]

    def convert(row: dict[str, Any]) -> PreferencePair:
        prompt = as_prompt(require(row, "context", keys, (str, list)), "context")
        r1 = as_response(require(row, "response1", keys, str), "response1")
        r2 = as_response(require(row, "response2", keys, str), "response2")
        preference = require(row, "overall_preference", keys, int)
        if isinstance(preference, bool):
            raise RowError("field 'overall_preference' must be int, got bool")
        if preference == 0:
            raise RowError("field 'overall_preference' is 0, a tie (no preferred response)")
        chosen, rejected = (r1, r2) if preference < 0 else (r2, r1)
        return _checked_pair(prompt, chosen, rejected, row)

    return load_rows(path, on_bad_row, convert)


def load_messages_preference_jsonl(
    path: str | Path,
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    on_bad_row: OnBadRow = "error",
) -> LoadedData:
    """Two full conversations per line; their shared prefix is the prompt."""
    keys = [chosen_key, rejected_key]

    def convert(row: dict[str, Any]) -> PreferencePair:
        chosen = check_message_log(require(row, chosen_key, keys, list), chosen_key)
        rejected = check_message_log(require(row, rejected_key, keys, list), rejected_key)
        if chosen == rejected:
            raise RowError(f"{chosen_key!r} is identical to {rejected_key!r} (no preference)")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise RowError(f"{chosen_key!r} and {rejected_key!r} share no prompt messages")
        prompt = chosen[:n]
        return _checked_pair(
            prompt,
            as_response(chosen[n:], chosen_key),
            as_response(rejected[n:], rejected_key),
            row,
        )

    return load_rows(path, on_bad_row, convert)


# ---------------------------------------------------------------- synthetic pairs


def corrupt_number(value: str, salt: str) -> str:
    """A different number near ``value`` (offset 1..9), chosen by sha256(salt).

    Non-negative inputs stay non-negative. Raises ValueError on a non-number.
    """
    try:
        number = Decimal(value.replace(",", ""))
    except InvalidOperation as err:
        raise ValueError(f"cannot corrupt {value!r}: not a number") from err
    digest = int(stable_hash(salt)[:16], 16)
    delta = 1 + digest % 9
    if (digest >> 8) % 2 and (number < 0 or number - delta >= 0):
        delta = -delta
    return str(number + delta)


_STEP = re.compile(r"<<([^<>=]*)=([^<>]*)>>(-?[\d,]*\.?\d+)?")


def corrupt_gsm8k_answer(worked_answer: str, salt: str) -> str:
    """The worked answer with its final ``#### N`` changed (and, for about half the
    salts, one numeric calculator step's result and its visible copy changed too)."""
    body, final = worked_answer.rsplit("####", 1)
    final = final.strip()
    numeric_steps = [m for m in _STEP.finditer(body) if _is_number(m.group(2))]
    digest = int(stable_hash("step:" + salt)[:16], 16)
    if numeric_steps and digest % 2:
        step = numeric_steps[(digest >> 1) % len(numeric_steps)]
        wrong = corrupt_number(step.group(2), "value:" + salt)
        visible = wrong if step.group(3) is not None else ""
        body = f"{body[: step.start()]}<<{step.group(1)}={wrong}>>{visible}{body[step.end() :]}"
    return f"{body}#### {corrupt_number(final, 'final:' + salt)}"


def _is_number(text: str) -> bool:
    try:
        Decimal(text.replace(",", ""))
    except InvalidOperation:
        return False
    return True


def arithmetic_preference_pairs(n: int, seed: int = 0, split: str = "train") -> LoadedData:
    """SYNTHETIC: tiny-arith problems; chosen = " <correct>", rejected = " <corrupted>"."""
    from tempering.data.arithmetic import arithmetic_problems

    pairs = []
    for i, problem in enumerate(arithmetic_problems(n, seed, split)):  # type: ignore[arg-type]
        wrong = corrupt_number(problem["answer"], f"arith:{split}:{seed}:{i}")
        pairs.append(
            PreferencePair(
                [{"role": "user", "content": problem["prompt"]}],
                [{"role": "assistant", "content": " " + problem["answer"]}],
                [{"role": "assistant", "content": " " + wrong}],
            )
        )
    return LoadedData(f"arithmetic_preference_{split}_seed{seed}", pairs)


def arithmetic_parity_pairs(n: int, seed: int = 0, split: str = "train") -> LoadedData:
    """SYNTHETIC, a preference the reference model does not already hold: for a tiny-arith
    problem, chosen = " <an even number>", rejected = " <an odd number>", both two-digit and
    neither the answer, so arithmetic gives no hint (tiny-arith ranks such pairs near chance)
    and only the rewarded property, parity, separates them."""
    import random

    from tempering.data.arithmetic import arithmetic_problems

    rng = random.Random(f"parity:{split}:{seed}")
    pairs = []
    for problem in arithmetic_problems(n, seed, split):  # type: ignore[arg-type]
        answer = int(problem["answer"])
        even = odd = answer
        while even == answer:
            even = 2 * rng.randint(5, 49)
        while odd == answer:
            odd = 2 * rng.randint(5, 49) + 1
        pairs.append(
            PreferencePair(
                [{"role": "user", "content": problem["prompt"]}],
                [{"role": "assistant", "content": f" {even}"}],
                [{"role": "assistant", "content": f" {odd}"}],
            )
        )
    return LoadedData(f"arithmetic_parity_{split}_seed{seed}", pairs)


def gsm8k_preference_pairs(split: str = "train") -> LoadedData:
    """SYNTHETIC: GSM8K worked answer (chosen) vs. the same answer corrupted (rejected)."""
    from tempering.data.gsm8k import gsm8k_user_prompt, load_gsm8k

    pairs = [
        PreferencePair(
            [{"role": "user", "content": gsm8k_user_prompt(p.question)}],
            [{"role": "assistant", "content": p.worked_answer}],
            [{"role": "assistant", "content": corrupt_gsm8k_answer(p.worked_answer, p.question)}],
        )
        for p in load_gsm8k(split)  # type: ignore[arg-type]
    ]
    return LoadedData(f"gsm8k_preference_{split}", pairs)


def _load_preference(path: str, prompt_key: str, on_bad_row: OnBadRow) -> LoadedData:
    return load_preference_jsonl(path, prompt_key, on_bad_row=on_bad_row)


def _load_helpsteer3(path: str, prompt_key: str, on_bad_row: OnBadRow) -> LoadedData:
    return load_helpsteer3_jsonl(path, on_bad_row)  # its prompt column is always 'context'


def _load_messages_preference(path: str, prompt_key: str, on_bad_row: OnBadRow) -> LoadedData:
    return load_messages_preference_jsonl(path, on_bad_row=on_bad_row)  # no prompt column


# data.dataset_name -> loader(path, prompt_key, on_bad_row) for local preference files; only
# "preference" has a prompt column of a configurable name (the config refuses data.prompt_key
# for the others).
PREFERENCE_LOADERS = {
    "preference": _load_preference,
    "helpsteer3": _load_helpsteer3,
    "messages_preference": _load_messages_preference,
}


def load_preference_splits(
    name: str,
    train_data_path: str | None = None,
    val_data_path: str | None = None,
    on_bad_row: OnBadRow = "error",
    num_train: int = 20000,
    num_val: int = 256,
    seed: int = 0,
    prompt_key: str = "prompt",
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """``(train, val)`` preference pairs for ``data.dataset_name``.

    "arithmetic": ``num_train`` synthetic pairs from tiny-arith's train split, ``num_val`` from
    its test split. "gsm8k": synthetic pairs of the 1,000 train / 319 held-out problems (val
    capped at ``num_val``). File formats: ``val_data_path`` or, without one, ``num_val`` pairs
    held out of the training file (at most half of it; a cap is logged).
    """
    if name == "arithmetic":
        return (
            arithmetic_preference_pairs(num_train, seed).examples,
            arithmetic_preference_pairs(num_val, seed, split="test").examples,
        )
    if name == "gsm8k":
        val = gsm8k_preference_pairs("heldout").examples[:num_val]
        return gsm8k_preference_pairs("train").examples, val
    if name not in PREFERENCE_LOADERS:
        raise ValueError(
            f"data.dataset_name={name!r} is not a preference dataset; use one of "
            f"{sorted(PREFERENCE_LOADERS) + ['arithmetic', 'gsm8k']}"
        )
    if not train_data_path:
        raise ValueError(
            f"data.dataset_name={name!r} needs data.train_data_path=<data file: JSONL, JSON, "
            "Parquet or CSV>"
        )
    load = PREFERENCE_LOADERS[name]
    train = load(train_data_path, prompt_key, on_bad_row).examples
    if val_data_path:
        return train, load(val_data_path, prompt_key, on_bad_row).examples
    return hold_out(train, num_val, seed, f"data.train_data_path={train_data_path!r}", "pairs")
