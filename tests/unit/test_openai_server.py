"""The OpenAI-compatible server over HTTP (tempering/models/generation/openai_server.py, and
the chat service behind it, chat_service.py): the official `openai` client, on-policy token
ids across turns, /tokenize, bad input, batching of concurrent requests, refit while serving,
and the security defaults.

The backend is the real torch engine on the committed tiny-arith model, in this process
(wrapped to count backend calls). One test needs a model that emits tool calls, which no
model we can build here does reliably; there a scripted backend replays fixed token ids and
the test says so."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import openai
import pytest
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.openai_server import OpenAIServer
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.hf import load_causal_lm, load_tokenizer
from tests.scripted_backend import ScriptedBackend

MODEL = "tiny"
MAX_LEN = 64
Q1, Q2 = "Q: 23+45=? A:", "Q: 11+12=? A:"


class CountingBackend:
    """The torch engine, counting calls and the rows each call carried."""

    def __init__(self, engine: TorchGenerationEngine) -> None:
        self.engine = engine
        self.calls: list[int] = []
        self.gate: threading.Event | None = None  # when set, calls wait for it (refit test)
        self.entered = threading.Event()

    def generate(self, data, greedy=False, sampling=None):
        self.calls.append(int(data["input_ids"].shape[0]))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        return self.engine.generate(data, greedy, sampling)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-arith")


@pytest.fixture(scope="module")
def engine(tokenizer):
    torch.manual_seed(0)
    return TorchGenerationEngine(load_causal_lm("tiny-arith"), tokenizer, max_new_tokens=6, seed=0)


def _service(backend, tokenizer, **settings) -> ChatCompletionService:
    args = {"model_name": MODEL, "max_model_len": MAX_LEN,
            "default_sampling": SamplingConfig(max_new_tokens=6), **settings}  # fmt: skip
    return ChatCompletionService(backend, tokenizer, ServerSettings(**args))


@pytest.fixture
def backend(engine):
    return CountingBackend(engine)


@pytest.fixture
def server(backend, tokenizer):
    with OpenAIServer(_service(backend, tokenizer)) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_official_client_chat_completion_carries_ids_and_logprobs(client, server, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": Q1}], temperature=0
    )
    choice = r.choices[0]
    extra = choice.message.model_extra
    assert extra["prompt_token_ids"] == tokenizer(Q1)["input_ids"]
    assert len(extra["generation_token_ids"]) == len(extra["generation_log_probs"]) > 0
    assert (
        choice.finish_reason == "stop"
        and extra["generation_token_ids"][-1] == tokenizer.eos_token_id
    )
    # training mode: log-probs come back although the request did not ask for them
    assert [e.logprob for e in choice.logprobs.content] == extra["generation_log_probs"]
    assert r.model_extra["weight_version"] == 0
    assert choice.message.content == tokenizer.decode(
        extra["generation_token_ids"], skip_special_tokens=True
    )


def test_tokens_as_ids_and_top_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": Q1}],
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    ids = r.choices[0].message.model_extra["generation_token_ids"]
    assert [e.token for e in content] == [f"token_id:{i}" for i in ids]
    for e in content:
        assert len(e.top_logprobs) == 2
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True) and top[0] >= e.logprob - 1e-6
    # an explicit top_logprobs: null must not drop the log-probs
    r = httpx.post(
        str(client.base_url.join("chat/completions")),
        json={"model": MODEL, "messages": [{"role": "user", "content": Q1}], "top_logprobs": None},
    ).json()
    assert len(r["choices"][0]["logprobs"]["content"]) == len(
        r["choices"][0]["message"]["generation_token_ids"]
    )


def test_second_turn_prompt_starts_with_first_prompt_and_generation(client, server, tokenizer):
    history = [{"role": "user", "content": Q1}]
    r1 = client.chat.completions.create(model=MODEL, messages=history, temperature=1.0, seed=3)
    m1 = r1.choices[0].message.model_dump(exclude_none=True)
    first = m1["prompt_token_ids"] + m1["generation_token_ids"]
    history += [m1, {"role": "user", "content": Q2}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, temperature=0)
    ids2 = r2.choices[0].message.model_extra["prompt_token_ids"]
    assert ids2[: len(first)] == first
    assert ids2[len(first) :] == tokenizer(Q2, add_special_tokens=False)["input_ids"]
    # /tokenize builds the same prompt
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": history}).json()
    assert tok["tokens"] == ids2 and tok["count"] == len(ids2)


def test_splice_keeps_ids_that_retokenization_would_change(server, tokenizer):
    """A constructed case: the 'generated' ids spell "=?" as two tokens; encoding the same
    text gives the merged token. The server must continue the ids, not the text."""
    prompt = tokenizer(Q1)["input_ids"]
    generated = [tokenizer.convert_tokens_to_ids(t) for t in ("=", "?")] + [tokenizer.eos_token_id]
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != generated[:-1]  # it would
    history = [
        {"role": "user", "content": Q1},
        {"role": "assistant", "content": text, "prompt_token_ids": prompt,
         "generation_token_ids": generated},
        {"role": "user", "content": Q2},
    ]  # fmt: skip
    for route, key in (("/v1/chat/completions", None), ("/tokenize", "tokens")):
        body = httpx.post(f"{server.url}{route}", json={"model": MODEL, "messages": history}).json()
        ids = body[key] if key else body["choices"][0]["message"]["prompt_token_ids"]
        assert ids[: len(prompt) + len(generated)] == prompt + generated, route


def test_noncontiguous_history_gets_a_400_or_a_counted_truncation(backend, tokenizer):
    p1 = tokenizer(Q1)["input_ids"]
    g1 = tokenizer(" 68", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    bad = [p1[0] + 1, *p1[1:], *g1, *tokenizer(Q2, add_special_tokens=False)["input_ids"]]
    history = [
        {"role": "user", "content": Q1},
        {"role": "assistant", "content": " 68", "prompt_token_ids": p1, "generation_token_ids": g1},
        {"role": "user", "content": Q2},
        {"role": "assistant", "content": " 23", "prompt_token_ids": bad, "generation_token_ids": g1},
        {"role": "user", "content": Q1},
    ]  # fmt: skip
    body = {"model": MODEL, "messages": history, "max_tokens": 2}
    with OpenAIServer(_service(backend, tokenizer)) as srv:
        r = httpx.post(f"{srv.base_url}/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "not a prefix" in r.json()["error"]["message"]
        assert srv.service.stats["noncontiguous_rejected"] == 1
    with OpenAIServer(_service(backend, tokenizer, on_noncontiguous="truncate")) as srv:
        r = httpx.post(f"{srv.base_url}/chat/completions", json=body)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["prompt_token_ids"][: len(p1) + len(g1)] == p1 + g1
        assert srv.service.stats["noncontiguous_truncated"] == 1


BAD_REQUESTS = [
    ("{not json", "not valid JSON", None, 400),
    ({"model": "other", "messages": [{"role": "user", "content": Q1}]}, "does not exist", "model", 404),
    ({"model": MODEL, "messages": []}, "non-empty", "messages", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": Q1 * 20}]}, "max_model_len", "messages", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": Q1}], "n": 0}, "n=0 must be in [1, 256]", "n", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": Q1}], "stream": "yes"}, "stream='yes'", "stream", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": Q1}], "tool_choice": "required"}, "tool_choice", "tool_choice", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": Q1}], "temperature": "hot"}, "temperature", "temperature", 400),
    ({"model": MODEL, "messages": [{"role": "bot", "content": Q1}]}, "role", "messages", 400),
]  # fmt: skip


@pytest.mark.parametrize("body,needle,param,status", BAD_REQUESTS, ids=lambda x: str(x)[:20])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(
    server, body, needle, param, status, caplog
):
    url = f"{server.base_url}/chat/completions"
    with caplog.at_level(logging.WARNING, logger="tempering.models.generation.openai_server"):
        r = httpx.post(url, content=body) if isinstance(body, str) else httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param
    logged = [m for m in caplog.messages if "refused request" in m]  # the operator sees it too
    assert logged and error["message"] in logged[-1] and f"HTTP {status}" in logged[-1]
    assert f"field {param}" in logged[-1] if param else "field" not in logged[-1]
    good = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": Q1}]})
    assert good.status_code == 200


def test_concurrent_requests_share_backend_calls_and_match_in_process_greedy(
    server, backend, engine, tokenizer
):
    problems = [f"Q: {a}+{b}=? A:" for a, b in zip(range(10, 42), range(50, 82), strict=True)]

    async def ask_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": p}],
                       "temperature": 0} for p in problems]  # fmt: skip
            responses = await asyncio.gather(*(c.post("/chat/completions", json=b) for b in bodies))
        return [r.json() for r in responses]

    answers = asyncio.run(ask_all())
    n, calls = len(problems), len(backend.calls)
    print(f"{n} concurrent requests -> {calls} backend calls (rows per call {backend.calls})")
    assert sum(backend.calls) == n and calls <= n // 4

    ids = [tokenizer(p)["input_ids"] for p in problems]
    lengths = torch.tensor([len(x) for x in ids])
    batch = torch.zeros((n, int(lengths.max())), dtype=torch.long)
    for i, x in enumerate(ids):
        batch[i, : len(x)] = torch.tensor(x)
    out = engine.generate(BatchedDataDict(input_ids=batch, input_lengths=lengths), greedy=True)
    for i, a in enumerate(answers):
        L, g = len(ids[i]), int(out["generation_lengths"][i])
        assert (
            a["choices"][0]["message"]["generation_token_ids"]
            == out["output_ids"][i, L : L + g].tolist()
        )


def _held_call(srv, backend, body: dict) -> tuple[threading.Thread, dict]:
    """POST ``body`` from a thread; return once its backend call is in flight (held at the
    backend's gate), with the thread and the dict its response JSON will fill."""
    response: dict = {}
    t = threading.Thread(
        target=lambda: response.update(httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60).json())
    )  # fmt: skip
    t.start()
    assert backend.entered.wait(30)  # a backend call is in flight
    return t, response


