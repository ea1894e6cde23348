"""The generation server's network defences (openai_server.py, utils/serving.py): https with a
checked certificate pair, the request-body limit, and the access log that never holds a key.

The backend is `ScriptedBackend` (fixed replies): these tests are about the HTTP layer, so a
model would only add time. Certificates are made in the test (tests/tls_certs.py)."""

from __future__ import annotations

import json
import socket
import ssl

import httpx
import openai
import pytest

from tempering.experience.rollouts import HttpTurnClient
from tempering.models.generation.chat_service import (
    ChatCompletionService,
    ChatRequest,
    ServerSettings,
)
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.openai_server import DEFAULT_MAX_REQUEST_BYTES, OpenAIServer
from tempering.models.hf import load_tokenizer
from tests.scripted_backend import ScriptedBackend
from tests.tls_certs import self_signed

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Q: 1+1=? A:"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-arith")


def _service(tokenizer) -> ChatCompletionService:
    settings = ServerSettings(model_name=MODEL, max_model_len=256,
                              default_sampling=SamplingConfig(max_new_tokens=8))  # fmt: skip
    return ChatCompletionService(ScriptedBackend(tokenizer, lambda _: " 2"), tokenizer, settings)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


# ------------------------------------------------------------------------------ TLS
def test_https_with_the_certificate_as_ca_and_nothing_else(tokenizer, cert):
    certfile, keyfile = cert
    with OpenAIServer(_service(tokenizer), ssl_certfile=certfile, ssl_keyfile=keyfile) as srv:
        assert srv.base_url.startswith("https://127.0.0.1:") and srv.ca_file == certfile
        trusting = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0,
                                 http_client=httpx.Client(verify=ssl.create_default_context(
                                     cafile=certfile)))  # fmt: skip
        r = trusting.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
        assert r.choices[0].message.content == " 2"
        # our own HTTP rollout client, trusting what the server says to trust
        (result,) = HttpTurnClient(srv.base_url, MODEL, ca_file=srv.ca_file).complete(
            [ChatRequest(MESSAGES, SamplingConfig(max_new_tokens=8))]
        )
        assert result.message["content"] == " 2"
        # a client that does not trust the certificate (the system store) is refused
        untrusting = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIConnectionError) as info:
            untrusting.models.list()
        assert "CERTIFICATE_VERIFY_FAILED" in repr(info.value.__cause__)
        # plain http to the TLS port: the server hangs up without an answer
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://127.0.0.1:{srv.port}/v1/models", timeout=10)


def test_tls_files_are_checked_before_the_server_starts(tokenizer, cert, tmp_path):
    certfile, keyfile = cert
    other_cert, _ = self_signed(tmp_path / "other")
    key = "policy.generation.http_server"
    cases = [
        ({"ssl_certfile": certfile}, f"{key}.ssl_certfile is set but {key}.ssl_keyfile"),
        ({"ssl_certfile": str(tmp_path / "nope.crt"), "ssl_keyfile": keyfile},
         f"{key}.ssl_certfile='{tmp_path / 'nope.crt'}' does not exist"),
        ({"ssl_certfile": other_cert, "ssl_keyfile": keyfile}, "do not load as a certificate"),
        ({"ssl_certfile": keyfile, "ssl_keyfile": keyfile}, "both must be PEM"),
    ]  # fmt: skip
    unreadable = tmp_path / "unreadable.key"
    unreadable.write_text("x")
    unreadable.chmod(0)
    if not __import__("os").access(unreadable, __import__("os").R_OK):  # not when run as root
        cases.append(({"ssl_certfile": certfile, "ssl_keyfile": str(unreadable)},
                      f"{key}.ssl_keyfile='{unreadable}' is not readable"))  # fmt: skip
    for files, message in cases:
        with pytest.raises(ValueError) as info:
            OpenAIServer(_service(tokenizer), **files)
        assert message in str(info.value), (files, str(info.value))


def test_config_refuses_half_a_tls_pair():
    from pydantic import ValidationError

    from tempering.config.schemas import HttpServerConfig

    with pytest.raises(ValidationError, match="ssl_keyfile is set alone"):
        HttpServerConfig(ssl_keyfile="/k.pem")
    with pytest.raises(ValidationError, match="ssl_ca_file is set without"):
        HttpServerConfig(ssl_ca_file="/ca.pem")


# ------------------------------------------------------------------------ body limit
LIMIT = 4096


