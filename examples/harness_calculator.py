"""An agent harness that is not tempering code: the plain `openai` client in a loop with a tool.

tempering trains on it with ``grpo.rollout_transport=external`` (docs/agentic.md, "External
harnesses"; examples/configs/grpo_external_harness_tiny.yaml). It imports nothing from
tempering: any program that speaks this protocol can take its place.

- Input: one task per stdin line (JSON): ``rollout_id``, ``base_url`` (an OpenAI base URL that
  names the episode), ``model``, ``messages``, ``answer`` and ``sampling`` (temperature, top_p,
  max_tokens).
- Output: one result per stdout line: ``{"rollout_id": ..., "reward": ...}`` (or ``"error"``).
- Each episode: ask the model; when it calls the ``calculator`` tool (OpenAI tool calls,
  with ``--tools``), evaluate the expression and send the result back as a ``tool`` message;
  when it answers, compare its leading integer with the task's answer. A wrong answer is
  asked again, up to ``--attempts`` times; the reward is ``discount ** (attempt - 1)`` for a
  right answer, else 0. Episodes run concurrently (``--concurrency`` threads), so the
  server can batch their calls.

    echo '{"rollout_id": "r1", "base_url": "http://127.0.0.1:8000/v1", "model": "policy",
           "messages": [{"role": "user", "content": "Q: 23+45=? A:"}], "answer": "68",
           "sampling": {"temperature": 1.0, "max_tokens": 6}}' | python examples/harness_calculator.py
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+, -, *, / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculate(expression: str) -> str:
    """The expression's value, by walking its syntax tree (never run as code), or an error."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ( )")

    try:
        if len(expression) > 200:
            raise ValueError("expression too long")
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"
    return str(int(result)) if float(result).is_integer() else str(result)


def leading_integer(text: str | None) -> int | None:
    match = re.match(r"\s*([+-]?\d{1,30})", text or "")
    return int(match.group(1)) if match else None


def episode(client: OpenAI, task: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    model = client.with_options(base_url=task["base_url"])  # the URL names this episode
    messages = list(task["messages"])
    question = messages[-1]["content"]
    sampling = task.get("sampling", {})
    attempt, calls = 1, 0
    for _ in range(args.max_calls):
        response = model.chat.completions.create(
            model=task["model"],
            messages=messages,
            temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0),
            max_tokens=sampling.get("max_tokens", 16),
            **({"tools": [CALCULATOR]} if args.tools else {}),
        )
        calls += 1
        msg = response.choices[0].message
        turn: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls
            ]  # fmt: skip
        messages.append(turn)
        if msg.tool_calls:  # run the tool, give the model its result
            for c in msg.tool_calls:
                try:
                    expression = str(json.loads(c.function.arguments)["expression"])
                    result = calculate(expression)
                except (ValueError, KeyError, TypeError):
                    result = 'error: arguments must be {"expression": "..."}'
                messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
            continue
        if leading_integer(msg.content) == int(task["answer"]):
            return {"reward": args.discount ** (attempt - 1), "attempts": attempt, "calls": calls}
        if attempt >= args.attempts:
            break
        attempt += 1
        messages.append({"role": "user", "content": question})  # asked again: the feedback
    return {"reward": 0.0, "attempts": attempt, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=1, help="answers per episode at most")
    parser.add_argument("--discount", type=float, default=0.5, help="reward factor per retry")
    parser.add_argument("--tools", action="store_true", help="offer the calculator tool")
    parser.add_argument("--max-calls", type=int, default=8, help="model calls per episode")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes at once")
    args = parser.parse_args()
    tasks = [json.loads(line) for line in sys.stdin if line.strip()]
    client = OpenAI(base_url="http://unused/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"),
                    max_retries=2, timeout=120)  # fmt: skip

    def run(task: dict[str, Any]) -> dict[str, Any]:
        try:
            out = episode(client, task, args)
        except Exception as err:  # reported, so the trainer masks and counts this episode
            out = {"error": f"{type(err).__name__}: {err}"[:500]}
        return {"rollout_id": task["rollout_id"], **out}

    with ThreadPoolExecutor(max(1, min(args.concurrency, len(tasks)))) as pool:
        for result in pool.map(run, tasks):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
