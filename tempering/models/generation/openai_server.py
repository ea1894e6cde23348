"""An OpenAI-compatible chat server in front of any `GenerationInterface` backend.

NeMo Gym agents, the multi-turn rollout loop's HTTP path and any OpenAI client talk to the
trainer's generator through it. The server owns prompt construction (chat template, tools,
tool-call parsing and the on-policy splice of `chat.py`) and hands token ids to the backend,
so vLLM is an engine we call, never a server we patch.

    service = ChatCompletionService(generation, tokenizer, ServerSettings(model_name="policy",
                                    max_model_len=512, default_sampling=SamplingConfig()))
    server = OpenAIServer(service).start()      # 127.0.0.1, a free port chosen by the OS
    print(server.base_url)                      # http://127.0.0.1:PORT/v1
    service.refit(lambda: generation.refit(policy), version=step)   # waits for in-flight work
    server.stop()

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /tokenize``, ``GET /health``.

- **Training mode** (the default when a trainer starts the server): every choice's ``message``
  carries ``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs`` (the
  sampler's log-probs, docs/CONTRACTS.md), and ``logprobs`` are always returned (an explicit
  ``top_logprobs: null`` means 0, never "drop them"). With ``return_tokens_as_token_ids`` each
  log-prob entry's ``token`` is ``"token_id:<int>"``. Every response names the
  ``weight_version`` (policy step) that produced it.
- **Batching**: requests that arrive within ``batch_wait_ms`` of each other (up to
  ``max_batch_size``) go to the backend as one call per sampling setting.
- **Replicas**: with several data-parallel generation workers, a conversation sticks to one
  replica: by the ``X-Session-ID`` header (or a ``session_id`` body field) when given, else by
  its first assistant turn's token ids (a new conversation goes to the least busy replica).
- **Refit** (`ChatCompletionService.refit`): waits for in-flight backend calls, holds new ones
  until the new weights are loaded, then bumps ``weight_version``.
- **Security**: binds 127.0.0.1 unless told otherwise; any other address needs an API key
  (``Authorization: Bearer <key>``); the port is bound once (port 0 = the OS picks) and kept.
- **Bad input** gets a 4xx in OpenAI's error shape naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations here
from fastapi.responses import JSONResponse

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.chat import (
    ChatPromptBuilder,
    NonContiguousHistoryError,
    ParsedToolCalls,
)
from tempering.models.generation.interfaces import SamplingConfig
from tempering.utils.serving import BackgroundServer, is_loopback

log = logging.getLogger(__name__)

__all__ = [
    "ChatCompletionService",
    "ChatRequest",
    "ChatResult",
    "OpenAIServer",
    "RequestError",
    "ServerSettings",
    "parse_chat_request",
]


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for an over-long prompt


class RequestError(Exception):
    """A request the server refuses: HTTP status, the offending field, and what to do."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        if self.status == 401:
            kind = "authentication_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


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


@dataclass
class ChatResult:
    prompt_ids: list[int]
    generation_ids: list[int]
    generation_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str  # decoded generation (stop string and everything after it removed)
    parsed: ParsedToolCalls | None  # tool calls (None when the request does not parse them)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    weight_version: int
    replica: int | None

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
        return message


@dataclass
class _Prepared:
    request: ChatRequest
    prompt_ids: list[int]
    max_new_tokens: int
    key: tuple[Any, ...]  # requests with equal keys share one backend call


