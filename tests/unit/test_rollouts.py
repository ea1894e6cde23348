"""The multi-turn rollout loop (tempering/experience/rollouts.py) on the committed
tiny-arith-chat model and the arithmetic_retry task, in this process: the training layout
(masks, sampler log-probs, rewards, turns), log-prob parity with a teacher-forced forward, the
same rollouts over HTTP, and episodes cut by the sequence budget or the turn limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tempering.environments.arithmetic import ArithmeticRetryEnvironment
from tempering.experience.rollouts import (
    HttpTurnClient,
    InProcessTurnClient,
    RolloutSample,
    run_rollouts,
)
from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.openai_server import OpenAIServer
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.hf import load_causal_lm, load_tokenizer
from tempering.models.tiny_arith import make_problems

SAMPLING = SamplingConfig(max_new_tokens=6)
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-arith-chat")


@pytest.fixture(scope="module")
def model():
    return load_causal_lm("tiny-arith-chat")


@pytest.fixture(scope="module")
def service(model, tokenizer):
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=6, seed=0)
    settings = ServerSettings(model_name="tiny", max_model_len=64, default_sampling=SAMPLING)
    return ChatCompletionService(engine, tokenizer, settings)


def _samples(n: int, tokenizer, with_ids: bool = True) -> list[RolloutSample]:
    out = []
    for p in make_problems(n, seed=1, split="test"):
        ids = tokenizer(p["prompt"])["input_ids"] if with_ids else None
        meta = {"ground_truth": p["answer"], "prompt": p["prompt"]}
        out.append(RolloutSample([{"role": "user", "content": p["prompt"]}], meta, "retry", ids))
    return out


def _envs(max_attempts: int = 3):
    return {"retry": ArithmeticRetryEnvironment(max_attempts=max_attempts, discount=0.5)}


def test_multi_turn_batch_layout_rewards_and_logprob_parity(service, model, tokenizer):
    torch.manual_seed(0)
    samples = _samples(48, tokenizer)
    batch = run_rollouts(
        InProcessTurnClient(service), samples, _envs(), sampling=SAMPLING, max_turns=3,
        max_seq_len=64,
    )  # fmt: skip
    turns, rewards = batch["turns"], batch["rewards"]
    assert (turns >= 1).all() and (turns <= 3).all() and (turns > 1).any()
    assert not batch["truncated"].any()  # the environment ended every episode by itself
    for b, log in enumerate(batch["message_logs"]):
        assistants = [m for m in log if m["role"] == "assistant"]
        assert len(assistants) == int(turns[b])
        # each turn's prompt is the previous turn's prompt + generation, exactly
        for prev, nxt in zip(assistants, assistants[1:], strict=False):
            seen = prev["prompt_token_ids"] + prev["generation_token_ids"]
            assert nxt["prompt_token_ids"][: len(seen)] == seen
        last = assistants[-1]
        row = last["prompt_token_ids"] + last["generation_token_ids"]
        assert batch["input_ids"][b, : len(row)].tolist() == row
        assert int(batch["input_lengths"][b]) == len(row)
        # the mask covers exactly the generated tokens of every turn
        expected = torch.zeros(batch["input_ids"].shape[1])
        for m in assistants:
            start = len(m["prompt_token_ids"])
            expected[start : start + len(m["generation_token_ids"])] = 1
        assert torch.equal(batch["token_mask"][b], expected)
        solved = log[-1]["content"].strip() == samples[b].metadata["ground_truth"]
        assert float(rewards[b]) == (0.5 ** (int(turns[b]) - 1) if solved else 0.0)

    # the sampler's log-probs == a teacher-forced forward of the same model (fp32)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
    forward = torch.zeros_like(batch["generation_logprobs"])
    forward[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    mask = batch["token_mask"].bool()
    diff = (forward - batch["generation_logprobs"]).abs()[mask].max()
    assert diff < 1e-4, f"multi-turn sampler vs forward log-probs differ by {diff:.2e}"


def test_http_rollouts_equal_in_process_ones(service, tokenizer):
    kwargs = {"sampling": SAMPLING, "max_turns": 3, "max_seq_len": 64, "greedy": True}
    local = run_rollouts(InProcessTurnClient(service), _samples(16, tokenizer), _envs(), **kwargs)
    with OpenAIServer(service) as srv:
        client = HttpTurnClient(srv.base_url, "tiny")
        remote = run_rollouts(client, _samples(16, tokenizer, with_ids=False), _envs(), **kwargs)
    for key in ("input_ids", "input_lengths", "token_mask", "rewards", "turns"):
        assert torch.equal(local[key], remote[key]), key
    assert torch.allclose(local["generation_logprobs"], remote["generation_logprobs"], atol=1e-6)


def test_budget_and_turn_limit_end_episodes_as_truncated(service, tokenizer):
    kwargs = {"sampling": SAMPLING, "greedy": True}
    # every episode still running after 1 turn of 3 allowed attempts is cut by the turn limit
    cut = run_rollouts(InProcessTurnClient(service), _samples(32, tokenizer), _envs(3),
                       max_turns=1, max_seq_len=64, **kwargs)  # fmt: skip
    wrong = cut["rewards"] == 0
    assert wrong.any() and torch.equal(cut["truncated"], wrong)
    # a budget of 20 tokens leaves room for one turn (~11 prompt + ~5 answer) and no second
    short = run_rollouts(InProcessTurnClient(service), _samples(32, tokenizer), _envs(3),
                         max_turns=3, max_seq_len=20, **kwargs)  # fmt: skip
    assert (short["input_lengths"] <= 20).all() and (short["turns"] == 1).all()
    assert torch.equal(short["truncated"], short["rewards"] == 0)
    assert not short["prompt_too_long"].any()  # a second turn that did not fit is not that


def test_a_prompt_longer_than_the_budget_is_masked_counted_and_logged(service, tokenizer, caplog):
    samples = _samples(4, tokenizer)
    samples[1] = RolloutSample([{"role": "user", "content": "1+" * 40 + "1"}], {"ground_truth":
                               "41"}, "retry", tokenizer("1+" * 40 + "1")["input_ids"])  # fmt: skip
    with caplog.at_level("WARNING", logger="tempering.experience.rollouts"):
        batch = run_rollouts(InProcessTurnClient(service), samples, _envs(3), max_turns=3,
                             max_seq_len=64, sampling=SAMPLING, greedy=True)  # fmt: skip
    assert batch["prompt_too_long"].tolist() == [0, 1, 0, 0]
    assert batch["sample_mask"].tolist() == [1, 0, 1, 1]  # trains on nothing
    assert batch["truncated"][1] and batch["turns"][1] == 0
    (record,) = [r for r in caplog.records if "got no turn" in r.getMessage()]
    assert "1 of 4 episode(s)" in record.getMessage()
    assert "policy.max_total_sequence_length" in record.getMessage()
    assert "the prompt has 81 tokens" in record.getMessage()


class _Clock:
    """The rollout loop's clock, advanced by the environment instead of by waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _StragglingRetry(ArithmeticRetryEnvironment):
    """Each step of this scorer takes 10 s of the loop's clock: a straggler."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__(max_attempts=3, discount=0.5)
        self.clock = clock

    def step(self, message_logs, metadata):
        self.clock.now += 10.0
        return super().step(message_logs, metadata)


def test_a_straggling_batch_meets_its_deadline(service, tokenizer):
    """async GRPO's group_timeout_s: with a 15 s deadline and 10 s environment steps, turn 2
    (clock 10 s) starts and turn 3 (clock 20 s) does not; the episodes still running there end
    truncated and are marked ``deadline_cut``. Without the deadline they get their third turn."""
    kwargs = {"sampling": SAMPLING, "greedy": True, "max_turns": 3, "max_seq_len": 64}
    free = run_rollouts(InProcessTurnClient(service), _samples(32, tokenizer),
                        {"retry": _StragglingRetry(_Clock())}, **kwargs)  # fmt: skip
    assert "deadline_cut" not in free and (free["turns"] == 3).any()
    clock = _Clock()
    cut = run_rollouts(InProcessTurnClient(service), _samples(32, tokenizer),
                       {"retry": _StragglingRetry(clock)}, deadline_s=15.0, clock=clock,
                       **kwargs)  # fmt: skip
    assert clock.now == 20.0  # two environment steps, no third
    running = free["turns"] == 3  # episodes the environment had not ended after two turns
    assert torch.equal(cut["deadline_cut"].bool(), running)
    assert (cut["turns"] <= 2).all() and cut["truncated"][running].all()
    # what the cut episodes did before the deadline is kept, rewards included
    assert torch.equal(cut["rewards"][~running], free["rewards"][~running])


def test_in_flight_versions_follow_every_generated_token_across_turns(model, tokenizer):
    """With in-flight weight updates each token carries its weight version into the batch:
    a refit between turn 1 and turn 2 (committed from the environment's step here) shows as
    version 0 on turn 1's tokens and 5 on later turns' -- and -1 exactly where no token was
    generated."""
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=6, seed=0)
    engine.in_flight = True
    settings = ServerSettings(model_name="tiny", max_model_len=64, default_sampling=SAMPLING)
    service = ChatCompletionService(engine, tokenizer, settings)
    env = ArithmeticRetryEnvironment(max_attempts=3, discount=0.5)
    step = env.step

    def step_then_refit(*args, **kwargs):
        out = step(*args, **kwargs)
        if engine.weight_version == 0:
            engine.commit_weights(5)  # nothing staged: same weights, a new version
        return out

    env.step = step_then_refit
    batch = run_rollouts(
        InProcessTurnClient(service), _samples(32, tokenizer), {"retry": env}, sampling=SAMPLING,
        max_turns=3, max_seq_len=64,
    )  # fmt: skip
    versions, mask = batch["generation_weight_versions"], batch["token_mask"].bool()
    assert torch.equal(versions >= 0, mask)
    assert (batch["turns"] > 1).any()
    for b, log in enumerate(batch["message_logs"]):
        for turn, m in enumerate(a for a in log if a["role"] == "assistant"):
            start, n = len(m["prompt_token_ids"]), len(m["generation_token_ids"])
            assert versions[b, start : start + n].tolist() == [0 if turn == 0 else 5] * n


def test_in_process_episodes_see_the_offered_tools_as_http_ones_do(model):
    """A calculator problem offers the model its tool. In process, GRPO encoded the bare
    prompt once, so the first turn never showed the tools (the tool prompt, or a template's
    rendering of them); over HTTP the server rendered them. `problem_samples` leaves such a
    prompt to the service, so both see the same tokens."""
    import yaml

    from tempering.data.grpo_problems import Problem
    from tempering.environments.calculator import CalculatorEnvironment
    from tempering.experience.rollouts import problem_samples

    config = yaml.safe_load((REPO / "examples/configs/sft_tiny_arith_calculator.yaml").read_text())
    tok = load_tokenizer("tiny-arith-chat", config["policy"]["tokenizer"]["chat_template"])
    engine = TorchGenerationEngine(model, tok, max_new_tokens=8, seed=0)
    settings = ServerSettings(model_name="tiny", max_model_len=128, default_sampling=SAMPLING)
    service = ChatCompletionService(engine, tok, settings)
    problems = [Problem(p["prompt"], p["answer"], "calculator")
                for p in make_problems(4, seed=1, split="test")]  # fmt: skip
    kwargs = {"sampling": SAMPLING, "max_turns": 2, "max_seq_len": 128, "greedy": True}
    envs = {"calculator": CalculatorEnvironment()}
    local = run_rollouts(InProcessTurnClient(service), problem_samples(problems, tok, True, True),
                         envs, **kwargs)  # fmt: skip
    with OpenAIServer(service) as srv:
        remote = run_rollouts(HttpTurnClient(srv.base_url, "tiny"),
                              problem_samples(problems, tok, True, False), envs, **kwargs)  # fmt: skip
    assert torch.equal(local["input_ids"], remote["input_ids"])
    first = tok.decode(local["input_ids"][0, : local["input_lengths"][0]])
    assert first.startswith(f"[calculator] {problems[0].prompt}"), first
