"""Chat messages as the loaders check them: OpenAI's format, tool calls included.

A message is ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``:

- an **assistant** message may carry ``tool_calls``, OpenAI's list of
  ``{"id"?, "type": "function", "function": {"name": str, "arguments": ...}}``; its
  ``content`` may then be null, empty or absent. The arguments are a JSON object, given as one
  or as its JSON text (the OpenAI API sends text); they are kept as the object.
- an **assistant** message may carry ``reasoning_content`` (str: its thinking, as vLLM and
  reasoning datasets give it). A template that renders ``reasoning_content`` gets it; any other
  gets it inside ``<think>...</think>`` before the content (Qwen3's and DeepSeek-R1's form), so
  the thinking is trained on either way, never dropped.
- a **tool** message is a tool's result: ``content`` (str), and optionally ``tool_call_id``
  (one of the calls before it) and ``name``. It follows the assistant message whose calls it
  answers, or another tool message (:func:`check_tool_turns`).

A row's ``tools`` (OpenAI function specs ``{"type": "function", "function": {"name", ...}}``
or the bare ``{"name", "description", "parameters"}``; a list, or its JSON text as many hub
datasets store it) makes the example a :class:`Conversation`, rendered with the specs
(`data/processing.py`: the template's own tool prompt, else our default one).

Any other key in a message is a bad row, named (a per-turn loss ``weight`` read as absent would
train on turns the data excludes). Parquet and saved datasets unify nested fields across
rows, so a field a message lacks reads back as null: null is read as absent throughout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tempering.data.records import Message, MessageLog, RowError

ROLES = ("system", "user", "assistant", "tool")
KEYS = ("role", "content", "tool_calls", "reasoning_content", "tool_call_id", "name")


@dataclass(frozen=True)
class Conversation:
    """A message log with the tools its assistant may call (a row with ``tools``), trained on
    its assistant messages from ``loss_from`` on (a prompt/completion row: the completion)."""

    messages: MessageLog
    tools: list[dict[str, Any]]
    loss_from: int = 0


@dataclass(frozen=True)
class Text:
    """A language-modelling example (TRL's ``text`` rows, continued pretraining): no roles,
    no template; every token after the first is trained on, and the tokenizer's end-of-text
    token closes it (`data/processing.py`)."""

    text: str


def _json_object(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as err:
            raise RowError(f"{where} is not valid JSON ({err}): {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise RowError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _check_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RowError(
            f"{where} must be an object with a 'function' object "
            '(OpenAI format: {"type": "function", "function": {"name", "arguments"}})'
        )
    if call.get("type") not in (None, "function"):
        raise RowError(f"{where}.type is {call['type']!r}; only 'function' calls are supported")
    name = call["function"].get("name")
    if not isinstance(name, str) or not name:
        raise RowError(f"{where}.function.name must be a non-empty string, got {name!r}")
    args = _json_object(call["function"].get("arguments"), f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _check_message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise RowError(f"{where} must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise RowError(f"{where}.role is {role!r}; expected one of {ROLES}")
    unread = sorted(k for k, v in message.items() if v is not None and (
        k not in KEYS or (k in ("tool_call_id", "name") and role != "tool")))  # fmt: skip
    if unread:  # e.g. a per-turn loss weight: training as if it were absent would be wrong
        raise RowError(
            f"{where} ({role}) has {', '.join(map(repr, unread))}, which is not read (a message "
            f"reads {', '.join(KEYS[:4])}; a tool message also tool_call_id and name): remove "
            "it from the data"
        )
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise RowError(f"{where} is a {role} message with tool_calls; only assistants call tools")
    if calls is not None and (not isinstance(calls, list) or not calls):
        raise RowError(f"{where}.tool_calls must be a non-empty list (or absent)")
    if content is None and calls:
        content = ""  # a message that only calls tools
    if not isinstance(content, str):
        raise RowError(f"{where}.content must be str, got {type(content).__name__}")
    out: Message = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [
            _check_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
        ]
    reasoning = message.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise RowError(f"{where}.reasoning_content must be a str on an assistant message")
    if reasoning:
        out["reasoning_content"] = reasoning
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                out[key] = str(message[key])
    return out


def check_message_log(value: Any, field_name: str) -> MessageLog:
    """Validated plain copies of a list of messages (module docstring); a bad one raises
    :class:`RowError` naming ``field[i]`` and the fix."""
    if not isinstance(value, list) or not value:
        raise RowError(f"field {field_name!r} must be a non-empty list of messages")
    return [_check_message(m, f"field {field_name!r}[{i}]") for i, m in enumerate(value)]


def as_prompt(value: Any, key: str) -> MessageLog:
    """A prompt given as text (one user message) or as messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return check_message_log(value, key)


def as_response(value: Any, key: str) -> MessageLog:
    """A response given as text (one assistant message) or as messages ending with the
    assistant's; an empty one is a bad row."""
    if isinstance(value, str):
        response = [{"role": "assistant", "content": value}]
    else:
        response = check_message_log(value, key)
    if response[-1]["role"] != "assistant":
        raise RowError(f"field {key!r} must end with an assistant message")
    if not any(
        m["content"].strip() or m.get("tool_calls") for m in response if m["role"] == "assistant"
    ):
        raise RowError(f"field {key!r} is empty")
    return response


def check_tool_turns(log: MessageLog, field_name: str) -> None:
    """Each tool message follows an assistant message with tool calls (or another tool
    message), and a ``tool_call_id`` names one of those calls."""
    calls: list[dict[str, Any]] | None = None
    for i, message in enumerate(log):
        if message["role"] == "assistant":
            calls = message.get("tool_calls")
        elif message["role"] != "tool":
            calls = None
        elif calls is None:
            raise RowError(
                f"field {field_name!r}[{i}] is a tool message, but no assistant tool call comes "
                "right before it: a tool result answers the assistant message that called it"
            )
        elif (call_id := message.get("tool_call_id")) and (
            ids := [c["id"] for c in calls if "id" in c]
        ):
            if call_id not in ids:
                raise RowError(
                    f"field {field_name!r}[{i}].tool_call_id is {call_id!r}; the calls before it "
                    f"have ids {ids}"
                )


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's ``tools`` column, checked ([] when it has none)."""
    return check_tools(row["tools"], "tools") if row.get("tools") is not None else []


def check_tools(value: Any, field_name: str) -> list[dict[str, Any]]:
    """OpenAI function specs (a list, or its JSON text), each as
    ``{"type": "function", "function": {"name", ...}}``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise RowError(f"field {field_name!r} is a string but not JSON ({err})") from None
    if not isinstance(value, list):
        raise RowError(
            f"field {field_name!r} must be a list of tool specs, got {type(value).__name__}"
        )
    tools = []
    for i, tool in enumerate(value):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise RowError(
                f"field {field_name!r}[{i}] must be a function spec with a name "
                '({"type": "function", "function": {"name", "description", "parameters"}})'
            )
        if isinstance(spec.get("parameters"), str):  # hub datasets store schemas as JSON text
            spec = {
                **spec,
                "parameters": _json_object(
                    spec["parameters"], f"field {field_name!r}[{i}].parameters"
                ),
            }
        tools.append({"type": "function", "function": spec})
    return tools