# --------------------------------------------------------------------------- service
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
        self._load = [0] * self.num_replicas  # rows queued or running per replica
        self._pending: list[list[tuple[_Prepared, asyncio.Future[ChatResult]]]] = [
            [] for _ in range(self.num_replicas)
        ]
        self._wake: list[asyncio.Event] = []
        self._loops: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(self.num_replicas + 1, thread_name_prefix="chat-gen")
        self._warned_fields: set[str] = set()
        self._token_texts: dict[int, str] = {}  # token id -> its text, for log-prob entries

    # ---- requests ------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def stats_snapshot(self) -> dict[str, int]:
        """A copy of the counters (they are bumped from the server's threads)."""
        with self._stats_lock:
            return dict(self.stats)

    def prepare(self, request: ChatRequest) -> _Prepared:
        """Prompt ids and token budget; RequestError for what cannot be served."""
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
        else:
            try:
                enc = self.prompts.encode(
                    request.messages,
                    request.tools,
                    request.chat_template_kwargs,
                    on_noncontiguous=self.settings.on_noncontiguous,
                )
            except NonContiguousHistoryError as err:
                self.count("noncontiguous_rejected")
                raise RequestError(
                    f"{err}. Send the messages exactly as returned (with their token ids), or "
                    "start the server with on_noncontiguous='truncate'.",
                    "messages",
                ) from err
            except ValueError as err:
                raise RequestError(str(err), "messages") from err
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
        if prepared:
            for i, result in zip(where, self._run(prepared, replica=None), strict=True):
                out[i] = result
        return [r for r in out if r is not None]

    async def complete(self, request: ChatRequest) -> ChatResult:
        """HTTP path: queue on a replica, batched with concurrent requests."""
        prepared = self.prepare(request)
        self._ensure_loops()
        replica = self._route(request)
        future: asyncio.Future[ChatResult] = asyncio.get_running_loop().create_future()
        self._pending[replica].append((prepared, future))
        self._load[replica] += 1
        self._wake[replica].set()
        try:
            result = await future
        finally:
            self._load[replica] -= 1
        if request.session_id is None and not _anchor_key(request.messages):
            self._remember(_ids_key(result.prompt_ids + result.generation_ids), replica)
        return result

    # ---- refit ---------------------------------------------------------------------------
    def refit(self, load_weights: Callable[[], None], version: int | None = None) -> None:
        """Run `load_weights` once no backend call is in flight; calls that arrive meanwhile
        wait. Then ``weight_version`` becomes `version` (default: +1)."""
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
            batch = pending[:limit]
            del pending[:limit]
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

    def _run(self, prepared: list[_Prepared], replica: int | None) -> list[ChatResult]:
        """Blocking: one backend call per sampling key, results in input order."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.key, []).append(i)
        results: list[ChatResult | None] = [None] * len(prepared)
        for idx in groups.values():
            rows = [prepared[i] for i in idx]
            for i, result in zip(idx, self._generate(rows, replica), strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def _generate(self, rows: list[_Prepared], replica: int | None) -> list[ChatResult]:
        first = rows[0].request
        width, pad = max(len(r.prompt_ids) for r in rows), _pad_id(self.tokenizer)
        lengths = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
        input_ids = torch.tensor([r.prompt_ids + [pad] * (width - len(r.prompt_ids)) for r in rows])
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
            version = self.weight_version
        try:
            if replica is None:
                out = self.backend.generate(data, greedy=first.greedy, sampling=sampling)
            else:
                out = self.backend.generate_on(
                    replica, data, greedy=first.greedy, sampling=sampling
                )
        finally:
            with self._cv:
                self._in_flight -= 1
                self._cv.notify_all()
        self.count("backend_calls")
        self.count("requests", len(rows))
        lists = {k: out[k].tolist() for k in _OUTPUT_KEYS if k in out}  # once, not per row
        lists["finish_reasons"] = list(out["finish_reasons"])
        return [self._result(r, lists, b, version, replica) for b, r in enumerate(rows)]

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
                          replica=replica)  # fmt: skip

    # ---- HTTP bodies ---------------------------------------------------------------------
    def note_ignored_fields(self, names: Sequence[str]) -> None:
        """Unknown request fields are ignored, counted and logged once per name."""
        for name in names:
            self.count("ignored_request_fields")
            if name not in self._warned_fields:
                self._warned_fields.add(name)
                log.warning("chat completions: ignoring unknown request field %r", name)

    def chat_response(self, request: ChatRequest, result: ChatResult) -> dict[str, Any]:
        training = self.settings.training_mode
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.parsed is not None:
            message["content"] = result.parsed.content
            if result.parsed.tool_calls:
                message["tool_calls"] = result.parsed.tool_calls
        if training:
            message["prompt_token_ids"] = result.prompt_ids
            message["generation_token_ids"] = result.generation_ids
            message["generation_log_probs"] = result.generation_logprobs
        logprobs = None
        if training or request.logprobs:
            logprobs = {"content": self._logprob_entries(request, result)}
        n_prompt, n_gen = len(result.prompt_ids), len(result.generation_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.settings.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_gen,
                "total_tokens": n_prompt + n_gen,
            },
            "weight_version": result.weight_version,
        }

    def _logprob_entries(self, request: ChatRequest, result: ChatResult) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            token = f"token_id:{token_id}" if request.tokens_as_ids else text
            return {"token": token, "logprob": logprob, "bytes": list(text.encode())}

        top = result.top_logprobs or [[] for _ in result.generation_ids]
        return [
            {**entry(tok, lp), "top_logprobs": [entry(i, v) for i, v in alternatives]}
            for tok, lp, alternatives in zip(
                result.generation_ids, result.generation_logprobs, top, strict=True
            )
        ]

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.prompts.decode([token_id], False)
        return text

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize``: the same prompt construction as chat completions (messages),
        or plain text (``prompt``)."""
        self._check_model(body.get("model"))
        if "messages" in body:
            messages = _messages(body.get("messages"))
            try:
                enc = self.prompts.encode(
                    messages,
                    body.get("tools"),
                    body.get("chat_template_kwargs"),
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    on_noncontiguous=self.settings.on_noncontiguous,
                )
            except NonContiguousHistoryError as err:
                self.count("noncontiguous_rejected")
                raise RequestError(str(err), "messages") from err
            except ValueError as err:
                raise RequestError(str(err), "messages") from err
            ids = enc.ids
        elif isinstance(body.get("prompt"), str):
            add = bool(body.get("add_special_tokens", True))
            ids = list(self.tokenizer(body["prompt"], add_special_tokens=add)["input_ids"])
        else:
            raise RequestError("send either messages (a list) or prompt (a string)", "messages")
        return {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids}

    def _check_model(self, model: Any) -> None:
        if model is not None and model != self.settings.model_name:
            raise RequestError(
                f"model {model!r} does not exist; this server serves "
                f"{self.settings.model_name!r} (GET /v1/models)",
                "model",
                404,
            )


