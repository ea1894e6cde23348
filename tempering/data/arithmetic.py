"""Generated arithmetic (tiny-arith) as SFT data: a thin adapter over the problem generator.

``tempering.models.tiny_arith.make_problems(n, seed, split, ops)`` returns
``[{"prompt": "Q: 23+45=? A:", "answer": "68"}, ...]`` (split "train" or "test", disjoint by
construction). For SFT each problem becomes the message log
``[user: "Q: 23+45=? A:", assistant: " 68"]`` (note the leading space on the response). With
tiny-arith's tokenizer, :func:`tempering.data.processing.tokenize_message_log` turns it into
prompt tokens + answer tokens + EOS with the loss on the answer and EOS only — the same tokens
whether the chat template or the plain-concatenation path is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tempering.data.messages import Conversation
from tempering.data.records import LoadedData, MessageLog


def arithmetic_problems(
    n: int, seed: int = 0, split: Literal["train", "test"] = "train", ops: Sequence[str] = ("+",)
) -> list[dict[str, str]]:
    """``n`` problems ``{"prompt", "answer"}`` from tiny-arith's seeded generator."""
    from tempering.models.tiny_arith import make_problems

    return make_problems(n, seed, split, ops)


def arithmetic_message_log(prompt: str, answer: str) -> MessageLog:
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": " " + answer},
    ]


def arithmetic_sft_message_logs(
    n: int, seed: int = 0, split: Literal["train", "test"] = "train", ops: Sequence[str] = ("+",)
) -> LoadedData:
    """``n`` tiny-arith SFT examples: prompt ``"Q: a+b=? A:"``, response ``" <result>"``."""
    problems = arithmetic_problems(n, seed, split, ops)
    logs = [arithmetic_message_log(p["prompt"], p["answer"]) for p in problems]
    return LoadedData(f"arithmetic_{split}_seed{seed}", logs)


def calculator_conversation(prompt: str, answer: str, tool: dict[str, Any]) -> Conversation:
    """A demonstration of the calculator tool on one problem: the user asks ``"Q: 23+45=? A:"``,
    the assistant calls ``tool`` (the calculator's spec) with ``{"expression": "23+45"}``, the
    tool answers ``"68"``, and the assistant answers ``" 68"``."""
    if not (prompt.startswith("Q: ") and prompt.endswith("=? A:")):
        raise ValueError(f"not a tiny-arith prompt: {prompt!r}")
    call = {"type": "function", "function": {
        "name": tool["function"]["name"], "arguments": {"expression": prompt[3:-5]}}}  # fmt: skip
    return Conversation(
        [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": " " + answer},
        ],
        [tool],
    )
