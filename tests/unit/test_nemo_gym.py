"""NeMo Gym contract tests against our protocol-level stand-in (head server, resources server,
agent, environment server; tempering/environments/nemo_gym_standin.py) and tempering's real
generation server: routing, /run with retries and errors that name the URL, results back in
row order, results -> training data (contiguous ids, masks, rewards, mask_sample), and Gym row
files. The real `nemo-gym` package is exercised in the slow tier
(tests/functional/test_nemo_gym_real.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tempering.data.nemo_gym import load_gym_rows, problem_row
from tempering.data.records import DataFormatError
from tempering.environments.calculator import CALCULATOR_TOOL
from tempering.environments.nemo_gym import (
    GymResultError,
    GymServerError,
    NemoGymClient,
    NemoGymEnvironment,
    episode_from_result,
    gym_error_reason,
)
from tempering.environments.nemo_gym_standin import GymStandIn, StandInProcess
from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.openai_server import OpenAIServer
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.hf import load_causal_lm, load_tokenizer
from tempering.models.tiny_arith import make_problems
from tests.scripted_backend import ScriptedBackend

SAMPLING = SamplingConfig(max_new_tokens=6)
FLAT_TOOL = {"type": "function", "strict": True, **CALCULATOR_TOOL["function"]}  # Responses shape


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-arith")


def _settings(max_model_len: int = 64) -> ServerSettings:
    return ServerSettings(
        model_name="policy", max_model_len=max_model_len, default_sampling=SAMPLING
    )


@pytest.fixture(scope="module")
def tiny_gym(tokenizer):
    """The stand-in Gym over tempering's server with the real tiny-arith torch engine."""
    engine = TorchGenerationEngine(load_causal_lm("tiny-arith"), tokenizer, SAMPLING)
    with OpenAIServer(ChatCompletionService(engine, tokenizer, _settings())) as server:
        with GymStandIn(server.base_url, "policy") as gym:
            yield gym, server


def _client(gym: GymStandIn | StandInProcess, **kw) -> NemoGymClient:
    return NemoGymClient(
        gym.head_url, default_route=gym.ENVIRONMENT_SERVER, retry_backoff_s=0.01, **kw
    )