_OUTPUT_KEYS = ("output_ids", "logprobs", "generation_lengths", "top_logprob_ids", "top_logprobs")


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


# --------------------------------------------------------------------- request parsing
_SUPPORTED = {
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "n",
    "return_tokens_as_token_ids", "chat_template_kwargs", "stream", "session_id",
    "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
    "parallel_tool_calls", "user", "metadata", "store",
}  # fmt: skip


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", f"messages[{i}]")
    return value


def _number(body: dict[str, Any], name: str, kind: type, lo: float | None = None,
            hi: float | None = None) -> Any:  # fmt: skip
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(f"{name}={value!r} must be a {kind.__name__}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name}={value!r} must be in [{lo}, {hi}]", name)
    return kind(value)


def parse_chat_request(
    body: Any, service: ChatCompletionService, session_id: str | None = None
) -> ChatRequest:
    """A JSON body -> ChatRequest, or RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "model" not in body:
        raise RequestError("model is required", "model")
    service._check_model(body["model"])
    messages = _messages(body.get("messages"))
    service.note_ignored_fields([k for k in body if k not in _SUPPORTED])
    n = _number(body, "n", int, 1)
    if n not in (None, 1):
        raise RequestError(f"n={n} is not supported: send n separate requests", "n")
    if body.get("stream"):
        raise RequestError("stream=true is not supported; omit stream", "stream")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name}={body[name]!r} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported", "logit_bias")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(f"response_format={fmt!r} is not supported", "response_format")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or any(not isinstance(t, dict) or not isinstance(t.get("function"), dict) for t in tools)
    ):
        raise RequestError(
            'tools must be a list of {"type": "function", "function": {...}}', "tools"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            f"tool_choice={choice!r} is not supported; use 'auto' or 'none'", "tool_choice"
        )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    default = service.settings.default_sampling
    temperature = _number(body, "temperature", float, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be > 0", "top_p")
    top_k = _number(body, "top_k", int, -1)
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(
        body, "max_tokens", int, 1
    )
    top_logprobs = _number(body, "top_logprobs", int, 0, 20) or 0
    seed = _number(body, "seed", int)
    training = service.settings.training_mode
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"logprobs={logprobs!r} must be true or false", "logprobs")
    if top_logprobs and not (logprobs or training):
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    greedy = temperature == 0.0
    sampling = SamplingConfig(
        temperature=default.temperature if temperature is None or greedy else temperature,
        top_p=default.top_p if top_p is None else top_p,
        top_k=default.top_k if top_k is None else (None if top_k <= 0 else top_k),
        max_new_tokens=max_tokens or default.max_new_tokens,
        stop_strings=stops,
        seed=seed,
        top_logprobs=top_logprobs,
    )
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        greedy=greedy,
        tools=tools or None,
        parse_tools=bool(tools) and choice != "none",
        logprobs=bool(logprobs),
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        chat_template_kwargs=kwargs,
        session_id=session_id or body.get("session_id"),
        seeded=seed is not None,
    )


# ------------------------------------------------------------------------ HTTP server
def build_app(service: ChatCompletionService, api_key: str | None = None) -> Any:
    """The FastAPI app: routes, the API-key check and OpenAI-shaped errors."""
    app = FastAPI(title="tempering generation server", docs_url=None, redoc_url=None)

    def error(err: RequestError) -> JSONResponse:
        service.count("bad_requests")
        return JSONResponse(err.body(), status_code=err.status)

    def check_key(request: Request) -> None:
        # A plain check in each route: starlette's @app.middleware("http") wraps every request
        # in task groups and memory streams, which cost more than the rest of a request here.
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise RequestError("missing or wrong API key (Authorization: Bearer ...)", status=401)

    async def json_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from err

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": service.weight_version, "stats": service.stats}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            check_key(request)
        except RequestError as err:
            return error(err)
        name = service.settings.model_name
        card = {"id": name, "object": "model", "created": 0, "owned_by": "tempering",
                "max_model_len": service.settings.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            check_key(request)
            body = await json_body(request)
            req = parse_chat_request(body, service, request.headers.get("x-session-id"))
            result = await service.complete(req)
        except RequestError as err:
            return error(err)
        # JSONResponse directly: returning the dict would run FastAPI's jsonable_encoder over
        # every token id and log-prob, the largest cost of a request after the model.
        return JSONResponse(service.chat_response(req, result))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        try:
            check_key(request)
            body = await json_body(request)
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return JSONResponse(service.tokenize(body))
        except RequestError as err:
            return error(err)

    return app


class OpenAIServer:
    """Runs `build_app(service)` under uvicorn in a background thread of this process.

    Binds `host` (default 127.0.0.1) once, on `port` (0: the OS picks a free one, no
    find-then-close race) and reports the port it got. Any non-loopback host needs `api_key`.
    """

    def __init__(
        self,
        service: ChatCompletionService,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"the generation server would listen on {host}, beyond this machine, without an "
                "API key; set one (policy.generation.http_server.api_key_env names the "
                "environment variable that holds it) or bind 127.0.0.1"
            )
        self.service, self.host, self.api_key = service, host, api_key
        self._http = BackgroundServer(build_app(service, api_key), host, port, "openai-server")
        self.port = self._http.port

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as base_url (``.../v1``)."""
        return f"{self.url}/v1"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        self._http.start(timeout_s)
        log.info("generation server listening on %s (model %r)", self.base_url,
                 self.service.settings.model_name)  # fmt: skip
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._http.stop(timeout_s)
        self.service.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