def test_refit_waits_for_in_flight_calls_and_versions_the_responses(backend, tokenizer):
    service = _service(backend, tokenizer, batch_wait_ms=0)
    backend.gate = threading.Event()
    order: list[str] = []
    with OpenAIServer(service) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": Q1}]}
        t, first = _held_call(srv, backend, body)
        refit = threading.Thread(
            target=service.refit, args=(lambda: order.append("weights loaded"),), kwargs={"version": 7}
        )  # fmt: skip
        refit.start()
        refit.join(0.3)
        assert refit.is_alive() and order == []  # the refit waits for the in-flight call
        order.append("call finished")
        backend.gate.set()
        t.join(30)
        refit.join(30)
        assert order == ["call finished", "weights loaded"]
        assert first["weight_version"] == 0
        later = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60).json()
        assert later["weight_version"] == 7


def test_refit_without_drain_reaches_calls_in_flight_and_tokens_carry_versions(tokenizer):
    """In-flight weight updates (async GRPO): ``refit(drain=False)`` does not wait for the call
    in flight; the engine loads the weights before its next decode step, and the training-mode
    response carries each token's version (the rollout client reads them back)."""
    from tempering.experience.rollouts import result_from_response

    engine = TorchGenerationEngine(load_causal_lm("tiny-arith"), tokenizer, max_new_tokens=6)
    engine.in_flight = True
    backend = CountingBackend(engine)
    backend.gate = threading.Event()
    service = _service(backend, tokenizer, batch_wait_ms=0)
    new = {k: v + 0.01 for k, v in load_causal_lm("tiny-arith").state_dict().items()}

    def load() -> None:
        engine.stage_weights(new)
        engine.commit_weights(3)

    with OpenAIServer(service) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": Q1}]}
        t, first = _held_call(srv, backend, body)
        service.refit(load, version=3, drain=False)  # returns with the call still held
        assert t.is_alive() and service.weight_version == 3
        backend.gate.set()
        t.join(30)
    message = first["choices"][0]["message"]
    n = len(message["generation_token_ids"])
    assert n > 0 and message["generation_weight_versions"] == [3] * n
    assert first["weight_version"] == 3
    assert result_from_response(first).generation_weight_versions == [3] * n


