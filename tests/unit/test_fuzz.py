"""Hostile input, everywhere: property-based tests (hypothesis) over what users and clients send.

- config overrides on the main job's YAML: each ends validated or in a `ConfigError` that
  names the key (or the override text that cannot be parsed);
- dataset rows (SFT prompt/response and messages, preference, HelpSteer3, GRPO problems,
  NeMo Gym JSONL): with ``on_bad_row=error`` a row ends loaded or in a `DataFormatError` naming
  ``file:line``; with ``skip`` every non-blank line is either loaded or counted as skipped;
- HTTP requests to the generation server (/v1/chat/completions, /tokenize): 200, or a 4xx
  with an OpenAI-shaped error naming what is wrong -- never a 500.

Never a traceback from deep inside a library. The example count is bounded
(``TEMPERING_FUZZ_EXAMPLES``, default 150 per property) and derandomised so CI is repeatable;
``TEMPERING_FUZZ_EXAMPLES=2000 TEMPERING_FUZZ_RANDOM=1`` searches harder. The server's backend
is a scripted stand-in (tests/scripted_backend.py): what is under test is the request
handling in front of it, and no offline model reliably produces every reply shape.
"""

from __future__ import annotations

import json
import os
import string
import tempfile
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tempering.config import GRPOMasterConfig, load_config
from tempering.config.loader import ConfigError, schema_paths
from tempering.data.records import DataFormatError
from tempering.errors import UserInputError

REPO = Path(__file__).resolve().parents[2]
MAIN_YAML = REPO / "examples" / "configs" / "grpo_math_tiny.yaml"
FUZZ = settings(
    max_examples=int(os.environ.get("TEMPERING_FUZZ_EXAMPLES", "150")),
    derandomize=not os.environ.get("TEMPERING_FUZZ_RANDOM"),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

# ------------------------------------------------------------------------------ values
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


# ---------------------------------------------------------------------- config overrides
KEYS = schema_paths(GRPOMasterConfig)


def _render(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return repr(value)


overrides = st.one_of(
    st.builds(lambda k, v: f"{k}={_render(v)}", st.sampled_from(KEYS), scalars),
    st.builds(lambda k, v: f"{k}={json.dumps(v)}", st.sampled_from(KEYS), json_values),
    st.builds(
        lambda k, t: f"{k[: len(k) // 2]}{t}={t}",
        st.sampled_from(KEYS),
        st.text(string.ascii_letters + "._~+", max_size=6),
    ),  # fmt: skip
    st.text(max_size=30),  # anything at all
)


@FUZZ
@given(st.lists(overrides, min_size=1, max_size=3))
def test_config_overrides_validate_or_name_the_key(items):
    try:
        load_config(MAIN_YAML, items, schema=GRPOMasterConfig)
    except ConfigError as err:
        text = str(err)
        assert err.problems and all(p.strip() for p in err.problems)
        # each problem names a dotted key, or quotes the override it could not parse
        named = [k.split("=")[0].lstrip("~+") for k in items] + [repr(k) for k in items]
        assert any(n and n in text for n in named) or ":" in err.problems[0], text


# --------------------------------------------------------------------------- data rows
def _loaders():
    from tempering.data import preference_datasets as pd
    from tempering.data import sft_datasets as sd
    from tempering.data.nemo_gym import load_gym_rows
    from tempering.data.problems import load_problem_rows

    def gym(path, on_bad_row):
        return load_gym_rows(path, default_route="agent", on_bad_row=on_bad_row)

    return {
        "sft prompt_response": (lambda p, b: sd.load_prompt_response_jsonl(p, on_bad_row=b),
                                ["prompt", "response"]),
        "sft messages": (lambda p, b: sd.load_messages_jsonl(p, on_bad_row=b), ["messages"]),
        "preference": (lambda p, b: pd.load_preference_jsonl(p, on_bad_row=b),
                       ["prompt", "chosen", "rejected"]),
        "helpsteer3": (pd.load_helpsteer3_jsonl, ["context", "response1", "response2",
                                                  "overall_preference"]),
        "messages_preference": (lambda p, b: pd.load_messages_preference_jsonl(p, on_bad_row=b),
                                ["chosen", "rejected"]),
        "grpo problems": (lambda p, b: load_problem_rows(p, on_bad_row=b),
                          ["problem", "expected_answer"]),
        "nemo gym": (gym, ["responses_create_params", "agent_ref", "expected_answer"]),
    }  # fmt: skip


LOADERS = _loaders()
messages = st.lists(
    st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "system",
                                                                 "tool", "x"]) | json_values,
                                        "content": st.text(max_size=10) | json_values}),
    max_size=3,
)  # fmt: skip


