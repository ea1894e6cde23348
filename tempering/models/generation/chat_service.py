"""The chat service: OpenAI-style chat completions over any `GenerationInterface` backend, no HTTP.

It owns what turns a conversation into backend calls and back: prompt construction (chat
template, tools, tool-call parsing and the on-policy splice of `chat.py`), batching, replica
routing and the refit lock. Two ways in:

- in process, `ChatCompletionService.complete_many(requests)` (the multi-turn rollout loop,
  evaluation): one backend call per sampling setting, a refused request gets its
  `RequestError` in its place;
- over HTTP, `openai_server.py` parses a JSON body into a `ChatRequest`, awaits
  `ChatCompletionService.complete` and shapes the `ChatResult` into OpenAI's response; that
  module imports this one, never the other way round, so in-process users do not import FastAPI.

    service = ChatCompletionService(generation, tokenizer, ServerSettings(model_name="policy",
                                    max_model_len=512, default_sampling=SamplingConfig()))
    results = service.complete_many([ChatRequest(messages, SamplingConfig(max_new_tokens=32))])
    service.refit(lambda: generation.refit(policy), version=step)   # waits for in-flight work

- **Batching**: requests that arrive within ``batch_wait_ms`` of each other (up to
  ``max_batch_size``) go to the backend as one call per sampling setting.
- **Replicas**: with several data-parallel generation workers, a conversation sticks to one
  replica: by the ``X-Session-ID`` header (or a ``session_id`` body field) when given, else by
  its first assistant turn's token ids (a new conversation goes to the least busy replica).
- **Refit** (`ChatCompletionService.refit`): waits for in-flight backend calls, holds new ones
  until the new weights are loaded, then bumps ``weight_version``.
- **Rollout ids** (`ChatRequest.rollout_id`, from an external harness's base URL or its
  ``X-Rollout-ID`` header): with a `capture` (rollout_capture.py) set by the trainer, each
  such call is refused unless its id is open, its plain assistant messages get their recorded
  ids, and what it served is recorded under the id.
- **Refusals**: what cannot be served (a history that cannot be continued, a prompt with no
  room left to generate, a bad field found by the HTTP layer) raises `RequestError` with the
  HTTP status, the field and what to do; the HTTP layer turns it into OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict, rows_tensor
from tempering.models.generation.chat import (
    ChatPromptBuilder,
    NonContiguousHistoryError,
    ParsedToolCalls,
    PromptIds,
)
from tempering.models.generation.interfaces import SamplingConfig

log = logging.getLogger(__name__)

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "ChatCompletionService",
    "ChatRequest",
    "ChatResult",
    "RequestError",
    "ServerSettings",
    "StreamSink",
]


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for an over-long prompt


class RequestError(Exception):
    """A request the server refuses: HTTP status, the offending field, and what to do.

    Raised here and by the HTTP layer's parsing; `openai_server.error_body` gives its
    OpenAI-shaped JSON body."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class ServerSettings:
    """Plain arguments of the service (the algorithm's builder reads them from the config)."""

    model_name: str
    """The name clients send as ``model``; any other name gets a 404."""
    max_model_len: int
    """Prompt + generation budget in tokens (policy.max_total_sequence_length)."""
    default_sampling: SamplingConfig
    """Sampling for fields a request leaves out (temperature, top_p, top_k, max_tokens)."""
    training_mode: bool = True
    """Return token ids and sampler log-probs on every choice."""
    batch_wait_ms: float = 5.0
    """How long a replica collects requests before one batched backend call."""
    max_batch_size: int = 256
    """At most this many requests per backend call."""
    on_noncontiguous: Literal["error", "truncate"] = "error"
    """History whose token ids cannot be continued: 400, or fall back and count it."""
    tool_parser: str = "hermes"
    chat_template: str | None = None
    eot_token: str | None = None