class TwoReplicas:
    """Two data-parallel replicas of the same engine, recording which served each row."""

    num_replicas = 2

    def __init__(self, engine: TorchGenerationEngine) -> None:
        self.engine = engine
        self.rows: list[tuple[int, tuple[int, ...]]] = []  # (replica, prompt ids)

    def generate_on(self, replica, data, greedy=False, sampling=None):
        for b in range(data["input_ids"].shape[0]):
            ids = data["input_ids"][b, : int(data["input_lengths"][b])].tolist()
            self.rows.append((replica, tuple(ids)))
        return self.engine.generate(data, greedy, sampling)

    def generate(self, data, greedy=False, sampling=None):
        return self.generate_on(0, data, greedy, sampling)


def test_conversations_stick_to_a_replica_and_new_ones_spread(engine, tokenizer):
    replicas = TwoReplicas(engine)
    problems = [f"Q: {a}+{a}=? A:" for a in range(10, 26)]

    async def conversation(client, prompt, session):
        headers = {"X-Session-ID": session} if session else {}
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            body = {"model": MODEL, "messages": messages, "max_tokens": 4}
            r = (await client.post("/chat/completions", json=body, headers=headers)).json()
            messages += [r["choices"][0]["message"], {"role": "user", "content": prompt}]
        return messages

    async def run_all():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            sessions = [f"s{i}" if i % 2 else None for i in range(len(problems))]
            return await asyncio.gather(
                *(conversation(client, p, s) for p, s in zip(problems, sessions, strict=True))
            )

    with OpenAIServer(_service(replicas, tokenizer)) as srv:
        logs = asyncio.run(run_all())
    served = dict((ids, r) for r, ids in replicas.rows)
    used = set()
    for log in logs:  # with or without a session id: both turns on one replica
        first, second = (m for m in log if m["role"] == "assistant")
        r1 = served[tuple(first["prompt_token_ids"])]
        assert served[tuple(second["prompt_token_ids"])] == r1
        used.add(r1)
    assert used == {0, 1}  # new conversations went to both replicas


