"""Streamed responses (``stream: true``) of the OpenAI-compatible server, framed as OpenAI's API.

Server-sent events: one ``data: {json}\\n\\n`` chunk per generated token and choice (a
``delta`` with the text that became final, and in training mode or with ``return_token_ids``
the token id and its log-prob; ``logprobs`` entries when asked), a last chunk per choice
with its ``finish_reason`` (and any ``tool_calls`` deltas), a ``usage`` chunk with
``stream_options: {"include_usage": true}``, then ``data: [DONE]``. The chat and the
completions routes differ only in the shape of a choice (`ChatChunks`, and
`openai_completions.CompletionChunks`).

- **Text** is sent once it cannot change: a piece that might still become a stop string is
  held back (OpenAI does not return the stop text), and so is an incomplete UTF-8 character.
  A request that parses tool calls holds its content until the generation ends (the parser
  needs the whole text); its tokens still stream. So greedy output reassembles to exactly
  the non-streamed response.
- **Disconnects**: starlette cancels the stream when the client goes away; the request's
  rows stop at the next decode step (or it leaves the queue), counted as
  ``stream_rows_cancelled`` and in ``/metrics``.
- Errors found before the first byte (a bad field, a prompt too long) are the usual 4xx;
  a backend failure mid-stream becomes an ``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    ChatResult,
    RequestError,
    _Prepared,
)
from tempering.models.generation.openai_protocol import (
    logprob_entry,
    usage,
    with_logprobs,
    with_token_ids,
)

log = logging.getLogger(__name__)

__all__ = ["ChatChunks", "ChoiceText", "StreamOptions", "event_stream", "stream_options"]

_DONE = object()  # the request's backend call has ended: its results are ready


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False


def stream_options(body: dict[str, Any]) -> StreamOptions | None:
    """The request's streaming options (None: not streamed); a 400 naming the field for a
    malformed ``stream`` or ``stream_options``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream={stream!r} must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return StreamOptions() if stream else None
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true; remove it or "
                           "set stream", "stream_options")  # fmt: skip
    if not isinstance(options, dict):
        raise RequestError(f"stream_options={options!r} must be an object such as "
                           '{"include_usage": true}', "stream_options")  # fmt: skip
    for key in options:
        if key != "include_usage":
            raise RequestError(f"stream_options.{key} is not supported (only include_usage)",
                               f"stream_options.{key}")  # fmt: skip
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(f"stream_options.include_usage={include!r} must be true or false",
                           "stream_options.include_usage")  # fmt: skip
    return StreamOptions(include_usage=include)


class ChoiceText:
    """One choice's text as its tokens arrive: `add` returns what became final."""

    def __init__(self, service: ChatCompletionService, request: ChatRequest) -> None:
        self.service = service
        self.decode = service.prompts.decode
        self.stops = request.sampling.stop_strings
        self.hold_all = request.parse_tools
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.hold_all:
            return ""
        text = self.decode(self.ids)
        end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character waits for its rest
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                end = min(end, at)
            else:  # hold back a tail that may still grow into the stop string
                end -= next((k for k in range(len(stop) - 1, 0, -1)
                             if text[:end].endswith(stop[:k])), 0)  # fmt: skip
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece = text[len(self.sent) : end]
        self.sent += piece
        return piece

    def rest(self, final: str | None) -> str:
        """What is left to send of the choice's final text (the non-streamed content)."""
        final = final or ""
        if not final.startswith(self.sent):  # never seen with byte-level BPE; counted if so
            self.service.count("stream_text_mismatch")
            log.warning("streamed text %r is not a prefix of the final %r", self.sent, final)
            return ""
        return final[len(self.sent) :]


class Chunks(Protocol):
    """The shape of a route's streamed choices."""

    object: str
    id_prefix: str

    def first(self, index: int, result_prompt: list[int]) -> dict[str, Any] | None: ...

    def token(self, index: int, piece: str, token: int, logprob: float,
              alternatives: list[tuple[int, float]] | None) -> dict[str, Any] | None: ...  # fmt: skip

    def last(self, index: int, rest: str, result: ChatResult) -> list[dict[str, Any]]: ...

    def final_text(self, result: ChatResult) -> str | None: ...