def rows_for(keys: list[str]):
    """Lines of a JSONL file: objects that mostly carry the loader's keys (with values of any
    shape), other JSON values, blank lines and broken JSON."""
    fields = {k: st.text(max_size=10) | messages | json_values for k in keys}
    fields["input"] = messages | json_values  # Gym's responses_create_params.input
    obj = st.fixed_dictionaries({}, optional=fields).map(
        lambda d: (
            {**d, "responses_create_params": {"input": d.pop("input")}}
            if "input" in d and "responses_create_params" in d
            else d
        )
    )
    line = st.one_of(
        obj.map(json.dumps),
        json_values.map(json.dumps),
        st.text(max_size=20).filter(lambda t: "\n" not in t and "\r" not in t),
        st.just(""),
    )
    return st.lists(line, min_size=1, max_size=6)


@pytest.mark.parametrize("name", list(LOADERS))
def test_data_rows_load_or_name_file_and_line(name):
    load, keys = LOADERS[name]

    @FUZZ
    @given(rows_for(keys))
    def check(lines):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "data.jsonl"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            try:
                load(str(path), "error")
            except DataFormatError as err:
                assert f"{path}:" in str(err), str(err)  # names the file (and line)
            except UserInputError as err:  # e.g. no usable rows at all
                assert str(path) in str(err), str(err)
            try:
                loaded = load(str(path), "skip")
            except UserInputError as err:
                assert str(path) in str(err), str(err)
                return
            if hasattr(loaded, "num_skipped"):  # every non-blank line loaded or counted
                blank = sum(not line.strip() for line in lines)
                assert len(loaded.examples) + loaded.num_skipped == len(lines) - blank

    check()


# ------------------------------------------------------------------------ HTTP requests
@pytest.fixture(scope="module")
def server():
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer
    from tempering.models.hf import load_tokenizer
    from tests.scripted_backend import ScriptedBackend

    tokenizer = load_tokenizer("tiny-arith")
    backend = ScriptedBackend(tokenizer, lambda prompt: " 42")
    settings_ = ServerSettings(model_name="policy", max_model_len=64,
                               default_sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    with OpenAIServer(ChatCompletionService(backend, tokenizer, settings_)) as srv:
        yield srv


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values},
    optional={"content": st.text(max_size=30) | json_values, "tool_calls": json_values,
              "name": json_values, "tool_call_id": json_values,
              "prompt_token_ids": st.lists(st.integers(-5, 400), max_size=8) | json_values,
              "generation_token_ids": st.lists(st.integers(-5, 400), max_size=8) | json_values},
)  # fmt: skip
request = st.fixed_dictionaries(
    {},
    optional={"model": st.just("policy") | json_values,
              "messages": st.lists(message, max_size=3) | json_values,
              "temperature": scalars, "top_p": scalars, "top_k": scalars, "max_tokens": scalars,
              "max_completion_tokens": scalars, "n": scalars, "stream": scalars, "seed": scalars,
              "stop": json_values, "logprobs": scalars, "top_logprobs": scalars,
              "tools": json_values, "tool_choice": json_values, "session_id": json_values,
              "response_format": json_values, "user": json_values},
)  # fmt: skip
bodies = st.one_of(
    request.map(lambda r: json.dumps(r, allow_nan=True)),
    json_values.map(json.dumps),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)


def _check_response(r: httpx.Response, body: str) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, body, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text


@FUZZ
@given(bodies)
def test_chat_requests_get_an_answer_or_a_4xx_naming_the_problem(server, body):
    r = httpx.post(f"{server.base_url}/chat/completions", content=body.encode("utf-8", "replace"),
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    _check_response(r, body)


@FUZZ
@given(st.one_of(json_values.map(json.dumps),
                 st.fixed_dictionaries({}, optional={"model": json_values, "prompt": json_values,
                                                     "messages": json_values}).map(json.dumps)))  # fmt: skip
def test_tokenize_requests_get_an_answer_or_a_4xx(server, body):
    root = server.base_url.removesuffix("/v1")
    r = httpx.post(f"{root}/tokenize", content=body.encode(), timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    _check_response(r, body)
