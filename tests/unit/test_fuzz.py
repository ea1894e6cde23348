"""Hostile input, everywhere: property-based tests (hypothesis) over what users and clients send.

- config overrides on the main job's YAML: each ends validated or in a `ConfigError` that
  names the key (or the override text that cannot be parsed);
- dataset rows (SFT prompt/response and messages, preference, HelpSteer3, GRPO problems,
  NeMo Gym JSONL): with ``on_bad_row=error`` a row ends loaded or in a `DataFormatError` naming
  ``file:line``; with ``skip`` every non-blank line is either loaded or counted as skipped;
- HTTP requests to the generation server (/v1/chat/completions, /tokenize): 200, or a 4xx
  with an OpenAI-shaped error naming what is wrong -- never a 500;
- model answers and tool calls to every registered environment (huge numbers, deep nesting,
  unicode, control characters, megabytes): `step` returns a well-formed result within the
  environment's own time limit -- an answer it cannot score is a counted reward of 0 or an
  error observation, never an exception.

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
import time
from pathlib import Path

import httpx
import pytest
import torch
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


# ------------------------------------------------------------- environments and tools
# What a model can write: huge numbers, deep nesting, unicode that is hard to print (RTL,
# zero-width, lone surrogates), control characters, NUL, a megabyte of anything. Every
# environment in the registry is stepped with it (a new one is fuzzed as soon as it is
# registered: it needs no constructor arguments or an entry in ENV_KWARGS), and every tool it
# offers is called with it. Nothing may escape `step`, every result is well-formed, and every
# call returns within the environment's own time limit plus a margin.
HOSTILE = [
    "9**9**9", "1e308**10", "10**64**64", "(1e-300)**-64", "1e308*1e308", "-1e309", "nan",
    "inf", "9" * 5000, "-" + "9" * 5000, "0" * 5000 + "42", "1" + "0" * 4400, "1/0", "0**-1",
    "\\boxed{" + "9" * 5000 + "}", "\\boxed{9^{9^{9^{9}}}}", "\\frac{1}{0}", "\\sqrt{-1}",
    "__import__('os').system('true')", "\\boxed{\\boxed{\\boxed{}}}", "\u202e24\u202c",
    "4\u200b2", "\ufeff42", "\ud800", "4\udfff2", "\U0001f600" * 50, "e\u0301" * 500,
    "\x00", "42\x00", "\x1b[2J\x1b[0;0H", "".join(map(chr, range(32))), "\x7f\x85\u2028",
]  # fmt: skip
MEGABYTE = [u * (2**20 // len(u)) for u in ("9", "(", "[", "{", "\\boxed{", " ", "\x00", "1+",
                                            "\u200b", "\u202e4")]  # fmt: skip
NESTED = [o * d + "1" + c * d for d in (50, 201, 5_000, 100_000)
          for o, c in (("(", ")"), ("[", "]"), ("{", "}"), ("\\frac{", "}{2}"))]  # fmt: skip
CASES = HOSTILE + NESTED + MEGABYTE
SANDBOXED_CASES = HOSTILE[::3] + NESTED[::5] + MEGABYTE[:1]  # a runaway costs a verifier process
# the calculator's final answers go to a MathEnvironment (fuzzed in full); its tools below
FIXED_CASES = {"calculator": HOSTILE[::6]}
hostile_text = st.lists(
    st.sampled_from(HOSTILE)
    | st.builds(
        lambda o, d: o * d,
        st.sampled_from(["(", "[", "{", "\\boxed{", "-", "**9"]),
        st.integers(1, 3_000),
    )  # fmt: skip
    | st.integers(0xD800, 0xDFFF).map(chr)
    | st.text(st.characters(exclude_categories=()), max_size=30),
    min_size=1,
    max_size=4,
).map("".join)

METADATA = {"ground_truth": "42", "prompt": "Q: 40+2=? A:", "target_words": 3}
ENV_KWARGS = {  # constructor arguments; a per-sample time limit where the environment has one
    "math": {"num_workers": 2, "timeout_s": 0.5},
    "calculator": {"num_workers": 1, "timeout_s": 0.5, "max_tool_calls": 3},
    "reward_fn": {"reward_fn": "examples.custom_reward:length_penalty"},
    "reward_model": {"reward_model_path": None, "num_threads": 1, "max_seq_len": 64},  # fixture
}
SANDBOXED = {"math", "calculator"}  # scored in verifier processes: fewer examples
IN_PROCESS_S_PER_SAMPLE = 0.25  # an in-process environment's budget per sample (a megabyte
# answer included; the reward model's forward pass dominates on a loaded 2-core box)
MARGIN_S = 5.0  # a loaded machine
# A verifier process that overran its sample is killed and replaced; the replacement forks
# from the pool's preloaded server, and its start-up is bounded by the pool's own
# startup_timeout_s, not timeout_s. On this shared 2-core box one takes up to ~10 s.
REPLACEMENT_S = 20.0


def _conversation(content, tool_calls=None) -> list[dict]:
    answer = {"role": "assistant", "content": content}
    if tool_calls is not None:
        answer["tool_calls"] = tool_calls
    return [{"role": "user", "content": METADATA["prompt"]}, answer]


def _call_limit_s(name: str, n: int, replaced: float) -> float:
    """The longest `step` on `n` samples may take: the per-sample limit x rounds over the
    workers, plus each replaced worker's start-up, plus a margin."""
    kwargs = ENV_KWARGS.get(name, {})
    if "timeout_s" not in kwargs:
        return n * IN_PROCESS_S_PER_SAMPLE + MARGIN_S
    rounds = -(-n // kwargs["num_workers"])
    return rounds * kwargs["timeout_s"] + replaced * REPLACEMENT_S + MARGIN_S


def _reward_model_folder(root: Path) -> str:
    """An untrained tiny-arith reward model: shape is what matters here, not its scores."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tempering.models.tiny_arith import build_untrained

    base = build_untrained(root / "base", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    return str(root / "rm")


@pytest.fixture(scope="module")
def environments(tmp_path_factory):
    """Every registered environment, built once and warmed up with one plain answer."""
    from tempering.environments.registry import ENVIRONMENT_REGISTRY, create_environment

    made = {}
    try:
        for name in ENVIRONMENT_REGISTRY:
            kwargs = dict(ENV_KWARGS.get(name, {}))
            if name == "reward_model":
                kwargs["reward_model_path"] = _reward_model_folder(tmp_path_factory.mktemp("rm"))
            try:
                made[name] = create_environment(name, **kwargs)
            except TypeError as err:
                pytest.fail(f"environment {name!r} cannot be built for the fuzz ({err}); "
                            "give its constructor arguments in ENV_KWARGS")  # fmt: skip
            made[name].step([_conversation(" 42")], [dict(METADATA)])
        yield made
    finally:
        for env in made.values():
            env.shutdown()


_REPLACED_BEFORE: dict[str, float] = {}


def _step_checked(env, name: str, logs: list, metas: list) -> None:
    """`step` returns within its limit, with one well-formed result per sample."""
    n = len(logs)
    t0 = time.perf_counter()
    ret = env.step(logs, metas)  # anything raised here fails the test: nothing may escape
    elapsed = time.perf_counter() - t0
    _, metrics = env.global_post_process_and_metrics({})  # also resets the counters
    replaced = metrics.get("env/math_workers_replaced", 0.0)
    # a worker replaced at the end of the previous call may still be starting in this one
    limit = _call_limit_s(name, n, replaced + _REPLACED_BEFORE.get(name, 0.0))
    _REPLACED_BEFORE[name] = replaced
    assert elapsed < limit, f"{name}.step on {n} samples took {elapsed:.1f} s > {limit:.1f} s"
    assert isinstance(ret.rewards, torch.Tensor) and ret.rewards.shape == (n,), ret.rewards
    assert torch.isfinite(ret.rewards.float()).all(), f"{name}: non-finite reward {ret.rewards}"
    assert ret.terminateds.dtype == torch.bool and ret.terminateds.shape == (n,)
    for field_ in (ret.observations, ret.metadata, ret.next_stop_strings, ret.answers):
        assert len(field_) == n
    for obs in ret.observations:
        assert isinstance(obs, dict) and isinstance(obs.get("content"), str), obs
        assert isinstance(obs.get("role"), str), obs
    assert all(a is None or isinstance(a, str) for a in ret.answers), ret.answers


def _examples(name: str) -> int:
    return max(2, FUZZ.max_examples // 75) if name in SANDBOXED else FUZZ.max_examples


def _registered() -> list[str]:
    from tempering.environments.registry import ENVIRONMENT_REGISTRY

    return sorted(ENVIRONMENT_REGISTRY)


@pytest.mark.parametrize("name", _registered())
def test_environment_step_survives_hostile_answers(environments, name):
    env = environments[name]
    # the fixed cases in one batch (a sandboxed environment scores them concurrently)...
    cases = FIXED_CASES.get(name, SANDBOXED_CASES if name in SANDBOXED else CASES)
    _step_checked(env, name, [_conversation(c) for c in cases], [dict(METADATA)] * len(cases))
    _step_checked(env, name, [_conversation(None), [{"role": "user", "content": "x"}]],
                  [dict(METADATA)] * 2)  # fmt: skip

    # ...then generated ones, a few per call
    @settings(FUZZ, max_examples=_examples(name))
    @given(st.lists(hostile_text, min_size=1, max_size=3))
    def check(answers):
        _step_checked(
            env, name, [_conversation(a) for a in answers], [dict(METADATA)] * len(answers)
        )

    check()


def _tool_calls(name: str, arguments) -> list:
    return [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    ]


def _tools() -> list[tuple[str, str]]:
    from tempering.environments.registry import ENVIRONMENT_REGISTRY

    return [(env, tool["function"]["name"]) for env, cls in sorted(ENVIRONMENT_REGISTRY.items())
            for tool in cls.tools or []]  # fmt: skip


deep_json = st.integers(1, 200_000).map(lambda d: "[" * d + "]" * d)
tool_arguments = st.one_of(
    hostile_text.map(lambda t: json.dumps({"expression": t})),
    hostile_text,  # not JSON at all
    deep_json,
    json_values.map(json.dumps),
    json_values,  # not even a string
    st.fixed_dictionaries({"expression": json_values}).map(json.dumps),
)
hostile_calls = st.one_of(
    st.builds(lambda name, args: _tool_calls(name, args),
              st.sampled_from([t for _, t in _tools()]) | st.text(max_size=8), tool_arguments),
    json_values,  # tool_calls of any shape at all
    st.lists(json_values | st.fixed_dictionaries({"function": json_values}), max_size=3),
)  # fmt: skip


@pytest.mark.parametrize("env_name,tool", _tools())
def test_every_tool_survives_hostile_calls(environments, env_name, tool):
    env = environments[env_name]
    fixed = [json.dumps({"expression": c}) for c in CASES] + ["[" * 200_000 + "]" * 200_000]
    logs = [_conversation(None, _tool_calls(tool, a)) for a in fixed]
    _step_checked(env, env_name, logs, [dict(METADATA)] * len(logs))

    @settings(FUZZ, max_examples=FUZZ.max_examples)
    @given(st.lists(hostile_calls, min_size=1, max_size=3))
    def check(calls):
        logs = [_conversation(None, c) for c in calls]
        _step_checked(env, env_name, logs, [dict(METADATA)] * len(logs))

    check()


def test_reward_model_clips_megabyte_answers_and_encodes_lone_surrogates(tmp_path):
    """A lone surrogate made the tokenizer raise TypeError out of step; a megabyte answer took
    it seconds per sample. Both are now scored, and counted."""
    from tempering.environments.reward_model import RewardModelEnvironment

    env = RewardModelEnvironment(_reward_model_folder(tmp_path), num_threads=1, max_seq_len=32)
    answers = ["4\ud8002", "9" * 2**20, " 42"]
    t0 = time.perf_counter()
    ret = env.step([_conversation(a) for a in answers], [{}] * 3)
    assert time.perf_counter() - t0 < 3 * IN_PROCESS_S_PER_SAMPLE + MARGIN_S
    assert torch.isfinite(ret.rewards).all() and ret.rewards.shape == (3,)
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics["env/reward_model_unencodable"] == 1
    assert metrics["env/reward_model_clipped"] == 1 and metrics["env/reward_model_errors"] == 0
    # clipping keeps what the model sees: the first max_seq_len tokens are unchanged
    same = env.step([_conversation("9" * 32 * 64)], [{}])
    assert same.rewards.tolist() == pytest.approx(ret.rewards[1:2].tolist())
