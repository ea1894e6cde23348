"""Chat prompts as token ids: chat template, tools, tool-call parsing, and the on-policy splice.

Used by the chat service (`chat_service.py`, behind the OpenAI-compatible server) and by the
multi-turn rollout loop (`tempering/experience/rollouts.py`): both turn OpenAI-style messages
into the exact token ids the backend continues, so a conversation trains on the tokens the
model really produced.

## The re-tokenization problem and the splice

A model samples token ids. Decoding them to text and encoding the text again (what a plain
chat server does on the next turn, when the client sends the assistant's text back) need not
give the same ids: BPE merges differently across the old token boundaries, and a parsed tool
call re-rendered by the template is different text altogether. The trainer would then score
tokens the sampler never produced — silently off-policy.

So when a request carries earlier assistant messages with their ids (``prompt_token_ids`` +
``generation_token_ids``, as this server returns them and NeMo Gym re-attaches them), the
prompt is built by splicing, never by re-encoding history:

    prompt = prompt_ids(k) + generation_ids(k) [+ EOT if the generation did not end with it]
             + encode(template text from the end-of-turn token of assistant turn k on)

where k is the last assistant message with ids and EOT is the template's end-of-turn token
(found by rendering a probe conversation: ``<|im_end|>`` for ChatML templates such as
SmolLM2's, ``<|eot_id|>`` for Llama 3, the EOS for tiny-arith — it need not be the EOS).

Worked example (tiny-arith, whose template writes contents verbatim and EOS after assistant
turns; ids are illustrative). Turn 1: the user asks "Q: 23+45=? A:", prompt ids
``[30, 31, 8, 9, 35, 10, 11, 36, 33]``; the model samples " 6", "7" as ``[5, 12, 13, 2]``
(2 = EOS). Encoding the text " 67" again gives ``[5, 40]`` if the BPE has a merged "67"
token — different ids for the same text. Turn 2 adds the environment's reply " wrong Q:".
The template renders the whole conversation as
``"Q: 23+45=? A: 67<eos> wrong Q:"``; the text after the EOS that closes turn 1 is
``" wrong Q:"``, so the turn-2 prompt is ``[30, ..., 33] + [5, 12, 13, 2] + encode(" wrong Q:")``:
it starts with exactly turn 1's prompt and generation.

History that cannot be spliced — an earlier assistant message whose ids are not a prefix of a
later one's prompt, or a template that renders earlier turns differently once more turns
follow (e.g. one that strips earlier reasoning) — raises `NonContiguousHistoryError` (the
server answers 400), or with ``on_noncontiguous="truncate"`` the splice falls back to the
last assistant turn that is contiguous (or to plain rendering) and the event is counted.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tempering.models.hf import text_encoder

__all__ = [
    "TOOL_CALL_PARSERS",
    "ChatPromptBuilder",
    "NonContiguousHistoryError",
    "ParsedToolCalls",
    "PromptIds",
    "message_text",
    "parse_hermes_tool_calls",
    "parse_llama3_json_tool_calls",
    "parse_mistral_tool_calls",
    "register_tool_call_parser",
    "render_chat",
]

OnNonContiguous = Literal["error", "truncate"]
_PROBE = "tempering-probe-7d1c"


class NonContiguousHistoryError(ValueError):
    """Earlier assistant turns' token ids cannot be continued exactly (see module docstring)."""


# ------------------------------------------------------------------------- tool calls
@dataclass
class ParsedToolCalls:
    content: str | None  # text outside valid tool-call blocks (None when empty)
    tool_calls: list[dict[str, Any]]  # OpenAI format: {"id", "type": "function", "function"}
    errors: list[str] = field(default_factory=list)  # one per unparseable block (left in content)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> ParsedToolCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes/Qwen style).

    Valid blocks become OpenAI tool calls (arguments as a JSON string) and are removed from the
    content; an unparseable block (bad JSON, no name, no closing tag) stays in the content and
    is reported in ``errors``."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('expected {"name": str, "arguments": object}')
            args = obj.get("arguments", {})
            if isinstance(args, str):
                json.loads(args)  # a JSON string of an object is accepted as is
            else:
                args = json.dumps(args)
        except ValueError as err:
            errors.append(f"unparseable tool call {body[:80]!r}: {err}")
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args},
            }
        )
    kept.append(text[last:])
    rest = "".join(kept)
    if "<tool_call>" in rest and rest.count("<tool_call>") > rest.count("</tool_call>"):
        errors.append("a <tool_call> block has no closing </tool_call> (generation cut off?)")
    content = rest.strip() if calls else rest
    return ParsedToolCalls(content or None, calls, errors)


_PYTHON_TAG = "<|python_tag|>"
_JSON = json.JSONDecoder()


