"""The HTTP layer of the OpenAI-compatible chat server: routes, request parsing, error shape.

NeMo Gym agents, the multi-turn rollout loop's HTTP path and any OpenAI client talk to the
trainer's generator through it. This module only speaks HTTP and JSON: it parses a body into
a `ChatRequest` (`parse_chat_request`), hands it to the `ChatCompletionService` of
`chat_service.py` (prompt construction, batching, replicas, the refit lock) and shapes the
`ChatResult` into OpenAI's response; a `RequestError` from either becomes OpenAI's error body.
vLLM is an engine the service calls, never a server we patch.

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
- **Security** (docs/security.md): binds 127.0.0.1 unless told otherwise; any other address
  needs an API key (``Authorization: Bearer <key>``, compared in constant time); the port is
  bound once (port 0 = the OS picks) and kept. With ``ssl_certfile``/``ssl_keyfile`` it serves
  https (the pair is checked before start) and ``base_url`` says https; ``ca_file`` is what
  our own clients then trust (default: the certificate itself, i.e. self-signed).
- **Request size**: a body over ``max_request_bytes`` (default 8 MiB) gets 413 naming the
  limit, decided from ``Content-Length`` before reading, or while counting a chunked body's
  chunks -- never after buffering the whole of it; the connection is then closed.
- **Access log** (``access_log``: a JSONL path): one row per request -- time, method, route,
  status, prompt/completion tokens, latency, client address and a sha256 prefix of the
  presented key (`tempering.utils.serving.AccessLog`); never the key.
- **Bad input** gets a 4xx in OpenAI's error shape naming the field; the server keeps serving.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations here
from fastapi.responses import JSONResponse

from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    ChatResult,
    RequestError,
    ServerSettings,
)
from tempering.models.generation.interfaces import SamplingConfig
from tempering.utils.serving import AccessLog, BackgroundServer, check_tls_files, is_loopback

log = logging.getLogger(__name__)
MAX_LOGGED_REFUSALS = 64  # distinct reasons for refusing a request logged in full

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
CONFIG_PREFIX = "policy.generation.http_server"  # where users set what this module is given

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "OpenAIServer",
    "build_app",
    "chat_response",
    "check_model",
    "error_body",
    "parse_chat_request",
    "tokenize_response",
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
    """A JSON body -> ChatRequest, or RequestError naming the field (the first bad one, in the
    order of the steps below)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "model" not in body:
        raise RequestError("model is required", "model")
    check_model(service.settings, body["model"])
    messages = _messages(body.get("messages"))
    service.note_ignored_fields([k for k in body if k not in _SUPPORTED])
    _refuse_unsupported(body)
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
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """OpenAI fields we do not implement: refused unless left at their no-op value."""
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
    service: ChatCompletionService, request: ChatRequest, result: ChatResult
) -> dict[str, Any]:
    """The ``chat.completion`` body of one result (token ids and log-probs in training mode)."""
    training = service.settings.training_mode
    message = result.message
    if not training:
        for key in _TOKEN_ID_KEYS:
            del message[key]
    logprobs = None
    if training or request.logprobs:
        logprobs = {"content": _logprob_entries(service, request, result)}
    n_prompt, n_gen = len(result.prompt_ids), len(result.generation_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": service.settings.model_name,
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


def _logprob_entries(
    service: ChatCompletionService, request: ChatRequest, result: ChatResult
) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = service.token_text(token_id)
        token = f"token_id:{token_id}" if request.tokens_as_ids else text
        return {"token": token, "logprob": logprob, "bytes": list(text.encode())}

    top = result.top_logprobs or [[] for _ in result.generation_ids]
    return [
        {**entry(tok, lp), "top_logprobs": [entry(i, v) for i, v in alternatives]}
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


# ------------------------------------------------------------------------ HTTP server
def build_app(
    service: ChatCompletionService,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> Any:
    """The FastAPI app: routes, the API-key check, the body limit and OpenAI-shaped errors."""
    app = FastAPI(title="tempering generation server", docs_url=None, redoc_url=None)

    refusals_logged: set[str] = set()

    def error(err: RequestError) -> JSONResponse:
        _log_refusal(err, service.count("bad_requests"), refusals_logged)
        # 413: the rest of the body was never read; close rather than drain it.
        headers = {"Connection": "close"} if err.status == 413 else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    expected_auth = f"Bearer {api_key}".encode()

    def check_key(request: Request) -> None:
        # A plain check in each route: starlette's @app.middleware("http") wraps every request
        # in task groups and memory streams, which cost more than the rest of a request here.
        # hmac.compare_digest: the time taken does not tell how much of a guess was right.
        given = request.headers.get("authorization", "").encode()
        if api_key and not hmac.compare_digest(given, expected_auth):
            raise RequestError("missing or wrong API key (Authorization: Bearer ...)", status=401)

    async def json_body(request: Request) -> Any:
        raw = await read_limited_body(request, max_request_bytes)
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
        request.state.usage = (len(result.prompt_ids), len(result.generation_ids))  # access log
        # JSONResponse directly: returning the dict would run FastAPI's jsonable_encoder over
        # every token id and log-prob, the largest cost of a request after the model.
        return JSONResponse(chat_response(service, req, result))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        try:
            check_key(request)
            body = await json_body(request)
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return JSONResponse(tokenize_response(service, body))
        except RequestError as err:
            return error(err)

    return app


def _log_refusal(err: RequestError, count: int, logged: set[str]) -> None:
    """The client gets every refusal's reason; the log gets each distinct reason once (the
    first `MAX_LOGGED_REFUSALS` of them, kept in ``logged``), then every 100th refusal: a
    flood of bad requests cannot fill it. ``count``: refusals so far, this one included."""
    new = err.message not in logged and len(logged) < MAX_LOGGED_REFUSALS
    if new:
        logged.add(err.message)
    if new or count % 100 == 0:
        field = f", field {err.param}" if err.param else ""
        log.warning(
            "generation server: refused request %d (HTTP %d%s): %s",
            count, err.status, field, err.message,
        )  # fmt: skip


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 `RequestError` naming `limit` as soon as it is known to be bigger:
    from ``Content-Length`` before reading anything, else (chunked) while counting chunks."""

    def too_large(size: str) -> RequestError:
        return RequestError(
            f"the request body ({size}) is larger than this server's limit of {limit} bytes "
            f"({CONFIG_PREFIX}.max_request_bytes); send a smaller request",
            status=413,
            code="request_too_large",
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f"Content-Length {declared}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(f"more than {limit} bytes so far")
    return bytes(body)


class OpenAIServer:
    """Runs `build_app(service)` under uvicorn in a background thread of this process.

    Binds `host` (default 127.0.0.1) once, on `port` (0: the OS picks a free one, no
    find-then-close race) and reports the port it got. Any non-loopback host needs `api_key`.
    `ssl_certfile` + `ssl_keyfile`: serve https (checked here, before anything binds);
    `ssl_ca_file`: what clients of ours trust (`ca_file`; default the certificate itself).
    `access_log`: a JSONL file that gets one row per request (see `AccessLog`).
    """

    def __init__(
        self,
        service: ChatCompletionService,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        *,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_ca_file: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        access_log: str | None = None,
    ) -> None:
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"the generation server would listen on {host}, beyond this machine, without an "
                f"API key; set one ({CONFIG_PREFIX}.api_key_env names the "
                "environment variable that holds it) or bind 127.0.0.1"
            )
        names = (f"{CONFIG_PREFIX}.ssl_certfile", f"{CONFIG_PREFIX}.ssl_keyfile")
        tls = check_tls_files(ssl_certfile, ssl_keyfile, names)
        if ssl_ca_file is not None and (tls is None or not Path(ssl_ca_file).is_file()):
            raise ValueError(
                f"{CONFIG_PREFIX}.ssl_ca_file={ssl_ca_file!r} "
                + ("is set without ssl_certfile/ssl_keyfile (no TLS to trust); remove it"
                   if tls is None else "does not exist; point it at the CA's PEM certificate")
            )  # fmt: skip
        if tls is None and not is_loopback(host):
            log.warning("the generation server listens on %s over plain http: the API key and "
                        "every prompt cross the network unencrypted; set %s.ssl_certfile and "
                        "ssl_keyfile (docs/security.md)", host, CONFIG_PREFIX)  # fmt: skip
        self.service, self.host, self.api_key = service, host, api_key
        self.ca_file = (ssl_ca_file or tls.certfile) if tls else None
        app = build_app(service, api_key, max_request_bytes)
        self.access_log = AccessLog(app, access_log) if access_log else None
        self._http = BackgroundServer(
            self.access_log or app, host, port, "openai-server", tls, config_key=CONFIG_PREFIX
        )
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
        if self.access_log is not None:
            self.access_log.close()
        self.service.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