def test_two_turn_tool_rollout_has_contiguous_ids_reward_and_masks(tokenizer):
    # A scripted model (see tests/scripted_backend.py): a calculator call, then the answer.
    backend = ScriptedBackend(tokenizer, [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "23+45"}}</tool_call>',
        " 68",
    ])  # fmt: skip
    service = ChatCompletionService(backend, tokenizer, _settings(max_model_len=4096))
    with OpenAIServer(service) as server, GymStandIn(server.base_url, "policy") as gym:
        row = {**problem_row("Q: 23+45=? A:", "68"), "agent_ref": {"name": gym.AGENT}}
        row["responses_create_params"]["tools"] = [FLAT_TOOL]
        env = NemoGymEnvironment(_client(gym), max_seq_len=4096)
        batch = env.rollouts([row], sampling=SAMPLING)
        # the agent re-attached turn 1's ids to the assistant message it sent back
        second = gym.chat_requests[-1]["messages"]
        assistant = next(m for m in second if m["role"] == "assistant")
        assert assistant["tool_calls"][0]["function"]["name"] == "calculator"
        first_ids = assistant["prompt_token_ids"] + assistant["generation_token_ids"]
    assert batch["rewards"].tolist() == [1.0] and batch["turns"].tolist() == [2]
    assert batch["sample_mask"].tolist() == [1.0] and not batch["truncated"].any()
    ids = batch["input_ids"][0, : int(batch["input_lengths"][0])].tolist()
    assert ids[: len(first_ids)] == first_ids  # turn 2 continues turn 1's ids exactly
    mask = batch["token_mask"][0]
    # generated: turn 1's tool call and turn 2's answer; not the prompt or the tool result
    n1 = len(assistant["generation_token_ids"])
    start1 = len(assistant["prompt_token_ids"])
    assert mask[start1 : start1 + n1].all() and not mask[:start1].any()
    answer = tokenizer(" 68", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[-len(answer) :] == answer and mask[len(ids) - len(answer) : len(ids)].all()
    assert not mask[start1 + n1 : len(ids) - len(answer)].any()  # the tool response
    assert int(mask.sum()) == n1 + len(answer)
    lps = batch["generation_logprobs"][0][mask.bool()]
    assert torch.allclose(lps[:2], torch.tensor([-0.01, -0.02]))  # the sampler's, carried through
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics[f"env/{gym.AGENT}/reward_mean"] == 1.0
    assert metrics[f"env/{gym.AGENT}/exact_mean"] == 1.0  # reward_components


def test_rows_come_back_in_order_with_the_trainers_sampling(tiny_gym, tokenizer):
    gym, _ = tiny_gym
    gym.jitter_s = 0.05  # /run calls finish out of order
    problems = make_problems(12, seed=3, split="test")
    rows = [problem_row(p["prompt"], p["answer"]) for p in problems]
    rows[0]["responses_create_params"]["max_output_tokens"] = 3
    env = NemoGymEnvironment(_client(gym, concurrency=4), max_seq_len=64)
    try:
        batch = env.rollouts(rows, sampling=SAMPLING, greedy=True, repeat=2)
    finally:
        gym.jitter_s = 0.0
    for i, p in enumerate(problems):
        for j in (2 * i, 2 * i + 1):
            row_ids = batch["input_ids"][j, : int(batch["input_lengths"][j])].tolist()
            prompt = tokenizer(p["prompt"])["input_ids"]
            assert row_ids[: len(prompt)] == prompt, f"sample {j} is not row {i}'s"
            text = tokenizer.decode(row_ids[len(prompt) :], skip_special_tokens=True)
            assert float(batch["rewards"][j]) == float(text.strip() == p["answer"])
    sent = {json.dumps(r["messages"][-1]): r for r in gym.chat_requests[-24:]}
    assert all(r["temperature"] == 0.0 and r["max_tokens"] <= 6 for r in sent.values())
    first = json.dumps({"role": "user", "content": problems[0]["prompt"]})
    assert sent[first]["max_tokens"] == 3  # min(the row's, ours)


def test_the_stand_in_in_its_own_process_scores_rows_and_stops(tiny_gym, tokenizer):
    """The learning runs' stand-in (a child process, as Gym is): the same rewards as in
    process, every request counted across the process boundary, and no process left."""
    _, server = tiny_gym
    problems = make_problems(4, seed=5, split="test")
    rows = [problem_row(p["prompt"], p["answer"]) for p in problems]
    with StandInProcess(server.base_url, "policy") as gym:
        env = NemoGymEnvironment(_client(gym), max_seq_len=64)
        batch = env.rollouts(rows, sampling=SAMPLING, greedy=True)
        assert gym.chat_request_count() == len(rows)
        child = gym._proc
    assert child is not None and child.poll() == 0  # stopped when its stdin closed
    for j, p in enumerate(problems):
        ids = batch["input_ids"][j, : int(batch["input_lengths"][j])].tolist()
        text = tokenizer.decode(ids[len(tokenizer(p["prompt"])["input_ids"]) :],
                                skip_special_tokens=True)  # fmt: skip
        assert float(batch["rewards"][j]) == float(text.strip() == p["answer"])


def test_mask_sample_gives_sample_mask_zero_and_is_counted(tiny_gym):
    gym, _ = tiny_gym
    rows = [problem_row("Q: 11+11=? A:", "22"), problem_row("Q: 12+12=? A:", "24")]
    rows[1]["standin"] = {"mask_sample": True}
    env = NemoGymEnvironment(_client(gym), max_seq_len=64)
    batch = env.rollouts(rows, sampling=SAMPLING, greedy=True)
    assert batch["sample_mask"].tolist() == [1.0, 0.0]
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics["gym/masked_samples"] == 1.0


def test_500s_are_retried_then_fail_with_the_url(tiny_gym):
    gym, _ = tiny_gym
    row = problem_row("Q: 11+11=? A:", "22")
    client = _client(gym, max_retries=3)
    gym.fail_runs = 2
    assert client.run([row])[0]["reward"] in (0.0, 1.0)
    assert client.stats["retries"] == 2
    gym.fail_runs = 10
    try:
        with pytest.raises(
            GymServerError, match=r"POST http://127\.0\.0\.1:\d+/run failed 3 times.*HTTP 500"
        ):
            _client(gym, max_retries=2).run([row])
    finally:
        gym.fail_runs = 0


def test_a_gym_error_is_unwrapped_to_its_reason_and_route():
    """Gym wraps an inner server's error body at every hop (nemo_gym.server_utils: a JSON
    string holding the inner bytes as Python prints them); the client reports the innermost
    reason and the servers it came through, not the first 300 characters of backslashes."""
    reason = "the prompt has 4271 tokens, which leaves no room to generate within 4096"
    body = json.dumps({"error": {"message": reason, "param": "messages"}}).encode()
    for server in ("VLLMModel___policy_model", "SimpleAgent___wa", "SimpleAgent___wa"):
        body = json.dumps(f"Hit an exception in {server} calling an inner server: {body}").encode()
    assert len(body) > 300 and reason not in body.decode()[:300]  # what the old report showed
    assert gym_error_reason(body.decode()) == (
        f"{reason} (through SimpleAgent___wa -> SimpleAgent___wa -> VLLMModel___policy_model)"
    )
    assert gym_error_reason('{"detail": "injected failure"}') == '{"detail": "injected failure"}'
    assert gym_error_reason("<html>Bad gateway</html>") == "<html>Bad gateway</html>"
    assert gym_error_reason(json.dumps("Request was cancelled")) == "Request was cancelled"


def test_an_unreachable_head_server_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nothing listens there
    client = NemoGymClient(f"http://127.0.0.1:{port}", max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(
        GymServerError, match=f"127.0.0.1:{port}/global_config_dict_yaml failed 2 times"
    ):
        client.run([problem_row("Q", "1")])


def test_routing_by_instance_name(tiny_gym):
    gym, _ = tiny_gym
    client = NemoGymClient(gym.head_url)
    env_server = gym.url(gym.ENVIRONMENT_SERVER) + "/run"
    # metrics are named by the agent behind an environment server
    assert client.route({"_ng_environment_server": gym.ENVIRONMENT_SERVER}) == (
        gym.AGENT,
        env_server,
    )
    # an agent is reached through the environment server in front of it (Gym 0.7)
    assert client.route({"agent_ref": {"name": gym.AGENT}}) == (gym.AGENT, env_server)
    assert client.route({"task_source": gym.RESOURCES}) == (gym.AGENT, env_server)
    with pytest.raises(
        GymResultError, match="no agent or environment server 'nope'.*standin_agent"
    ):
        client.route({"agent_ref": {"name": "nope"}})
    with pytest.raises(GymResultError, match="default_route is unset"):
        client.route({})


def _call(prompt, gen, kind="message"):
    return {"type": kind, "prompt_token_ids": prompt, "generation_token_ids": gen,
            "generation_log_probs": [-0.5] * len(gen)}  # fmt: skip


def test_noncontiguous_calls_are_refused_or_truncated_and_counted():
    result = {"reward": 1.0, "response": {"status": "completed", "output": [
        _call([1, 2, 3], [4, 5], "function_call"),
        {"type": "function_call_output", "output": "x"},
        _call([1, 2, 9, 4, 5, 6], [7]),  # the history was rewritten: 3 -> 9
    ]}}  # fmt: skip
    with pytest.raises(
        GymResultError, match="row 7: model call 2's prompt_token_ids do not extend"
    ):
        episode_from_result(result, where="row 7", max_seq_len=64)
    stats: dict = {}
    from collections import Counter

    stats = Counter()
    ep = episode_from_result(result, where="row 7", max_seq_len=64, on_noncontiguous="truncate",
                             stats=stats)  # fmt: skip
    assert ep.ids == [1, 2, 3, 4, 5] and ep.turns == 1 and ep.truncated
    assert stats["noncontiguous_truncated"] == 1
    with pytest.raises(GymResultError, match="no model call with generation_token_ids"):
        episode_from_result(
            {"reward": 0.0, "response": {"output": []}}, where="row 1", max_seq_len=64
        )


@pytest.mark.parametrize(
    "result,message",
    [
        ({"reward": "lots", "response": {"output": [_call([1], [2])]}}, "reward is 'lots'"),
        ({"reward": float("nan"), "response": {"output": [_call([1], [2])]}}, "reward is 'nan'"),
        ({"reward": True, "response": {"output": [_call([1], [2])]}}, "reward is 'True'"),
        (
            {"reward": 1.0, "response": {"output": [_call([1], [2]), "text"]}},
            "output item 2 is a str",
        ),
        ({"reward": 1.0, "response": ["x"]}, "response is not an object"),
    ],
)
def test_a_hostile_gym_result_is_named_not_a_crash(result, message):
    # Each of these raised ValueError/AttributeError from deep inside, or (NaN) poisoned its
    # group's advantages silently.
    with pytest.raises(GymResultError, match=message) as info:
        episode_from_result(result, where="row 3", max_seq_len=64)
    assert str(info.value).startswith("row 3: ")


def test_gym_row_files_fail_with_file_line_and_field(tmp_path):
    good = problem_row("Q: 1+1=? A:", "2") | {"agent_ref": {"name": "a"}}
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"x": 1})]) + "\n")
    with pytest.raises(DataFormatError, match=r"rows\.jsonl:2: not valid JSON"):
        load_gym_rows(path)
    path.write_text(
        json.dumps(good) + "\n" + json.dumps({"responses_create_params": {"input": []}}) + "\n"
    )
    with pytest.raises(
        DataFormatError,
        match=r"rows\.jsonl:2: field 'responses_create_params.input' is an empty list",
    ):
        load_gym_rows(path)
    path.write_text(json.dumps(problem_row("Q", "1")) + "\n")
    with pytest.raises(DataFormatError, match=r"rows\.jsonl:1: no routing field"):
        load_gym_rows(path)
    assert load_gym_rows(path, default_route="env")[0]["expected_answer"] == "1"
