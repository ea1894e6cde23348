"""A math task with a calculator tool: a multi-turn, tool-using environment.

The model may call ``calculator({"expression": "12*(3+4)"})`` (OpenAI tool call, parsed by the
generation server); the environment evaluates the expression and answers with a ``tool``
message, and the episode goes on. A turn without tool calls is the final answer, scored by
math-verify against ``metadata["ground_truth"]`` (`MathEnvironment`), which ends the episode.
More than ``max_tool_calls`` calls end it with reward 0.

The expression is never run as Python: `evaluate_expression` walks its syntax tree and allows
only numbers, + - * / // % ** (small exponents) and parentheses, with a length limit, so text
from the model cannot execute code or exhaust memory.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from tempering.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog

__all__ = ["CALCULATOR_TOOL", "CalculatorEnvironment", "evaluate_expression"]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. 12*(3+4)/2. Returns the value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CHARS, _MAX_EXPONENT, _MAX_MAGNITUDE = 200, 64, 1e30


def evaluate_expression(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError for anything else."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from err

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if not abs(node.value) <= _MAX_MAGNITUDE:  # 1e309 is inf
                raise ValueError("number out of range")
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError as err:
                raise ValueError("division by zero") from err
            except OverflowError as err:  # float ** float beyond the float range
                raise ValueError("result out of range") from err
            if isinstance(value, complex) or not abs(value) <= _MAX_MAGNITUDE:  # nan too
                raise ValueError("result out of range")
            return value
        raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / ** only)")

    return walk(tree)


_MAX_ARGUMENT_CHARS = 10_000  # a tool call's arguments JSON; longer is refused unparsed


def _run_call(call: Any) -> str:
    """The tool's answer to one model-written call (any shape): its value, or ``error: ...``
    that the model reads -- never an exception (deep JSON, huge numbers, odd types)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return 'error: a tool call must be {"function": {"name": ..., "arguments": ...}}'
    if fn.get("name") != "calculator":
        return f"error: unknown tool {str(fn.get('name'))[:80]!r}; the only tool is calculator"
    arguments = fn.get("arguments") or "{}"
    if isinstance(arguments, str) and len(arguments) > _MAX_ARGUMENT_CHARS:
        return f"error: arguments longer than {_MAX_ARGUMENT_CHARS} characters"
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        expression = args.get("expression") if isinstance(args, dict) else None
        if type(expression) not in (str, int, float):
            raise TypeError('arguments must be {"expression": "<arithmetic>"}')
        value = evaluate_expression(str(expression))
    except (ValueError, TypeError, RecursionError) as err:  # RecursionError: deep JSON
        return f"error: {type(err).__name__ if isinstance(err, RecursionError) else err}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


class CalculatorEnvironment(EnvironmentInterface):
    """Calculator tool calls answered in-episode; the final answer scored by math-verify."""

    tools = [CALCULATOR_TOOL]

    def __init__(
        self,
        max_tool_calls: int = 4,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        memory_limit_mb: int = 1024,
        cpu_limit_s: int = 300,
        max_error_rate: float = 0.05,
    ):
        from tempering.environments.math import MathEnvironment

        self.max_tool_calls = max_tool_calls
        self.math = MathEnvironment(
            num_workers=num_workers,
            timeout_s=timeout_s,
            memory_limit_mb=memory_limit_mb,
            cpu_limit_s=cpu_limit_s,
            max_error_rate=max_error_rate,
        )
        self._counts = {"tool_calls": 0, "tool_errors": 0, "over_budget": 0}

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        import torch

        n = len(message_logs)
        observations: list[dict[str, Any]] = [{"role": "tool", "content": ""}] * n
        metas: list[dict[str, Any] | None] = [dict(m) for m in metadata]
        rewards = torch.zeros(n)
        done = torch.zeros(n, dtype=torch.bool)
        answers: list[str | None] = [None] * n
        final = []
        for i, log in enumerate(message_logs):
            last = log[-1] if log else {}
            calls = (last.get("tool_calls") or []) if last.get("role") == "assistant" else []
            if not isinstance(calls, list):  # a malformed call still costs one from the budget
                calls = [calls]
            if not calls:
                final.append(i)
                continue
            used = int(metadata[i].get("tool_calls", 0)) + len(calls)
            metas[i] = {**metadata[i], "tool_calls": used}
            self._counts["tool_calls"] += len(calls)
            if used > self.max_tool_calls:
                self._counts["over_budget"] += 1
                done[i] = True
                continue
            results = [_run_call(c) for c in calls]
            self._counts["tool_errors"] += sum(r.startswith("error:") for r in results)
            observations[i] = {
                "role": "tool",
                "content": "\n".join(results),
                "tool_call_id": calls[0].get("id") if isinstance(calls[0], dict) else None,
            }
        if final:
            scored = self.math.step([message_logs[i] for i in final], [metadata[i] for i in final])
            for j, i in enumerate(final):
                rewards[i] = scored.rewards[j]
                done[i] = True
                answers[i] = scored.answers[j]
        return EnvironmentReturn(observations, metas, [None] * n, rewards, done, answers)

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        batch, metrics = self.math.global_post_process_and_metrics(batch)
        metrics.update({f"env/calculator_{k}": float(v) for k, v in self._counts.items()})
        self._counts = dict.fromkeys(self._counts, 0)
        return batch, metrics

    def shutdown(self) -> None:
        self.math.shutdown()
