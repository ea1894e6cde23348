"""Message log -> token ids + loss mask, with the tokenizer's chat template.

:func:`tokenize_message_log` renders a message log turn by turn so that each token is
attributed to the message that added it:

- **With a chat template** (``tokenizer.chat_template`` set): the text is cut at each
  assistant message *i*. Everything up to its generation prompt (``render(messages[:i],
  add_generation_prompt=True)``, ending e.g. in ``<|im_start|>assistant\\n``) is prompt, and
  the rest of ``render(messages[:i+1])`` — the content, its tool calls, and whatever the
  template appends after it (the end-of-turn token and its newline, e.g.
  ``<|im_end|>\\n``) — is loss. The model thus learns to end its turn. Messages are rendered
  by `models/generation/chat.render_chat`, as the server and the multi-turn rollouts render
  them: tool calls and tool results in the template's format, or in Hermes blocks where the
  template does not know them, and a conversation's ``tools`` in the template's tool prompt
  (else our default one). Each piece is tokenized with ``add_special_tokens=False`` and the
  concatenation is checked to equal the tokenization of the whole rendered text; tokens that
  merge across a boundary raise :class:`ChatTemplateError`. Cuts are made at the trained
  turns only (from ``loss_from_message`` on): the context before them is one piece. A template
  that renders earlier turns differently once later ones follow (Qwen3's drops the reasoning
  of turns before the last user message) raises :class:`HistoryRewrittenError`;
  :func:`tokenize_message_logs` then trains each assistant turn as its own example, after its
  history as the template renders it when that turn is generated.
- **Without a chat template** (plain concatenation fallback): each message's content is
  tokenized on its own (``add_special_tokens=False``) and concatenated; after each
  assistant message the tokenizer's EOS token (if it has one) is appended as a loss token.
  Roles are not rendered. This is what tiny-arith uses (``"Q: 23+45=? A:"`` + ``" 68"``).
  Tool calls cannot be rendered without a template: refused by name.
- **Plain text** (a `~tempering.data.messages.Text`, SFT's ``text`` rows): the tokenizer's
  own encoding with its special tokens, then its EOS token; the loss on every token but the
  first (:func:`tokenize_text`). A text longer than ``max_seq_len`` is cut like any example,
  or, with ``split_long_texts``, becomes one example per consecutive window of
  ``max_seq_len`` tokens (nothing lost; each window trains every token but its first).

``token_mask`` is 1 only on loss tokens of assistant messages at index >= ``loss_from_message``
(preference data sets it to the prompt length so only the response counts). Sequences
longer than ``max_seq_len`` are cut to their first ``max_seq_len`` tokens and flagged
``truncated``; :func:`tokenize_message_logs` counts and logs them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypedDict

from tempering.data.messages import Conversation, Text
from tempering.data.records import MessageLog
from tempering.errors import UserInputError
from tempering.models.generation.chat import render_chat
from tempering.models.hf import text_encoder

logger = logging.getLogger(__name__)
Tools = Sequence[dict[str, Any]] | None  # OpenAI function specs (data/messages.py)


class ChatTemplateError(ValueError, UserInputError):
    """A chat template cannot be split into per-message pieces."""


class HistoryRewrittenError(ChatTemplateError):
    """The template renders earlier messages differently once later ones follow (Qwen3's
    drops the reasoning of turns before the last user message): the whole conversation has no
    per-message cut, each of its assistant turns still has one (`tokenize_message_logs`)."""


class TokenizedExample(TypedDict):
    input_ids: list[int]
    token_mask: list[int]  # 1 on loss (assistant) tokens
    truncated: bool


class TextMemo:
    """The chat-template renders and encodings of one batch, each computed once: rows of a
    batch repeat them (a preference pair's chosen and rejected rows share their prompt, a
    conversation's turns their history). Returned id lists are shared: do not mutate them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encode = text_encoder(tokenizer)
        self._ids: dict[str, list[int]] = {}
        self._renders: dict[tuple[str, bool], str] = {}

    def encode(self, text: str, keep: bool = True) -> list[int]:
        """``keep=False``: a text no other row repeats (a whole row), not memoised."""
        if not text:
            return []
        ids = self._ids.get(text)
        if ids is None:
            ids = self._encode(text)
            if keep:
                self._ids[text] = ids
        return ids

    def render(self, messages: MessageLog, add_generation_prompt: bool, tools: Tools = None) -> str:
        if not messages and not add_generation_prompt and not tools:
            return ""
        key = (repr(messages), add_generation_prompt, repr(tools) if tools else "")
        text = self._renders.get(key)
        if text is None:
            try:
                text = render_chat(
                    self.tokenizer, self.tokenizer.chat_template, messages, tools,
                    add_generation_prompt,
                )  # fmt: skip
            except ValueError as err:
                raise ChatTemplateError(str(err)) from err
            if not isinstance(text, str):
                raise ChatTemplateError(
                    f"apply_chat_template returned {type(text).__name__}, not str"
                )
            self._renders[key] = text
        return text


def _strip_prefix(text: str, prefix: str, what: str, error: type = ChatTemplateError) -> str:
    if not text.startswith(prefix):
        raise error(
            f"the chat template does not render {what} as an extension of the messages before "
            f"it (rendered {prefix[-60:]!r}, then {text[max(0, len(prefix) - 60) : len(prefix)]!r}); "
            "per-message loss masks need a template that renders earlier turns unchanged "
            "(e.g. drop history-rewriting logic, or pass a custom chat_template)"
        )
    return text[len(prefix) :]


def _templated_pieces(
    messages: MessageLog, memo: TextMemo, add_generation_prompt: bool, loss_from: int, tools: Tools
) -> list[tuple[str, bool, int]]:
    """``(text, is_assistant_body, message_index)`` pieces whose concatenation is the render.
    Split at the trained assistant turns only (index >= ``loss_from``): a template may render
    a run of other messages as one block (Qwen's groups consecutive tool results under one
    user turn), and the context before the first trained turn is one piece."""
    pieces: list[tuple[str, bool, int]] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < loss_from:
            continue
        before = memo.render(messages[:i], True, tools)
        full = memo.render(messages[: i + 1], False, tools)
        prompt = _strip_prefix(before, rendered, f"the messages before assistant message {i}",
                               HistoryRewrittenError)  # fmt: skip
        body = _strip_prefix(full, before, f"assistant message {i} after its header")
        pieces += [(prompt, False, i), (body, True, i)]
        rendered = full
    end = memo.render(messages, add_generation_prompt, tools)
    tail = _strip_prefix(end, rendered, "the messages after the last assistant message",
                         HistoryRewrittenError)  # fmt: skip
    pieces.append((tail, False, len(messages)))
    return pieces


def _tokenize_templated(
    messages: MessageLog, memo: TextMemo, add_generation_prompt: bool, loss_from: int, tools: Tools
) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    pieces = _templated_pieces(messages, memo, add_generation_prompt, loss_from, tools)
    for text, is_body, index in pieces:
        piece_ids = memo.encode(text)
        ids += piece_ids
        mask += [int(is_body and index >= loss_from)] * len(piece_ids)
    whole = memo.encode("".join(text for text, _, _ in pieces), keep=False)
    if whole != ids:
        first = next((k for k, (a, b) in enumerate(zip(whole, ids, strict=False)) if a != b), None)
        raise ChatTemplateError(
            "tokenizing the chat-templated conversation turn by turn gives different "
            f"tokens than tokenizing it whole (first difference at token {first}, lengths "
            f"{len(ids)} vs {len(whole)}): tokens merge across message boundaries; use a "
            "template whose turns end in a special token"
        )
    return ids, mask


def _tokenize_plain(
    messages: MessageLog, memo: TextMemo, add_generation_prompt: bool, loss_from: int, tools: Tools
) -> tuple[list[int], list[int]]:
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        name = getattr(memo.tokenizer, "name_or_path", "")
        raise ChatTemplateError(
            f"a conversation with tool calls or tools needs a chat template to render them, and "
            f"tokenizer {name!r} has none (a base model?). Fix: set "
            "policy.tokenizer.chat_template to a Jinja template, or use the model's instruct "
            "version"
        )
    ids: list[int] = []
    mask: list[int] = []
    eos = getattr(memo.tokenizer, "eos_token_id", None)
    for i, message in enumerate(messages):
        piece = [*memo.encode(message["content"])]
        is_loss = message["role"] == "assistant" and i >= loss_from
        if message["role"] == "assistant" and eos is not None:
            piece.append(eos)
        ids += piece
        mask += [int(is_loss)] * len(piece)
    return ids, mask


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_message_log(
    message_log: MessageLog,
    tokenizer: Any,
    max_seq_len: int,
    add_generation_prompt: bool = False,
    loss_from_message: int = 0,
    memo: TextMemo | None = None,
    tools: Tools = None,
) -> TokenizedExample:
    """Token ids and assistant-only loss mask of one message log (see module docstring).
    ``memo``: the batch's `TextMemo` (of the same tokenizer) where its rows share text.
    ``tools``: the function specs the conversation's assistant may call."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
    if has_chat_template(tokenizer):
        tokenize = _tokenize_templated
    else:
        tokenize = _tokenize_plain
    memo = memo if memo is not None else TextMemo(tokenizer)
    ids, mask = tokenize(message_log, memo, add_generation_prompt, loss_from_message, tools)
    return _cut(ids, mask, max_seq_len)


def _cut(ids: list[int], mask: list[int], max_seq_len: int) -> TokenizedExample:
    """An example of its first ``max_seq_len`` tokens, flagged ``truncated`` when cut."""
    return {"input_ids": ids[:max_seq_len], "token_mask": mask[:max_seq_len],
            "truncated": len(ids) > max_seq_len}  # fmt: skip


def _tokenize_conversation(
    conv: Conversation, tokenizer: Any, max_seq_len: int, memo: TextMemo | None = None
) -> TokenizedExample:
    return tokenize_message_log(
        conv.messages, tokenizer, max_seq_len, memo=memo, loss_from_message=conv.loss_from,
        tools=conv.tools or None,
    )  # fmt: skip


def tokenize_text(
    text: str, tokenizer: Any, max_seq_len: int, *, split: bool = False
) -> list[TokenizedExample]:
    """A `Text` example: the tokenizer's own special tokens (a BOS where it adds one), then the
    end-of-text token unless the text ends in it; the loss on every token but the first
    (which nothing predicts). Longer than ``max_seq_len``: cut, or with ``split`` one example
    per consecutive window of ``max_seq_len`` tokens (a last window of one token, which
    trains nothing, is left out)."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    if not split or len(ids) <= max_seq_len:
        return [_cut(ids, [0] + [1] * (len(ids) - 1), max_seq_len)]
    windows = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
    return [_cut(w, [0] + [1] * (len(w) - 1), max_seq_len) for w in windows if len(w) > 1]


def tokenize_message_logs(
    message_logs: Sequence[MessageLog | Conversation | Text],
    tokenizer: Any,
    max_seq_len: int,
    split_long_texts: bool = False,
) -> tuple[list[TokenizedExample], int]:
    """Tokenize many logs (a `Conversation` with its tools, a `Text` whole, or in windows with
    ``split_long_texts``); returns the examples and how many were truncated (also logged;
    split texts, logged too, are not truncated). A conversation whose template
    rewrites earlier turns once later ones follow (`HistoryRewrittenError`) becomes one
    example per trained assistant turn, each after its history as the template renders it
    when the model writes that turn (what inference shows it); counted and logged."""
    examples: list[TokenizedExample] = []
    split: list[int] = []  # examples made from each conversation split by turn
    windows: list[int] = []  # examples made from each text split into windows
    for log in message_logs:
        if isinstance(log, Text):
            pieces = tokenize_text(log.text, tokenizer, max_seq_len, split=split_long_texts)
            examples += pieces
            if len(pieces) > 1:
                windows.append(len(pieces))
            continue
        conv = log if isinstance(log, Conversation) else Conversation(log, [])
        try:
            examples.append(_tokenize_conversation(conv, tokenizer, max_seq_len))
        except HistoryRewrittenError:
            turns = [Conversation(conv.messages[: i + 1], conv.tools, loss_from=i)
                     for i, m in enumerate(conv.messages)
                     if m["role"] == "assistant" and i >= conv.loss_from]  # fmt: skip
            memo = TextMemo(tokenizer)
            examples += [_tokenize_conversation(t, tokenizer, max_seq_len, memo) for t in turns]
            split.append(len(turns))
    if split:
        logger.warning(
            "%d of %d conversations became %d examples, one per assistant turn: the chat "
            "template renders their earlier turns differently once later ones follow (e.g. it "
            "drops earlier reasoning), so each turn is trained after its history as the "
            "template renders it when that turn is generated",
            len(split), len(message_logs), sum(split),
        )  # fmt: skip
    if windows:
        logger.info(
            "%d of %d texts were longer than max_seq_len=%d and became %d examples of "
            "consecutive windows (data.split_long_texts)",
            len(windows), len(message_logs), max_seq_len, sum(windows),
        )  # fmt: skip
    num_truncated = sum(e["truncated"] for e in examples)
    if num_truncated:
        # a prompt that fills the budget leaves no response token: that example teaches nothing
        lost = sum(1 for e in examples if e["truncated"] and not any(e["token_mask"]))
        logger.warning(
            "%d of %d examples were longer than max_seq_len=%d and were truncated (%d of them "
            "kept no response token to train on: raise policy.max_total_sequence_length)",
            num_truncated, len(examples), max_seq_len, lost,
        )  # fmt: skip
    return examples, num_truncated