@dataclass
class ChatRequest:
    """One validated chat completion request, independent of the transport."""

    messages: list[dict[str, Any]]
    sampling: SamplingConfig  # max_new_tokens = the request's token budget
    greedy: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True  # tool_choice "auto" with tools given
    logprobs: bool = False
    tokens_as_ids: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    session_id: str | None = None
    prompt_ids: list[int] | None = None  # in-process callers only: skip the template
    max_total_tokens: int | None = None  # in-process callers: a budget under max_model_len
    seeded: bool = False  # a per-request seed: served in a backend call of its own
    n: int = 1  # choices: n rows of one backend call (HTTP path only)
    return_token_ids: bool = False  # token ids on every choice outside training mode too
    stream: StreamSink | None = None  # streamed responses: each generated token, as it comes
    rollout_id: str | None = None  # an external harness's episode: recorded (`capture`)


class StreamSink:
    """The tokens of one streamed request, from the generating thread to the event loop.

    The service puts ``(choice, token_id, logprob, top)`` for every generated token (``top``:
    ``(ids, logprobs)`` or None) into ``queue``; the HTTP layer reads them. Setting
    ``cancelled`` (the client went away) stops the request's rows at the next decode step,
    or skips it while it still waits in the queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = False

    def put(self, event: Any) -> None:
        """Thread-safe: hand one event to the event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class ChatResult:
    prompt_ids: list[int]
    generation_ids: list[int]
    generation_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str  # decoded generation (stop string and everything after it removed)
    parsed: ParsedToolCalls | None  # tool calls (None when the request does not parse them)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    weight_version: int  # with per-token versions: the oldest of them
    replica: int | None
    # in-flight weight updates: the weight version of each generated token
    generation_weight_versions: list[int] | None = None

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message with its token ids, ready to send back as history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.parsed is not None:
            message["content"] = self.parsed.content
            if self.parsed.tool_calls:
                message["tool_calls"] = self.parsed.tool_calls
        message["prompt_token_ids"] = self.prompt_ids
        message["generation_token_ids"] = self.generation_ids
        message["generation_log_probs"] = self.generation_logprobs
        if self.generation_weight_versions is not None:
            message["generation_weight_versions"] = self.generation_weight_versions
        return message


@dataclass
class _Prepared:
    request: ChatRequest
    prompt_ids: list[int]
    max_new_tokens: int
    key: tuple[Any, ...]  # requests with equal keys share one backend call

    @property
    def n(self) -> int:
        return self.request.n


