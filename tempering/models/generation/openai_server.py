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

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(openai_completions.py), ``POST /tokenize``, ``GET /health`` and ``GET /metrics`` (Prometheus,
server_metrics.py). ``stream: true`` answers in server-sent events (openai_streaming.py);
``n`` choices are rows of one backend call. The generation routes are also served under
``/rollouts/<id>/v1/...`` (or take an ``X-Rollout-ID`` header): an external harness's calls,
recorded under that id for the trainer (rollout_capture.py, docs/agentic.md). ``tempering serve MODEL`` runs this server over a
trained folder (tempering/cli.py, docs/guides/serve.md).

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

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations here
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tempering.models.generation import openai_completions as completions
from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    RequestError,
    StreamSink,
)
from tempering.models.generation.openai_protocol import (
    chat_response,
    check_model,
    error_body,
    parse_chat_request,
    tokenize_response,
    usage,
)
from tempering.models.generation.openai_streaming import ChatChunks, event_stream, stream_options
from tempering.models.generation.server_metrics import CONTENT_TYPE_LATEST, ServerMetrics
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
    "require_key",
    "tokenize_response",
]


# ------------------------------------------------------------------------ HTTP server
def build_app(
    service: ChatCompletionService,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> Any:
    """The FastAPI app: routes, the API-key check, the body limit and OpenAI-shaped errors."""
    app = FastAPI(title="tempering generation server", docs_url=None, redoc_url=None)
    metrics = app.state.metrics = ServerMetrics(service)

    refusals_logged: set[str] = set()

    def error(err: RequestError) -> JSONResponse:
        _log_refusal(err, service.count("bad_requests"), refusals_logged)
        # 413: the rest of the body was never read; close rather than drain it.
        headers = {"Connection": "close"} if err.status == 413 else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    check_key = _key_check(api_key)

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
    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models(request: Request) -> Any:
        try:
            check_key(request)
        except RequestError as err:
            return error(err)
        name = service.settings.model_name
        card = {"id": name, "object": "model", "created": 0, "owned_by": "tempering",
                "max_model_len": service.settings.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    http = _Http(service, metrics, check_key, json_body, error)

    # /rollouts/<id>/v1/...: an external harness's base URL names its episode (rollout_capture.py)
    @app.post("/v1/chat/completions")
    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _generation_route(http, request, "chat", parse_chat_request, chat_response,
                                       ChatChunks)  # fmt: skip

    @app.post("/v1/completions")
    @app.post("/rollouts/{rollout_id}/v1/completions")
    async def complete(request: Request) -> Any:
        return await _generation_route(http, request, "completions",
                                      completions.parse_completion_request,
                                      completions.completion_response,
                                      completions.CompletionChunks)  # fmt: skip

    @app.get("/metrics")
    async def prometheus(request: Request) -> Any:
        try:
            check_key(request)
        except RequestError as err:
            return error(err)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

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


def _key_check(api_key: str | None) -> Callable[[Request], None]:
    """The API-key check each route calls (a 401 `RequestError`; no key: none needed)."""
    expected_auth = f"Bearer {api_key}".encode()

    def check_key(request: Request) -> None:
        # A plain check in each route: starlette's @app.middleware("http") wraps every request
        # in task groups and memory streams, which cost more than the rest of a request here.
        # hmac.compare_digest: the time taken does not tell how much of a guess was right.
        given = request.headers.get("authorization", "").encode()
        if api_key and not hmac.compare_digest(given, expected_auth):
            raise RequestError("missing or wrong API key (Authorization: Bearer ...)", status=401)

    return check_key


@dataclass(frozen=True)
class _Http:
    """What the generation routes share: the service, metrics and the request checks."""

    service: ChatCompletionService
    metrics: ServerMetrics
    check_key: Callable[[Request], None]
    json_body: Callable[[Request], Awaitable[Any]]
    error: Callable[[RequestError], JSONResponse]


async def _generation_route(
    http: _Http, request: Request, route: str, parse: Any, respond: Any, chunks: Any
) -> Any:
    """``/v1/chat/completions`` and ``/v1/completions``: parse, then one JSON answer or a
    stream (`parse`/`respond`/`chunks`: the route's request parser, response and chunks)."""
    service, metrics, started = http.service, http.metrics, time.perf_counter()
    try:
        http.check_key(request)
        body = await http.json_body(request)
        req = parse(body, service, request.headers.get("x-session-id"))
        req.rollout_id = request.path_params.get("rollout_id") or request.headers.get(
            "x-rollout-id"
        )  # an external harness's episode: its calls are recorded under it
        options = stream_options(body)
        if options is not None:  # refusals above and in prepare() are 4xx, before any byte
            return _event_response(service, req, options, chunks, metrics, route, started)
        results = await service.complete_choices(req)
    except RequestError as err:
        metrics.answered(route, err.status, started)
        return http.error(err)
    counts = usage(results)
    request.state.usage = counts["prompt_tokens"], counts["completion_tokens"]  # access log
    metrics.observe_usage(results)
    metrics.answered(route, 200, started)
    # JSONResponse directly: returning the dict would run FastAPI's jsonable_encoder over
    # every token id and log-prob, the largest cost of a request after the model.
    return JSONResponse(respond(service, req, results))


def _event_response(
    service: ChatCompletionService, req: ChatRequest, options: Any, chunks: Any,
    metrics: Any, route: str, started: float,
) -> StreamingResponse:  # fmt: skip
    """A streamed answer (openai_streaming.py): the prompt is built first, so a request that
    cannot be served is refused before the stream starts."""
    prepared = service.prepare(req)
    req.stream = StreamSink(asyncio.get_running_loop())
    events = event_stream(service, req, prepared, options, chunks(service, req), metrics,
                          started, route)  # fmt: skip
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


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


def require_key(
    host: str,
    api_key: str | None,
    how: str = f"set one ({CONFIG_PREFIX}.api_key_env names the environment variable that holds it)",
) -> None:
    """ValueError unless `host` is loopback or an API key is set (`how`: where to set it)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"the generation server would listen on {host}, beyond this machine, without an "
            f"API key; {how} or bind 127.0.0.1"
        )


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
        require_key(host, api_key)
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