def parse_llama3_json_tool_calls(text: str) -> ParsedToolCalls:
    """Llama 3.1+ JSON tool calls: the whole reply is ``{"name": ..., "parameters": {...}}``
    (Meta's Llama 3.1 model card, "JSON based tool calling"), optionally after
    ``<|python_tag|>`` and several separated by ``;`` (as vLLM's ``llama3_json`` parser reads).

    A reply that does not start with ``{`` (or the tag) is plain content. One that does but is
    not a list of valid calls -- bad JSON, no name, trailing text -- yields no calls: the text
    stays the content and ``errors`` says why (all or nothing, so no half-read call runs)."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    elif not body.startswith("{"):
        return ParsedToolCalls(text or None, [])
    calls: list[dict[str, Any]] = []
    pos = 0
    try:
        while pos < len(body):
            obj, pos = _JSON.raw_decode(body, pos)
            args = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else 0
            if not isinstance(args, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('expected {"name": str, "parameters": object}')
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(args)},
                }
            )
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
    except ValueError as err:  # JSONDecodeError is a ValueError
        return ParsedToolCalls(text, [], [f"unparseable tool call {body[pos : pos + 80]!r}: {err}"])
    return ParsedToolCalls(None, calls)


_TOOL_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral_tool_calls(text: str) -> ParsedToolCalls:
    """Mistral tool calls after the ``[TOOL_CALLS]`` token (mistral-common): a JSON list of
    ``{"name", "arguments"}`` (tokenizer V3-V7, e.g. Mistral-Small-24B-Instruct-2501), or
    ``name[ARGS]{...}`` per call (V11+). Text before the token is the content. As with the
    Llama 3 parser it is all or nothing: a malformed call list yields no calls, the text stays
    the content, and ``errors`` says why."""
    if _TOOL_CALLS not in text:
        return ParsedToolCalls(text or None, [])
    head, _, body = text.partition(_TOOL_CALLS)
    calls: list[dict[str, Any]] = []
    try:
        for part in body.split(_TOOL_CALLS):
            part = part.strip()
            if _ARGS in part:  # V11+: name[ARGS]{json}
                name, _, raw = part.partition(_ARGS)
                pairs = [(name.strip(), json.loads(raw))]
            else:
                obj = json.loads(part)
                items = obj if isinstance(obj, list) else [obj]
                pairs = [(o.get("name"), o.get("arguments", {})) if isinstance(o, dict)
                         else (None, None) for o in items]  # fmt: skip
            for name, args in pairs:
                if not isinstance(name, str) or not name or not isinstance(args, dict):
                    raise ValueError('expected {"name": str, "arguments": object}')
                calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}})  # fmt: skip
    except ValueError as err:  # JSONDecodeError is a ValueError
        return ParsedToolCalls(text, [], [f"unparseable tool call {body.strip()[:80]!r}: {err}"])
    return ParsedToolCalls(head.strip() or None, calls)


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedToolCalls]] = {
    "hermes": parse_hermes_tool_calls,
    "llama3_json": parse_llama3_json_tool_calls,
    "mistral": parse_mistral_tool_calls,
}
# Parsers whose format the default tool prompt (`default_tool_prompt`) teaches; with another
# parser the chat template itself must render ``tools``.
_DEFAULT_PROMPT_PARSERS = ("hermes",)


def register_tool_call_parser(name: str, parser: Callable[[str], ParsedToolCalls]) -> None:
    """Add a tool-call format (one entry per format); `parser(text) -> ParsedToolCalls`."""
    if name in TOOL_CALL_PARSERS and TOOL_CALL_PARSERS[name] is not parser:
        raise ValueError(f"tool-call parser {name!r} is already registered")
    TOOL_CALL_PARSERS[name] = parser


# ---------------------------------------------------------------------------- prompts
@dataclass
class PromptIds:
    ids: list[int]
    spliced: bool  # built from an earlier turn's token ids
    truncated: bool  # on_noncontiguous="truncate" dropped part of the history's ids
    retokenized_assistant_turns: int  # assistant messages without ids, encoded from text


def message_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of ``{"type": "text"}`` parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise ValueError(
                    f"message content part {part!r} is not a text part; only text is supported"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message content must be a string or a list of text parts, got {content!r}")


def _has_ids(message: dict[str, Any]) -> bool:
    return message.get("role") == "assistant" and message.get("generation_token_ids") is not None


def _is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    return len(prefix) <= len(seq) and list(seq[: len(prefix)]) == list(prefix)


class ChatPromptBuilder:
    """Messages (+ tools) -> prompt token ids for one model's tokenizer and chat template.

    Args:
        tokenizer: an HF tokenizer with a chat template (or pass `chat_template`).
        chat_template: a Jinja template overriding the tokenizer's.
        tool_parser: a `TOOL_CALL_PARSERS` name, or "auto": the parser of the model family
            whose end-of-turn token the template uses (`models.families.tool_parser_for_eot`;
            ``<|eot_id|>`` -> llama3_json), else hermes. Also decides the default tool prompt's
            format for templates that do not render ``tools`` themselves.
        eot_token: the end-of-turn token (text); default: found from the template.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        tool_parser: str = "hermes",
        eot_token: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # None for a base model's tokenizer: prompts given as token ids are served (turns end
        # at its eos token); messages are refused by name (`render`)
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or None
        if tool_parser not in TOOL_CALL_PARSERS and tool_parser != "auto":
            raise ValueError(
                f"tool_parser={tool_parser!r} is unknown; use 'auto' or one of "
                f"{sorted(TOOL_CALL_PARSERS)}"
            )
        # The Rust tokenizer directly (decode; text_encoder where exact): transformers'
        # wrapper costs ~3x the work it forwards.
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        self._encode = text_encoder(tokenizer)
        self.eot_token = eot_token or self._find_eot_token()
        eot_id = tokenizer.convert_tokens_to_ids(self.eot_token)
        if eot_id is None or eot_id == tokenizer.unk_token_id:
            raise ValueError(f"end-of-turn token {self.eot_token!r} is not in the vocabulary")
        self.eot_token_id = int(eot_id)
        if tool_parser == "auto":
            from tempering.models.families import tool_parser_for_eot

            tool_parser = tool_parser_for_eot(self.eot_token) or "hermes"
        self.tool_parser = tool_parser
        self.parse_tool_calls = TOOL_CALL_PARSERS[tool_parser]

    # ---- rendering -----------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for `messages` (tool-call and tool messages adapted for
        templates that do not know them; a default tool prompt when `tools` are given and the
        template does not render them)."""
        if self.chat_template is None:
            raise ValueError(no_chat_template(self.tokenizer, "messages cannot be rendered"))
        return render_chat(
            self.tokenizer, self.chat_template, messages, tools, add_generation_prompt,
            chat_template_kwargs, self.tool_parser,
        )  # fmt: skip

    def encode_text(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        on_noncontiguous: OnNonContiguous = "error",
    ) -> PromptIds:
        """Prompt ids for `messages`, spliced onto the last assistant turn that carries ids."""
        if not messages:
            raise ValueError("messages must not be empty")
        anchors = [i for i, m in enumerate(messages) if _has_ids(m)]
        retok = sum(
            1 for i, m in enumerate(messages) if m.get("role") == "assistant" and i not in anchors
        )
        render_args = (tools, chat_template_kwargs)
        truncated = False
        for pos in range(len(anchors) - 1, -1, -1):
            try:
                ids = self._splice(messages, anchors[: pos + 1], add_generation_prompt, render_args)
            except NonContiguousHistoryError:
                if on_noncontiguous == "error":
                    raise
                truncated = True
                continue
            later = sum(1 for i in anchors if i > anchors[pos])
            return PromptIds(ids, True, truncated, retok + later)
        text = self.render(messages, tools, add_generation_prompt, chat_template_kwargs)
        return PromptIds(self.encode_text(text), False, truncated, retok + len(anchors))

    def _splice(
        self,
        messages: Sequence[dict[str, Any]],
        anchors: list[int],
        add_generation_prompt: bool,
        render_args: tuple[Any, Any],
    ) -> list[int]:
        k = anchors[-1]
        last = messages[k]
        base = list(last.get("prompt_token_ids") or []) + list(last["generation_token_ids"])
        if not last.get("prompt_token_ids"):
            raise NonContiguousHistoryError(
                f"messages[{k}] has generation_token_ids but no prompt_token_ids; send both "
                "(as this server returned them) or neither"
            )
        for j in anchors[:-1]:
            earlier = list(messages[j]["prompt_token_ids"] or []) + list(
                messages[j]["generation_token_ids"]
            )
            if not _is_prefix(earlier, last["prompt_token_ids"]):
                raise NonContiguousHistoryError(
                    f"messages[{j}]'s prompt + generation ids ({len(earlier)} tokens) are not a "
                    f"prefix of messages[{k}].prompt_token_ids: the history was rewritten between "
                    "turns, so its token ids cannot be continued exactly"
                )
        tools, kwargs = render_args
        head = self.render(messages[: k + 1], tools, False, kwargs)
        full = self.render(messages, tools, add_generation_prompt, kwargs)
        if not full.startswith(head):
            raise NonContiguousHistoryError(
                f"the chat template renders messages[:{k + 1}] differently once later messages "
                "follow (e.g. it strips earlier reasoning), so the next prompt cannot extend "
                f"messages[{k}]'s token ids"
            )
        cut = head.rfind(self.eot_token)
        if cut < 0:
            raise NonContiguousHistoryError(
                f"the template's rendering of assistant messages[{k}] has no end-of-turn token "
                f"{self.eot_token!r}; cannot find where the next turn starts"
            )
        if base[-1] != self.eot_token_id:  # cut off by length or a stop string: close the turn
            base.append(self.eot_token_id)
        return base + self.encode_text(full[cut + len(self.eot_token) :])

    # ---- internals -----------------------------------------------------------------------
    def _find_eot_token(self) -> str:
        if self.chat_template is None:  # a base model: a turn is everything up to its eos
            if not self.tokenizer.eos_token:
                raise ValueError(no_chat_template(self.tokenizer, "and no eos token either"))
            return self.tokenizer.eos_token
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        text = render_chat(self.tokenizer, self.chat_template, probe, add_generation_prompt=False)
        after = text[text.rfind(_PROBE) + len(_PROBE) :]
        special = set(self.tokenizer.all_special_tokens) | {
            t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()
        }
        for token in self.tokenizer.tokenize(after):
            if token in special:
                return token
            if token.strip("\u0120\u010a \n"):  # visible text before any special token
                break
        raise ValueError(
            "could not find the chat template's end-of-turn token (no special token follows an "
            f"assistant message: {after[:40]!r}); set the server's eot_token explicitly"
        )


def render_chat(
    tokenizer: Any,
    chat_template: str,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tool_parser: str = "hermes",
) -> str:
    """The template's text for `messages`: tool-call and tool messages adapted for templates
    that do not know them (Hermes ``<tool_call>`` / ``<tool_response>`` blocks), an assistant's
    ``reasoning_content`` in ``<think>`` tags where the template does not render it, a default
    tool prompt when `tools` are given and the template does not render them. The server, the
    multi-turn rollouts and SFT's tokenizer (`data/processing.py`) all render through it, so a
    model is trained on the format it is later prompted with."""
    renders = ("tool_calls" in chat_template, "reasoning_content" in chat_template)
    msgs = [_template_message(m, *renders) for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    if tools and "tools" in chat_template:
        kwargs["tools"] = list(tools)
    elif tools and tool_parser not in _DEFAULT_PROMPT_PARSERS:
        raise ValueError(
            f"tools were given, but the chat template does not render `tools` and the default "
            f"tool prompt teaches {_DEFAULT_PROMPT_PARSERS} calls, not tool_parser="
            f"{tool_parser!r}. Fix: a chat template that renders `tools`, or tool_parser="
            "'hermes'"
        )
    elif tools:
        msgs = _with_tool_prompt(msgs, tools)
    try:
        return tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **kwargs,
        )
    except Exception as err:  # jinja raises its own exception types
        raise ValueError(f"the chat template could not render these messages: {err}") from err


def _template_message(
    message: dict[str, Any], renders_tool_calls: bool, renders_reasoning: bool = False
) -> dict[str, Any]:
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool", "environment"):
        raise ValueError(f"message role {role!r} is not one of system/user/assistant/tool")
    out: dict[str, Any] = {
        "role": {"environment": "user", "developer": "system"}.get(role, role),
        "content": message_text(message.get("content")),
    }
    reasoning = message.get("reasoning_content") if role == "assistant" else None
    if reasoning and renders_reasoning:
        out["reasoning_content"] = reasoning
    elif reasoning:  # Qwen3's and DeepSeek-R1's form, for templates that do not know it
        out["content"] = f"<think>\n{reasoning}\n</think>\n\n{out['content']}"
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        if renders_tool_calls:
            out["tool_calls"] = [_template_tool_call(c) for c in calls]
        else:
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _template_tool_call(c)["function"]["arguments"],
                    }
                )
                + "\n</tool_call>"
                for c in calls
            ]
            out["content"] = "\n".join(filter(None, [out["content"], *blocks]))
    if role == "tool":
        if message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        if not renders_tool_calls:
            out["content"] = f"<tool_response>\n{out['content']}\n</tool_response>"
    return out


def no_chat_template(tokenizer: Any, consequence: str) -> str:
    """The message for a tokenizer without a chat template (a base model's)."""
    name = getattr(tokenizer, "name_or_path", tokenizer)
    return (
        f"tokenizer {name!r} has no chat template (a base model?): {consequence}. Fix: set "
        "policy.tokenizer.chat_template to a Jinja template, or use the model's instruct version"
    )


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call with its arguments as an object (how HF chat templates expect them)."""
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as err:
            raise ValueError(f"tool call arguments are not JSON: {args[:80]!r} ({err})") from err
    return {"type": "function", "id": call.get("id"), "function": {**fn, "arguments": args}}


def default_tool_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """Tool instructions for templates that do not render ``tools`` (Hermes-style calls)."""
    specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return (
        "You can call these tools. Each is described by a JSON schema:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call a tool, write one block per call and nothing else in it:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
        "Tool results come back inside <tool_response></tool_response>."
    )


def _with_tool_prompt(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    prompt = default_tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