def test_a_service_outlives_its_server(backend, tokenizer):
    service = _service(backend, tokenizer)
    body = {"model": MODEL, "messages": [{"role": "user", "content": Q1}], "max_tokens": 2}
    for _ in range(2):  # the second server gets fresh batching loops on its own event loop
        with OpenAIServer(service) as srv:
            r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=30)
            assert r.status_code == 200


def test_beyond_loopback_a_key_is_required_and_checked(backend, tokenizer, monkeypatch):
    import hmac

    from tempering.models.generation import openai_server

    compared = []  # the key is compared in constant time (hmac.compare_digest), never with !=
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(openai_server.hmac, "compare_digest", spy)
    with pytest.raises(ValueError, match="without an API key"):
        OpenAIServer(_service(backend, tokenizer), host="0.0.0.0")
    with OpenAIServer(_service(backend, tokenizer), host="0.0.0.0", api_key="s3cret") as srv:
        assert srv.port > 0  # port 0 -> a port the OS picked, bound once
        url = f"http://127.0.0.1:{srv.port}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert compared == [b"", b"Bearer wrong", b"Bearer s3cret"]


def test_tool_call_round_trip_with_the_official_client(tokenizer):
    tool = {"type": "function", "function": {"name": "calculator", "description": "adds",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
    backend = ScriptedBackend(tokenizer, [
        'Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "23+45"}}</tool_call>',
        " 68",
    ])  # fmt: skip
    with OpenAIServer(_service(backend, tokenizer, max_model_len=4096)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": Q1}]
        r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool])
        choice = r1.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "calculator" and '"23+45"' in call.function.arguments
        assert choice.message.content == "Let me add."
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "68"},
        ]
        r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool])
        first = choice.message.model_extra
        ids2 = r2.choices[0].message.model_extra["prompt_token_ids"]
        spliced = first["prompt_token_ids"] + first["generation_token_ids"]
        assert ids2[: len(spliced)] == spliced  # the tool call's own ids, not a re-rendering
        assert "<tool_response>\n68\n</tool_response>" in tokenizer.decode(ids2[len(spliced) :])
        assert r2.choices[0].message.content == " 68" and r2.choices[0].finish_reason == "stop"
