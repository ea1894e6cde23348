"""NeMo Gym JSONL rows as GRPO data.

A row is what a Gym agent's (or, in Gym 0.7, environment server's) ``POST /run`` takes:

    {"responses_create_params": {"input": [{"role": "user", "content": "..."}] | "text",
                                 "tools": [...], "temperature": ..., "max_output_tokens": ...},
     "agent_ref": {"name": "<agent instance>"}            # or "_ng_environment_server": "<name>"
                                                          # or "task_source": "<resources server>"
     "expected_answer": "...", ...}                       # whatever the environment needs

Rows are checked when loaded; a malformed row fails with ``file:line`` and the field
(`tempering.data.records.RowIssues`), so nothing reaches Gym that it would reject later.
`problem_row` turns a plain prompt/answer problem into a row, so native datasets
(tiny-arith, GSM8K) can be scored through Gym too (``env.task_name=nemo_gym``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tempering.data.records import DataFormatError, OnBadRow, RowError, RowIssues, iter_rows

ROUTING_FIELDS = ("_ng_environment_server", "agent_ref", "task_source")

__all__ = [
    "ROUTING_FIELDS",
    "arithmetic_rows",
    "check_row",
    "load_gym_rows",
    "problem_row",
    "row_prompt_text",
]


def check_row(row: dict[str, Any], default_route: str | None = None) -> dict[str, Any]:
    """The row if it has the shape /run takes; RowError naming the field otherwise."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise RowError("missing field 'responses_create_params' (an object with 'input')")
    value = params.get("input")
    if isinstance(value, list):
        if not value:
            raise RowError("field 'responses_create_params.input' is an empty list")
        for i, item in enumerate(value):
            if not isinstance(item, dict) or ("role" not in item and "type" not in item):
                raise RowError(
                    f"field 'responses_create_params.input[{i}]' must be a message object "
                    "with a role"
                )
    elif not isinstance(value, str) or not value:
        raise RowError("field 'responses_create_params.input' must be a string or a message list")
    tools = params.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or any(not isinstance(t, dict) for t in tools)
    ):
        raise RowError("field 'responses_create_params.tools' must be a list of objects")
    ref = row.get("agent_ref")
    if ref is not None and not (isinstance(ref, dict) and isinstance(ref.get("name"), str)):
        raise RowError("field 'agent_ref' must be an object with a 'name'")
    if not any(row.get(k) for k in ROUTING_FIELDS) and not default_route:
        raise RowError(
            "no routing field: give the row one of "
            f"{', '.join(ROUTING_FIELDS)} or set env.nemo_gym.default_route"
        )
    return row


def load_gym_rows(
    path: str | Path, default_route: str | None = None, on_bad_row: OnBadRow = "error"
) -> list[dict[str, Any]]:
    """Every row of a NeMo Gym JSONL file, checked (see `check_row`)."""
    issues = RowIssues(str(path), on_bad_row)
    rows = []
    for where, obj in iter_rows(path, issues):
        row = issues.convert(where, obj, lambda r: check_row(r, default_route))
        if row is not None:
            rows.append(row)
    if not rows:
        raise DataFormatError(f"{path}: no usable NeMo Gym rows")
    return issues.finish(Path(path).name, rows).examples


def problem_row(prompt: str, answer: str) -> dict[str, Any]:
    """A Gym row for a plain problem: one user message; the answer as ``expected_answer``
    (routed by env.nemo_gym.default_route)."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": prompt}]},
        "expected_answer": answer,
    }


def arithmetic_rows(n: int, split: str, routes: list[str], seed: int = 0) -> list[dict[str, Any]]:
    """`n` tiny-arith problems of `split` (``train`` | ``test``: never the same problems) as
    Gym rows, row i routed to ``routes[i % len(routes)]``: an environment server's name (Gym
    0.7's ``..._environment_server``) as ``_ng_environment_server``, any other as the
    ``agent_ref`` agent. Alternating routes split one environment over shards claiming
    different entries of it (examples/configs/grpo_nemo_gym_shards_tiny.yaml)."""
    from tempering.models.tiny_arith import make_problems

    if not routes:
        raise ValueError(
            "arithmetic rows need at least one route (a Gym agent or environment server)"
        )
    rows = []
    for i, p in enumerate(make_problems(n, seed=seed, split=split)):  # type: ignore[arg-type]
        route = routes[i % len(routes)]
        field = ({"_ng_environment_server": route} if route.endswith("_environment_server")
                 else {"agent_ref": {"name": route}})  # fmt: skip
        rows.append({**problem_row(p["prompt"], p["answer"]), **field})
    return rows


def row_prompt_text(row: dict[str, Any]) -> str:
    """The last user message of a row (for logs)."""
    value = row["responses_create_params"]["input"]
    if isinstance(value, str):
        return value
    users = [m for m in value if m.get("role") == "user"]
    content = (users or value)[-1].get("content", "")
    return content if isinstance(content, str) else str(content)