class ChatChunks:
    """``chat.completion.chunk`` choices."""

    object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, service: ChatCompletionService, request: ChatRequest) -> None:
        self.service, self.request = service, request
        self.ids, self.logprobs = with_token_ids(service, request), with_logprobs(service, request)

    def first(self, index: int, prompt_ids: list[int]) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.ids:
            delta["prompt_token_ids"] = prompt_ids
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def token(self, index: int, piece: str, token: int, logprob: float,
              alternatives: list[tuple[int, float]] | None) -> dict[str, Any] | None:  # fmt: skip
        delta: dict[str, Any] = {"content": piece} if piece else {}
        if self.ids:
            delta["generation_token_ids"], delta["generation_log_probs"] = [token], [logprob]
        logprobs = None
        if self.logprobs:
            entry = logprob_entry(self.service, self.request, token, logprob, alternatives or [])
            logprobs = {"content": [entry]}
        if not delta and logprobs is None:
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def last(self, index: int, rest: str, result: ChatResult) -> list[dict[str, Any]]:
        delta: dict[str, Any] = {"content": rest} if rest else {}
        calls = result.parsed.tool_calls if result.parsed is not None else []
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        finish = {"index": index, "delta": {}, "logprobs": None,
                  "finish_reason": result.finish_reason}  # fmt: skip
        return (out if delta else []) + [finish]

    def final_text(self, result: ChatResult) -> str | None:
        return result.message["content"]


async def event_stream(
    service: ChatCompletionService,
    request: ChatRequest,
    prepared: _Prepared,
    options: StreamOptions,
    chunks: Chunks,
    metrics: Any,
    started: float,
    route: str,
) -> AsyncIterator[str]:
    """The SSE frames of one streamed request (`request.stream` is its `StreamSink`)."""
    sink = request.stream
    assert sink is not None
    task = asyncio.ensure_future(service.complete_choices(request, prepared))
    task.add_done_callback(lambda _: sink.queue.put_nowait(_DONE))
    base = {"id": f"{chunks.id_prefix}-{uuid.uuid4().hex}", "object": chunks.object,
            "created": int(time.time()), "model": service.settings.model_name}  # fmt: skip

    def frame(choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    texts = [ChoiceText(service, request) for _ in range(request.n)]
    finished = False
    try:
        first = [chunks.first(i, prepared.prompt_ids) for i in range(request.n)]
        if any(first):
            yield frame([c for c in first if c])
        timer = metrics.token_timer(started)
        while (event := await sink.queue.get()) is not _DONE:
            choice, token, logprob, alternatives = event
            timer.tick(choice)
            piece = texts[choice].add(token)
            chunk = chunks.token(choice, piece, token, logprob, alternatives)
            if chunk is not None:
                yield frame([chunk])
        try:
            results = task.result()
        except RequestError as err:  # the rare refusal after the stream began
            results, error = [], {"message": err.message, "param": err.param, "code": err.code}
        except Exception as err:  # noqa: BLE001 - the client gets it as an event
            log.exception("generation failed in a streamed request")
            results, error = [], {"message": f"generation failed: {err}", "code": "internal"}
        if not results:
            service.count("stream_errors")
            yield f"data: {json.dumps({'error': error})}\n\n"
        for i, result in enumerate(results):
            *deltas, finish = chunks.last(i, texts[i].rest(chunks.final_text(result)), result)
            for delta in deltas:  # one choice per chunk, as OpenAI frames them
                yield frame([delta])
            yield frame([finish], weight_version=result.weight_version)
        if options.include_usage and results:
            yield frame([], usage=usage(results))
        if results:
            metrics.observe_usage(results)
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (starlette cancelled us) or we failed
            sink.cancelled = True
            task.cancel()
            metrics.disconnected()
        metrics.answered(route, 200 if finished else 499, started)  # 499: the client left
