"""``POST /v1/completions`` of the OpenAI-compatible server: plain text (or token ids) in, no
chat template. The same service, sampling fields, batching, ``n``, streaming and training
extensions as chat completions (openai_server.py); only the request's prompt and the shape of
a choice differ (``text``; legacy ``logprobs``: ``tokens``, ``token_logprobs``,
``top_logprobs``).

- ``prompt``: a string, a list of token ids, or a list holding one of those (one prompt per
  request: send several requests, or ``n``, for more).
- ``logprobs: k`` (0-20) returns the chosen token's log-prob and the k most likely.
- Refused with a 400 naming the field: ``echo``, ``suffix``, ``best_of`` other than 1.
"""

from __future__ import annotations

from typing import Any

from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    ChatResult,
    RequestError,
)
from tempering.models.generation.openai_protocol import (
    _flag,
    _number,
    _refuse_unsupported,
    _sampling,
    _stop_strings,
    check_model,
    response_body,
    with_logprobs,
    with_token_ids,
)

__all__ = ["CompletionChunks", "completion_response", "parse_completion_request"]

_SUPPORTED = {
    "model", "prompt", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed",
    "logprobs", "n", "stream", "stream_options", "return_tokens_as_token_ids",
    "return_token_ids", "session_id", "frequency_penalty", "presence_penalty", "logit_bias",
    "user", "echo", "suffix", "best_of",
}  # fmt: skip


def _prompt_ids(service: ChatCompletionService, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(service.tokenizer(prompt)["input_ids"])
    vocab = len(service.tokenizer)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
    ):
        return list(prompt)
    raise RequestError(
        "prompt must be a non-empty string, a list of token ids in [0, "
        f"{vocab}), or a list holding one of those (one prompt per request)",
        "prompt",
    )


def parse_completion_request(
    body: Any, service: ChatCompletionService, session_id: str | None = None
) -> ChatRequest:
    """A JSON body -> ChatRequest over the prompt's ids, or RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "model" not in body:
        raise RequestError("model is required", "model")
    check_model(service.settings, body["model"])
    ids = _prompt_ids(service, body.get("prompt"))
    service.note_ignored_fields([k for k in body if k not in _SUPPORTED])
    for name, ok in (("echo", body.get("echo") in (None, False)),
                     ("suffix", body.get("suffix") in (None, "")),
                     ("best_of", body.get("best_of") in (None, 1))):  # fmt: skip
        if not ok:
            raise RequestError(f"{name}={body[name]!r} is not supported; leave it out", name)
    n = _refuse_unsupported(body, service.settings)
    top = _number(body, "logprobs", int, 0, 20)  # legacy: an int, the alternatives wanted
    chat_like = {**body, "logprobs": top is not None, "top_logprobs": top or 0}
    sampling, greedy, logprobs = _sampling(chat_like, _stop_strings(body), service.settings)
    return ChatRequest(
        messages=[], sampling=sampling, greedy=greedy, parse_tools=False, logprobs=logprobs,
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
        session_id=session_id or body.get("session_id"), prompt_ids=ids,
        seeded=sampling.seed is not None, n=n,
        return_token_ids=_flag(body, "return_token_ids"),
    )  # fmt: skip


def _legacy_logprobs(
    service: ChatCompletionService, request: ChatRequest, tokens: list[int],
    logprobs: list[float], top: list[list[tuple[int, float]]] | None,
) -> dict[str, Any]:  # fmt: skip
    def name(token: int) -> str:
        return f"token_id:{token}" if request.tokens_as_ids else service.token_text(token)

    return {
        "tokens": [name(t) for t in tokens],
        "token_logprobs": logprobs,
        "top_logprobs": None if top is None else [{name(i): v for i, v in alt} for alt in top],
    }


def _token_fields(result: ChatResult) -> dict[str, Any]:
    return {"prompt_token_ids": result.prompt_ids,
            "generation_token_ids": result.generation_ids,
            "generation_log_probs": result.generation_logprobs}  # fmt: skip


def completion_response(
    service: ChatCompletionService, request: ChatRequest, results: list[ChatResult]
) -> dict[str, Any]:
    """The ``text_completion`` body of a request's choices."""
    choices = []
    for index, r in enumerate(results):
        logprobs = None
        if with_logprobs(service, request):
            top = r.top_logprobs if request.sampling.top_logprobs else None
            logprobs = _legacy_logprobs(service, request, r.generation_ids,
                                        r.generation_logprobs, top)  # fmt: skip
        choice = {"index": index, "text": r.text, "logprobs": logprobs,
                  "finish_reason": r.finish_reason}  # fmt: skip
        if with_token_ids(service, request):
            choice.update(_token_fields(r))
        choices.append(choice)
    return response_body(service, "cmpl", "text_completion", choices, results)


class CompletionChunks:
    """Streamed ``text_completion`` choices (`openai_streaming.Chunks`)."""

    object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, service: ChatCompletionService, request: ChatRequest) -> None:
        self.service, self.request = service, request
        self.ids, self.logprobs = with_token_ids(service, request), with_logprobs(service, request)

    def first(self, index: int, prompt_ids: list[int]) -> dict[str, Any] | None:
        if not self.ids:
            return None
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None,
                "prompt_token_ids": prompt_ids}  # fmt: skip

    def token(self, index: int, piece: str, token: int, logprob: float,
              alternatives: list[tuple[int, float]] | None) -> dict[str, Any] | None:  # fmt: skip
        if not piece and not self.ids and not self.logprobs:
            return None
        choice: dict[str, Any] = {"index": index, "text": piece, "logprobs": None,
                                  "finish_reason": None}  # fmt: skip
        if self.logprobs:
            top = [alternatives or []] if self.request.sampling.top_logprobs else None
            choice["logprobs"] = _legacy_logprobs(self.service, self.request, [token],
                                                  [logprob], top)  # fmt: skip
        if self.ids:
            choice["generation_token_ids"], choice["generation_log_probs"] = [token], [logprob]
        return choice

    def last(self, index: int, rest: str, result: ChatResult) -> list[dict[str, Any]]:
        return [{"index": index, "text": rest, "logprobs": None,
                 "finish_reason": result.finish_reason}]  # fmt: skip

    def final_text(self, result: ChatResult) -> str | None:
        return result.text