class ChatCompletionService:
    """Prompt building, batching, replica routing and the refit lock; no HTTP.

    `backend` implements `generate(data, greedy, sampling)` (GenerationInterface) and, to
    serve several replicas, `num_replicas` and `generate_on(replica, data, greedy, sampling)`
    (`tempering.models.generation.builders`)."""

    def __init__(self, backend: Any, tokenizer: Any, settings: ServerSettings) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.settings = settings
        self.prompts = ChatPromptBuilder(
            tokenizer, settings.chat_template, settings.tool_parser, settings.eot_token
        )
        self.num_replicas = int(getattr(backend, "num_replicas", 1))
        self.weight_version = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
        self._cv = threading.Condition()
        self._in_flight = 0
        self._refitting = False
        self._routes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._load = [0] * self.num_replicas  # requests queued or running per replica
        self._running = 0  # rows inside backend calls now
        self._pending: list[list[tuple[_Prepared, asyncio.Future[list[ChatResult]]]]] = [
            [] for _ in range(self.num_replicas)
        ]
        self._wake: list[asyncio.Event] = []
        self._loops: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(self.num_replicas + 1, thread_name_prefix="chat-gen")
        self._warned_fields: set[str] = set()
        self._token_texts: dict[int, str] = {}  # token id -> its text, for log-prob entries
        self.steps_reported = bool(getattr(backend, "reports_steps", False))
        # RolloutCapture (rollout_capture.py) while a trainer collects external rollouts
        self.capture: Any = None

    # ---- requests ------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> int:
        """Add ``n`` to the counter ``key``; returns its new value."""
        with self._stats_lock:
            self.stats[key] += n
            return self.stats[key]

    def stats_snapshot(self) -> dict[str, int]:
        """A copy of the counters (they are bumped from the server's threads)."""
        with self._stats_lock:
            return dict(self.stats)

    def encode(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
        hint: str = "",
    ) -> PromptIds:
        """The prompt's ids by the chat template (`ChatPromptBuilder.encode`); RequestError on
        ``messages`` for a history that cannot be encoded (`hint` follows a non-contiguous
        history's message: what the caller can do)."""
        try:
            return self.prompts.encode(
                messages,
                tools,
                chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                on_noncontiguous=self.settings.on_noncontiguous,
            )
        except NonContiguousHistoryError as err:
            self.count("noncontiguous_rejected")
            raise RequestError(f"{err}{hint}", "messages") from err
        except ValueError as err:
            raise RequestError(str(err), "messages") from err

    def prepare(self, request: ChatRequest) -> _Prepared:
        """Prompt ids and token budget; RequestError for what cannot be served."""
        if request.rollout_id is not None:
            self._attach_captured_ids(request)
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
        else:
            enc = self.encode(
                request.messages,
                request.tools,
                request.chat_template_kwargs,
                hint=". Send the messages exactly as returned (with their token ids), or start "
                "the server with on_noncontiguous='truncate'.",
            )
            ids = enc.ids
            self.count("noncontiguous_truncated", int(enc.truncated))
            self.count("retokenized_assistant_turns", enc.retokenized_assistant_turns)
        limit = min(self.settings.max_model_len, request.max_total_tokens or 1 << 62)
        budget = limit - len(ids)
        if budget < 1:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                f"max_model_len={limit}; shorten the conversation",
                "messages",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        max_new = request.sampling.max_new_tokens
        if max_new > budget:
            self.count("max_tokens_clipped")
            max_new = budget
        s = request.sampling
        key = (
            request.greedy,
            s.temperature,
            s.top_p,
            s.top_k,
            tuple(s.stop_strings),
            tuple(s.stop_token_ids),
            s.top_logprobs,
            uuid.uuid4().hex if request.seeded else None,
        )
        return _Prepared(request, ids, max_new, key)

    def complete_many(self, requests: Sequence[ChatRequest]) -> list[ChatResult | RequestError]:
        """In-process: all requests, one backend call per sampling setting (over every
        replica via ``backend.generate``); a request the server refuses gets its RequestError
        in its place."""
        out: list[ChatResult | RequestError | None] = [None] * len(requests)
        prepared, where = [], []
        for i, request in enumerate(requests):
            try:
                prepared.append(self.prepare(request))
                where.append(i)
            except RequestError as err:
                out[i] = err
        if any(p.n != 1 for p in prepared):
            raise ValueError("complete_many serves n=1 requests; repeat a request for more")
        if prepared:
            for i, result in zip(where, self._run(prepared, replica=None), strict=True):
                out[i] = result[0]
        return [r for r in out if r is not None]

    async def complete(self, request: ChatRequest) -> ChatResult:
        """HTTP path: queue on a replica, batched with concurrent requests (n = 1)."""
        return (await self.complete_choices(request))[0]

    async def complete_choices(
        self, request: ChatRequest, prepared: _Prepared | None = None
    ) -> list[ChatResult]:
        """HTTP path: the request's ``n`` choices, rows of one backend call, which it shares
        with concurrent requests (a seeded request: with none). ``prepared``: `prepare`'s
        result when the caller ran it already (a stream refuses before it starts)."""
        prepared = prepared or self.prepare(request)
        self._ensure_loops()
        replica = self._route(request)
        future: asyncio.Future[list[ChatResult]] = asyncio.get_running_loop().create_future()
        self._pending[replica].append((prepared, future))
        self._load[replica] += 1
        self._wake[replica].set()
        try:
            results = await future
        finally:
            self._load[replica] -= 1
        if request.rollout_id is not None:
            self.capture.record(request.rollout_id, results)
        if request.session_id is None and not _anchor_key(request.messages):
            first = results[0]
            self._remember(_ids_key(first.prompt_ids + first.generation_ids), replica)
        return results

    def load(self) -> dict[str, int]:
        """Requests waiting for a backend call (``queued``) and rows inside one (``running``)."""
        queued = sum(1 for pending in self._pending for _, f in pending if not f.done())
        return {"queued": queued, "running": self._running}

    def _attach_captured_ids(self, request: ChatRequest) -> None:
        """An external harness's call: refused unless its rollout id is open; its plain
        assistant messages get the ids recorded for them (`RolloutCapture.attach`), in place
        (a stream's sink is set on this object after `prepare`)."""
        rid = request.rollout_id
        if self.capture is None or not self.capture.is_open(rid):
            self.count("rollout_id_refused")
            raise RequestError(
                f"rollout id {rid!r} is not open on this server (its episode was reported "
                "already, it was never issued, or no external rollouts are being collected); "
                "use the base URL or X-Rollout-ID the trainer gave this episode",
                "rollout_id",
                status=404,
                code="rollout_not_found",
            )
        request.messages = self.capture.attach(rid, request.messages)

    # ---- refit ---------------------------------------------------------------------------
    def refit(
        self, load_weights: Callable[[], None], version: int | None = None, drain: bool = True
    ) -> None:
        """Run `load_weights` once no backend call is in flight; calls that arrive meanwhile
        wait. Then ``weight_version`` becomes `version` (default: +1). ``drain=False``
        (in-flight weight updates): calls in flight go on, and new ones are not held."""
        if not drain:
            load_weights()
            with self._cv:
                self.weight_version = self.weight_version + 1 if version is None else version
            return
        with self._cv:
            self._refitting = True
            self._cv.wait_for(lambda: self._in_flight == 0)
        try:
            load_weights()
        finally:
            with self._cv:
                self.weight_version = self.weight_version + 1 if version is None else version
                self._refitting = False
                self._cv.notify_all()

    def close(self) -> None:
        """Forget the HTTP batching loops (they die with their server's event loop), so a
        later server can serve this service again; in-process use needs none of them."""
        for task in self._loops:
            loop = task.get_loop()
            if not task.done() and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
        self._loops, self._wake = [], []
        for pending in self._pending:
            pending.clear()

    # ---- internals -----------------------------------------------------------------------
    def _ensure_loops(self) -> None:
        if self._loops:
            return
        self._wake = [asyncio.Event() for _ in range(self.num_replicas)]
        self._loops = [
            asyncio.get_running_loop().create_task(self._replica_loop(r))
            for r in range(self.num_replicas)
        ]

    async def _replica_loop(self, replica: int) -> None:
        loop = asyncio.get_running_loop()
        pending, wake = self._pending[replica], self._wake[replica]
        limit = self.settings.max_batch_size
        while True:
            await wake.wait()
            if len(pending) < limit:  # let concurrent requests join this batch
                await asyncio.sleep(self.settings.batch_wait_ms / 1000)
            take, rows = 0, 0  # whole requests, at most `limit` rows (one if it has more)
            while take < len(pending) and (take == 0 or rows + pending[take][0].n <= limit):
                rows += pending[take][0].n
                take += 1
            batch = pending[:take]
            del pending[:take]
            if not pending:
                wake.clear()
            live = [(p, f) for p, f in batch if not f.done()]
            if not live:
                continue
            target = replica if self.num_replicas > 1 else None
            try:
                results = await loop.run_in_executor(
                    self._executor, self._run, [p for p, _ in live], target
                )
            except Exception as err:  # every waiting request gets the backend's error
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    def _route(self, request: ChatRequest) -> int:
        if self.num_replicas == 1:
            return 0
        key = (
            f"session:{request.session_id}" if request.session_id else _anchor_key(request.messages)
        )
        if key and key in self._routes:
            self._routes.move_to_end(key)
            return self._routes[key]
        replica = min(range(self.num_replicas), key=lambda r: self._load[r])
        if key:
            self._remember(key, replica)
        return replica

    def _remember(self, key: str, replica: int) -> None:
        if self.num_replicas == 1:
            return
        self._routes[key] = replica
        self._routes.move_to_end(key)
        while len(self._routes) > 100_000:
            self._routes.popitem(last=False)

    def _run(self, prepared: list[_Prepared], replica: int | None) -> list[list[ChatResult]]:
        """Blocking: one backend call per sampling key; each request's n choices, in input
        order."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.key, []).append(i)
        results: list[list[ChatResult]] = [[] for _ in prepared]
        for idx in groups.values():
            rows = [prepared[i] for i in idx for _ in range(prepared[i].n)]  # n rows each
            out = iter(self._generate(rows, replica))
            for i in idx:
                results[i] = [next(out) for _ in range(prepared[i].n)]
        return results

    def _generate(self, rows: list[_Prepared], replica: int | None) -> list[ChatResult]:
        first = rows[0].request
        streams = _StepRouter(self, rows) if any(r.request.stream for r in rows) else None
        width, pad = max(len(r.prompt_ids) for r in rows), _pad_id(self.tokenizer)
        lengths = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        input_ids = rows_tensor([r.prompt_ids + [pad] * (width - len(r.prompt_ids)) for r in rows])
        caps = torch.tensor([r.max_new_tokens for r in rows], dtype=torch.long)
        data = BatchedDataDict(input_ids=input_ids, input_lengths=lengths, max_new_tokens=caps)
        sampling = dataclasses.replace(
            first.sampling,
            max_new_tokens=int(caps.max()),
            stop_token_ids=sorted({*first.sampling.stop_token_ids, self.prompts.eot_token_id}),
        )
        with self._cv:
            self._cv.wait_for(lambda: not self._refitting)
            self._in_flight += 1
            self._running += len(rows)
            version = self.weight_version
        try:
            if replica is not None:
                out = self.backend.generate_on(
                    replica, data, greedy=first.greedy, sampling=sampling
                )
            elif streams is not None and self.steps_reported:
                out = self.backend.generate(data, first.greedy, sampling, on_step=streams)
            else:
                out = self.backend.generate(data, greedy=first.greedy, sampling=sampling)
        finally:
            with self._cv:
                self._in_flight -= 1
                self._running -= len(rows)
                self._cv.notify_all()
        self.count("backend_calls")
        self.count("requests", len(set(map(id, rows))))
        lists = {k: out[k].tolist() for k in _OUTPUT_KEYS if k in out}  # once, not per row
        lists["finish_reasons"] = list(out["finish_reasons"])
        results = [self._result(r, lists, b, version, replica) for b, r in enumerate(rows)]
        if streams is not None and (replica is not None or not self.steps_reported):
            streams.replay(results)  # a backend that does not report steps: all at once
        return results

    def _result(
        self, row: _Prepared, out: dict[str, Any], b: int, version: int, replica: int | None
    ) -> ChatResult:
        start, n = len(row.prompt_ids), int(out["generation_lengths"][b])
        gen_ids = out["output_ids"][b][start : start + n]
        logprobs = out["logprobs"][b][start : start + n]
        top = None
        if "top_logprob_ids" in out:
            ids = out["top_logprob_ids"][b][start : start + n]
            values = out["top_logprobs"][b][start : start + n]
            top = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        versions = None
        if "token_weight_versions" in out:  # in-flight weight updates: per token
            versions = out["token_weight_versions"][b][start : start + n]
            version = min(versions, default=version)
        text = self.prompts.decode(gen_ids)
        for stop in row.request.sampling.stop_strings:  # OpenAI: the stop text is not returned
            if stop in text:
                text = text[: text.index(stop)]
        finish = str(out["finish_reasons"][b])
        parsed = None
        if row.request.parse_tools:
            parsed = self.prompts.parse_tool_calls(text)
            self.count("tool_call_parse_errors", len(parsed.errors))
            for error in parsed.errors:
                log.warning("tool-call parse error (left in content): %s", error)
            if parsed.tool_calls:
                finish = "tool_calls"
        return ChatResult(prompt_ids=row.prompt_ids, generation_ids=gen_ids,
                          generation_logprobs=logprobs, top_logprobs=top, text=text,
                          parsed=parsed, finish_reason=finish, weight_version=version,
                          replica=replica, generation_weight_versions=versions)  # fmt: skip

    # ---- for the HTTP layer --------------------------------------------------------------
    def note_ignored_fields(self, names: Sequence[str]) -> None:
        """Unknown request fields are ignored, counted and logged once per name."""
        for name in names:
            self.count("ignored_request_fields")
            if name not in self._warned_fields:
                self._warned_fields.add(name)
                log.warning("chat completions: ignoring unknown request field %r", name)

    def token_text(self, token_id: int) -> str:
        """The text of one token id (special tokens kept), cached: log-prob entries name it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.prompts.decode([token_id], False)
        return text