def _raw_request(port: int, head: str, chunks: list[bytes], timeout_s: float = 10.0) -> bytes:
    """Send `head` and `chunks` (never finishing the body), return what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)  # a server still waiting for the body: socket.timeout
            if not data:
                break
            answer += data
        return answer


def test_a_body_over_the_limit_gets_413_naming_it(tokenizer):
    assert DEFAULT_MAX_REQUEST_BYTES == 8 * 1024 * 1024
    with OpenAIServer(_service(tokenizer), max_request_bytes=LIMIT) as srv:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * LIMIT}]}
        r = httpx.post(f"{srv.base_url}/chat/completions", json=big, timeout=30)
        assert r.status_code == 413
        error = r.json()["error"]
        assert str(LIMIT) in error["message"] and "max_request_bytes" in error["message"]
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        small = {"model": MODEL, "messages": MESSAGES}
        assert httpx.post(f"{srv.base_url}/chat/completions", json=small).status_code == 200

        # Content-Length says 1 GB, 10 bytes follow: refused from the header, the body unread
        # (a server reading it first would wait for the rest and the socket would time out)
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")  # fmt: skip
        answer = _raw_request(srv.port, head, [b'{"model": '])
        assert answer.startswith(b"HTTP/1.1 413") and b"Content-Length 1000000000" in answer

        # chunked, no length: refused once the chunks counted pass the limit, though the
        # body never ends (the terminating 0-chunk is never sent)
        head = ("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"400\r\n" + b" " * 0x400 + b"\r\n"
        answer = _raw_request(srv.port, head, [chunk] * (LIMIT // 0x400 + 1))
        assert answer.startswith(b"HTTP/1.1 413") and b"more than 4096 bytes" in answer
        assert b"connection: close" in answer.lower()


# ------------------------------------------------------------------------ access log
def test_access_log_has_a_row_per_request_and_never_the_key(tokenizer, tmp_path):
    key = "sk-very-secret-4242"
    log_path = tmp_path / "http_access.jsonl"
    with OpenAIServer(_service(tokenizer), host="0.0.0.0", api_key=key,
                      access_log=str(log_path)) as srv:  # fmt: skip
        base = f"http://127.0.0.1:{srv.port}/v1"
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
        wrong = httpx.get(f"{base}/models", headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["method"], r["route"], r["status"]) for r in rows] == [
        ("POST", "/v1/chat/completions", 200), ("GET", "/v1/models", 401)]  # fmt: skip
    chat, refused = rows
    assert chat["prompt_tokens"] == r.usage.prompt_tokens > 0
    assert chat["completion_tokens"] == r.usage.completion_tokens > 0
    assert refused["prompt_tokens"] is None and refused["completion_tokens"] is None
    assert chat["client"].startswith("127.0.0.1:") and chat["latency_ms"] > 0
    assert chat["time"] <= refused["time"]
    import hashlib

    assert chat["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()[:16]
    assert refused["key_sha256"] == hashlib.sha256(b"wrong").hexdigest()[:16]
    assert log_path.stat().st_mode & 0o077 == 0  # the owner's only
    for path in tmp_path.rglob("*"):  # the key appears nowhere in the log dir
        assert key.encode() not in path.read_bytes(), path


# ------------------------------------------------------------- from the run's config
def test_config_keys_reach_the_server(tokenizer, cert, tmp_path):
    """`start_http_server` (what GRPO calls) passes ssl_*, max_request_bytes and access_log."""
    from tempering.config.schemas import GenerationConfig
    from tempering.models.generation.builders import start_http_server

    certfile, keyfile = cert
    gen = GenerationConfig(http_server={"enabled": True, "ssl_certfile": certfile,
                                        "ssl_keyfile": keyfile, "max_request_bytes": 2048})  # fmt: skip
    server = start_http_server(gen, _service(tokenizer), log_dir=str(tmp_path))
    try:
        assert server.base_url.startswith("https://") and server.ca_file == certfile
        verify = ssl.create_default_context(cafile=certfile)
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
        r = httpx.post(f"{server.base_url}/chat/completions", json=big, verify=verify)
        assert r.status_code == 413 and "2048 bytes" in r.json()["error"]["message"]
    finally:
        server.stop()
    (row,) = [json.loads(x) for x in (tmp_path / "http_access.jsonl").read_text().splitlines()]
    assert row["status"] == 413
    assert gen.http_server.access_log  # the default
    with pytest.raises(ValueError, match="access_log=true needs the run's log directory"):
        start_http_server(gen, _service(tokenizer), log_dir=None)


def test_nemo_gym_launch_mode_refuses_an_https_server():
    """Gym's model server cannot be handed our CA: refused before anything starts."""
    from tempering.config.schemas import NemoGymConfig
    from tempering.environments.nemo_gym_instances import build_nemo_gym_environment

    gym = NemoGymConfig(config_paths=["resources_servers/x.yaml"])
    with pytest.raises(ValueError, match="launch mode.*https://127.0.0.1:1/v1"):
        build_nemo_gym_environment(gym, policy_base_url="https://127.0.0.1:1/v1",
                                   policy_model_name=MODEL, policy_api_key=None, max_seq_len=64,
                                   pad_token_id=0, work_dir="/nonexistent")  # fmt: skip


def test_a_port_in_use_or_a_foreign_host_is_named_with_the_key_and_the_fix(tokenizer):
    from tempering.utils.serving import ListenAddressError

    with socket.socket() as taken:  # another process's listener, in effect
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenAddressError) as err:
            OpenAIServer(_service(tokenizer), port=port)
    assert str(err.value).startswith(
        f"policy.generation.http_server.port={port} on '127.0.0.1': another process listens"
    )
    with pytest.raises(ListenAddressError, match=r"http_server.host='203.0.113.77' \(port 0\): "
                       "cannot listen there"):  # fmt: skip
        OpenAIServer(
            _service(tokenizer), host="203.0.113.77", api_key="k"
        )  # TEST-NET-3: no machine's own
