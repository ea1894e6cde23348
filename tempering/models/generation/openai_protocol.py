"""The OpenAI wire format of the generation server, without HTTP: request bodies parsed into
`ChatRequest`s (a `RequestError` naming the first bad field) and results shaped into OpenAI's
responses and error body. `openai_server.py` (routes), `openai_streaming.py` (SSE chunks) and
`openai_completions.py` (``/v1/completions``) use it; see openai_server.py for the contract.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    ChatResult,
    RequestError,
    ServerSettings,
)
from tempering.models.generation.interfaces import SamplingConfig

__all__ = [
    "chat_response",
    "check_model",
    "error_body",
    "logprob_entries",
    "logprob_entry",
    "parse_chat_request",
    "tokenize_response",
    "usage",
    "with_logprobs",
    "with_token_ids",
]


def error_body(err: RequestError) -> dict[str, Any]:
    """OpenAI's error shape for a refused request."""
    kind = "not_found_error" if err.status == 404 else "invalid_request_error"
    if err.status == 401:
        kind = "authentication_error"
    error = {"message": err.message, "type": kind, "param": err.param, "code": err.code}
    return {"error": error}


# --------------------------------------------------------------------- request parsing
_SUPPORTED = {
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "n",
    "return_tokens_as_token_ids", "chat_template_kwargs", "stream", "session_id",
    "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
    "parallel_tool_calls", "user", "metadata", "store", "stream_options", "return_token_ids",
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
    """A JSON body -> ChatRequest, or RequestError naming the field (the first bad one, in the
    order of the steps below)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "model" not in body:
        raise RequestError("model is required", "model")
    check_model(service.settings, body["model"])
    messages = _messages(body.get("messages"))
    service.note_ignored_fields([k for k in body if k not in _SUPPORTED])
    n = _refuse_unsupported(body, service.settings)
    tools, tool_choice = _tools(body)
    stops = _stop_strings(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    sampling, greedy, logprobs = _sampling(body, stops, service.settings)
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        greedy=greedy,
        tools=tools or None,
        parse_tools=bool(tools) and tool_choice != "none",
        logprobs=logprobs,
        tokens_as_ids=bool(body.get("return_tokens_as_token_ids")),
        chat_template_kwargs=kwargs,
        session_id=session_id or body.get("session_id"),
        seeded=sampling.seed is not None,
        n=n,
        return_token_ids=_flag(body, "return_token_ids"),
    )


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name}={value!r} must be true or false", name)
    return bool(value)


def _refuse_unsupported(body: dict[str, Any], settings: ServerSettings) -> int:
    """OpenAI fields we do not implement: refused unless left at their no-op value. Returns
    ``n`` (choices per request: at most ``max_batch_size``, the rows of one backend call)."""
    n = _number(body, "n", int, 1, settings.max_batch_size) or 1
    _flag(body, "stream")  # stream and stream_options: openai_streaming.stream_options
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"{name}={body[name]!r} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported", "logit_bias")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(f"response_format={fmt!r} is not supported", "response_format")
    return n


def _tools(body: dict[str, Any]) -> tuple[Any, Any]:
    """``tools`` (function tools only) and ``tool_choice`` ("auto" or "none")."""
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
    return tools, choice


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    return stops


def _sampling(
    body: dict[str, Any], stops: list[str], settings: ServerSettings
) -> tuple[SamplingConfig, bool, bool]:
    """The request's SamplingConfig (the server's defaults for fields it leaves out), whether
    it is greedy (temperature 0), and whether it asks for log-probs."""
    default = settings.default_sampling
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
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"logprobs={logprobs!r} must be true or false", "logprobs")
    if top_logprobs and not (logprobs or settings.training_mode):
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
    return sampling, greedy, bool(logprobs)


def check_model(settings: ServerSettings, model: Any) -> None:
    """A 404 for a model name this server does not serve (None: the field was left out)."""
    if model is not None and model != settings.model_name:
        raise RequestError(
            f"model {model!r} does not exist; this server serves "
            f"{settings.model_name!r} (GET /v1/models)",
            "model",
            404,
        )


# ---------------------------------------------------------------------- responses
_TOKEN_ID_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def chat_response(
    service: ChatCompletionService, request: ChatRequest, results: list[ChatResult]
) -> dict[str, Any]:
    """The ``chat.completion`` body of a request's choices (token ids and log-probs in
    training mode, or when asked: ``return_token_ids``, ``logprobs``)."""
    choices = []
    for index, result in enumerate(results):
        message = result.message
        if not with_token_ids(service, request):
            for key in _TOKEN_ID_KEYS:
                del message[key]
        logprobs = None
        if with_logprobs(service, request):
            logprobs = {"content": logprob_entries(service, request, result)}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": result.finish_reason})  # fmt: skip
    return response_body(service, "chatcmpl", "chat.completion", choices, results)


def response_body(
    service: ChatCompletionService, id_prefix: str, kind: str, choices: list, results: list
) -> dict[str, Any]:
    """A whole (non-streamed) response of `kind` ("chat.completion", "text_completion"):
    OpenAI's envelope, usage, and the oldest weight version its choices were sampled under."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": service.settings.model_name,
        "choices": choices,
        "usage": usage(results),
        "weight_version": min(r.weight_version for r in results),
    }


def usage(results: list[ChatResult]) -> dict[str, int]:
    """OpenAI's usage of a request: its prompt once, every choice's generated tokens."""
    n_prompt, n_gen = len(results[0].prompt_ids), sum(len(r.generation_ids) for r in results)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
            "total_tokens": n_prompt + n_gen}  # fmt: skip


def with_token_ids(service: ChatCompletionService, request: ChatRequest) -> bool:
    return service.settings.training_mode or request.return_token_ids


def with_logprobs(service: ChatCompletionService, request: ChatRequest) -> bool:
    return service.settings.training_mode or request.logprobs


def logprob_entry(
    service: ChatCompletionService, request: ChatRequest, token_id: int, logprob: float,
    alternatives: list[tuple[int, float]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One token's entry of ``logprobs.content`` (with its ``top_logprobs`` when given)."""
    text = service.token_text(token_id)
    token = f"token_id:{token_id}" if request.tokens_as_ids else text
    entry: dict[str, Any] = {"token": token, "logprob": logprob, "bytes": list(text.encode())}
    if alternatives is not None:
        entry["top_logprobs"] = [logprob_entry(service, request, i, v) for i, v in alternatives]
    return entry


def logprob_entries(
    service: ChatCompletionService, request: ChatRequest, result: ChatResult
) -> list[dict[str, Any]]:
    top = result.top_logprobs or [[] for _ in result.generation_ids]
    return [
        logprob_entry(service, request, tok, lp, alternatives)
        for tok, lp, alternatives in zip(
            result.generation_ids, result.generation_logprobs, top, strict=True
        )
    ]


def tokenize_response(service: ChatCompletionService, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /tokenize``: the same prompt construction as chat completions (messages),
    or plain text (``prompt``)."""
    check_model(service.settings, body.get("model"))
    if "messages" in body:
        messages = _messages(body.get("messages"))
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
        ids = service.encode(messages, tools, kwargs, add_generation_prompt).ids
    elif isinstance(body.get("prompt"), str):
        add = bool(body.get("add_special_tokens", True))
        ids = list(service.tokenizer(body["prompt"], add_special_tokens=add)["input_ids"])
    else:
        raise RequestError("send either messages (a list) or prompt (a string)", "messages")
    return {"count": len(ids), "max_model_len": service.settings.max_model_len, "tokens": ids}