class _StepRouter:
    """The `StepCallback` of one backend call: each row's tokens to its request's stream
    (choice = the row's place among its request's n rows); rows of cancelled streams stop."""

    def __init__(self, service: ChatCompletionService, rows: list[_Prepared]) -> None:
        self.service = service
        self.sinks: list[tuple[StreamSink | None, int]] = []
        seen: collections.Counter[int] = collections.Counter()
        for row in rows:
            self.sinks.append((row.request.stream, seen[id(row)]))
            seen[id(row)] += 1

    def __call__(self, rows: list[int], tokens: list[int], logprobs: list[float],
                 top: Any) -> list[int]:  # fmt: skip
        stop = []
        for j, b in enumerate(rows):
            sink, choice = self.sinks[b]
            if sink is None:
                continue
            if sink.cancelled:
                stop.append(b)
                continue
            alternatives = None if top is None else list(zip(top[0][j], top[1][j], strict=True))
            sink.put((choice, tokens[j], logprobs[j], alternatives))
        if stop:
            self.service.count("stream_rows_cancelled", len(stop))
            log.info("generation server: %d row(s) of a disconnected stream stopped", len(stop))
        return stop

    def replay(self, results: list[ChatResult]) -> None:
        """After a call without step reports: every streamed row's tokens, in order."""
        if self.service.count("streams_sent_whole", len(results)) == len(results):
            log.warning("generation server: this backend does not report decode steps; "
                        "streamed responses arrive whole when their generation ends")  # fmt: skip
        for (sink, choice), result in zip(self.sinks, results, strict=True):
            if sink is None:
                continue
            top = result.top_logprobs or [None] * len(result.generation_ids)
            for token, lp, alt in zip(result.generation_ids, result.generation_logprobs, top,
                                      strict=True):  # fmt: skip
                sink.put((choice, token, lp, alt))


_OUTPUT_KEYS = ("output_ids", "logprobs", "generation_lengths", "top_logprob_ids", "top_logprobs",
                "token_weight_versions")  # fmt: skip


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def _ids_key(ids: Sequence[int]) -> str:
    return "ids:" + hashlib.blake2b(json.dumps(list(ids)).encode(), digest_size=16).hexdigest()


def _anchor_key(messages: Sequence[dict[str, Any]]) -> str | None:
    """The conversation's first assistant turn with token ids identifies it across turns."""
    for m in messages:
        if m.get("role") == "assistant" and m.get("generation_token_ids") is not None:
            return _ids_key(list(m.get("prompt_token_ids") or []) + list(m["generation_token_ids"]))
    return None
