"""Environments: math-verify scoring, runaway-verification timeouts, arithmetic exact match,
reward functions by import path, and routing by task name (plain classes, then one Ray test)."""

from __future__ import annotations

import importlib
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tempering.environments.actors import actor_class, to_wire
from tempering.environments.arithmetic import ArithmeticEnvironment, first_integer
from tempering.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from tempering.environments.math import MathEnvironment, math_verify_score
from tempering.environments.registry import (
    ENVIRONMENT_REGISTRY,
    create_environment,
    get_environment_class,
    register_environment,
    route_step,
)
from tempering.environments.reward_fn import RewardFunctionEnvironment, load_reward_fn

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0


# The verifier workers import the verify function by reference. Defining it in a tiny module
# (instead of this test file) keeps each worker from importing pytest and torch.
FAULTY_VERIFY_SOURCE = """
import os, time
from tempering.environments.math import math_verify_score

def faulty_verify(response, ground_truth):
    # math-verify, except: HANG loops forever, CRASH raises, DIE kills the worker process
    if "HANG" in response:
        while True:
            time.sleep(0.05)
    if "CRASH" in response:
        raise ValueError("verifier bug")
    if "DIE" in response:
        os._exit(3)
    if response.startswith("HOSTILE "):  # what eval'd model text could try, run as-is
        exec(response.removeprefix("HOSTILE "))
    if "BURN" in response:  # until this process has used 2.45 s of CPU
        while time.process_time() < 2.45:
            pass
    return math_verify_score(response, ground_truth)
"""


def log(answer: str, prompt: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def math_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify_mod")
    (folder / "tempering_test_faulty_verify.py").write_text(FAULTY_VERIFY_SOURCE)
    sys.path.insert(0, str(folder))
    module = importlib.import_module("tempering_test_faulty_verify")
    # these tests make the verifier fail on purpose: no error-rate stop here
    env = MathEnvironment(
        num_workers=2, timeout_s=TIMEOUT_S, verify_fn=module.faulty_verify, max_error_rate=1.0
    )
    yield env
    env.shutdown()
    sys.path.remove(str(folder))


def test_math_verify_score_equivalent_forms():
    assert math_verify_score("so \\boxed{0.5}", "1/2")[0] == 1.0
    assert math_verify_score("\\boxed{\\frac{1}{2}}", "0.5")[0] == 1.0
    assert math_verify_score("The answer is $x+1$", "1+x")[0] == 1.0
    assert math_verify_score("the answer is \\boxed{3}", "4") == (0.0, "3")
    assert math_verify_score("I do not know", "2") == (0.0, None)


def test_math_verify_score_wants_a_value_not_the_problem_restated():
    """math-verify evaluates the expression it extracts: "the final answer is 4 - 5 + 3 - 4 + 9
    = 4" read as the restated problem (7) and scored 1 -- what a GRPO run on chain sums learned
    to write. A computation left undone counts by the value the response gives it, or not at
    all; values, fractions and symbols stay answers."""
    hack = "The final answer to this arithmetic problem is 4 - 5 + 3 - 4 + 9 = 4."
    assert math_verify_score(hack, "7") == (0.0, "4")  # the stated result, which is wrong
    assert math_verify_score(hack.replace("= 4", "= 7"), "7") == (1.0, "7")
    assert math_verify_score("The final answer is 4 - 5 + 3 = 2 + 0 = 2", "2") == (1.0, "2")
    for undone in ("The final answer is 4 - 5 + 3 - 4 + 9.", "x = 4 - 5 + 3 - 4 + 9"):
        assert math_verify_score(undone, "7") == (0.0, None), undone  # no value: no answer
    assert math_verify_score("\\boxed{6 \\times 7}", "42") == (0.0, None)
    assert math_verify_score("\\boxed{3/4}", "0.75")[0] == 1.0  # a fraction is a value
    assert math_verify_score("the answer is -100", "-100")[0] == 1.0
    assert math_verify_score("7353 - 2157 - 4908 - 5623 + 5235 = -100", "-100")[0] == 1.0


def test_math_env_scores_right_wrong_unparseable(math_env):
    math_env.global_post_process_and_metrics({})  # reset counters
    cases = [
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("So the answer is \\boxed{3}.", "4", 0.0),
        ("I do not know", "2", 0.0),
        ("#### 72", "72", 1.0),
    ]
    ret = math_env.step([log(a) for a, _, _ in cases], [{"ground_truth": g} for _, g, _ in cases])
    assert isinstance(ret, EnvironmentReturn)
    assert ret.rewards.tolist() == [c[2] for c in cases]
    assert ret.terminateds.tolist() == [True] * 5
    assert ret.answers[2] == "3" and ret.answers[3] is None
    assert ret.observations[0] == {"role": "environment", "content": "correct"}
    _, metrics = math_env.global_post_process_and_metrics({"rewards": ret.rewards})
    assert metrics["env/math_samples"] == 5
    assert metrics["env/math_parse_failures"] == 1
    assert metrics["env/math_timeouts"] == 0
    assert metrics["env/math_accuracy"] == pytest.approx(0.6)
    # counters were reset by the report
    assert math_env.global_post_process_and_metrics({})[1]["env/math_samples"] == 0


def test_math_env_cuts_runaway_verification_and_recovers(math_env):
    math_env.global_post_process_and_metrics({})
    logs = [log("HANG"), log("\\boxed{2}"), log("CRASH"), log("DIE"), log("\\boxed{7}")]
    meta = [{"ground_truth": "2"}] * 4 + [{"ground_truth": "7"}]
    start = time.monotonic()
    ret = math_env.step(logs, meta)
    elapsed = time.monotonic() - start
    assert ret.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    # bounded by the timeout plus a fork from the preloaded fork server, not 'forever'
    assert elapsed < TIMEOUT_S + 10
    _, metrics = math_env.global_post_process_and_metrics({})
    assert metrics["env/math_timeouts"] == 1
    assert metrics["env/math_errors"] == 2  # the exception and the dead process
    assert metrics["env/math_workers_replaced"] == 2  # the hung worker and the dead one
    # the replaced workers serve the next step normally
    ret = math_env.step([log("\\boxed{1/3}"), log("HANG")], [{"ground_truth": "1/3"}] * 2)
    assert ret.rewards.tolist() == [1.0, 0.0]
    assert math_env.global_post_process_and_metrics({})[1]["env/math_timeouts"] == 1


def test_a_verifier_failing_on_most_answers_stops_the_run(math_env):
    """A verifier that raises on every answer scored every sample 0 and the run trained on
    (issue 27): above env.math.max_error_rate of a step's answers, the step raises, naming
    the first failing answer; at or below it, the errors are counted as before."""
    from tempering.environments.math import VerifierErrorRateExceeded

    math_env.max_error_rate = 0.25
    try:
        ok = math_env.step([log("CRASH")] + [log("\\boxed{2}")] * 3, [{"ground_truth": "2"}] * 4)
        assert ok.rewards.tolist() == [0.0, 1.0, 1.0, 1.0]  # 1 of 4 = the limit: counted
        with pytest.raises(VerifierErrorRateExceeded, match="max_error_rate=0.25") as err:
            math_env.step([log("\\boxed{2}"), log("CRASH 1"), log("CRASH 2")],
                          [{"ground_truth": "2"}] * 3)  # fmt: skip
        assert "2 of 3 answers" in str(err.value) and "'CRASH 1'" in str(err.value)
        assert "verifier bug" in str(err.value)
    finally:
        math_env.max_error_rate = 1.0
        math_env.global_post_process_and_metrics({})


HOSTILE = {
    "network": "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
    "shell": "import os; os.system('touch {marker}')",
    "subprocess": "import subprocess; subprocess.run(['touch', '{marker}'])",
    "file write": "open('{marker}', 'w').write('x')",
    "native code": "import ctypes; ctypes.CDLL('libc.so.6').system(b'touch {marker}')",
    "raise its limits": "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    "memory": "x = bytearray(2 * 2**30)",
}


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_verifier_sandbox_refuses_what_model_text_could_run(math_env, attack, tmp_path):
    """The verifier processes run model-written text through sympy's eval: whatever that text
    tries beyond arithmetic fails inside the sandbox (an error outcome, counted), nothing
    happens outside it, and the worker goes on scoring."""
    marker = tmp_path / "pwned"
    code = HOSTILE[attack].format(marker=marker)
    out = math_env.step([log(f"HOSTILE {code}"), log("\\boxed{4}")], [{"ground_truth": "4"}] * 2)
    assert out.answers[0] is None and float(out.rewards[0]) == 0.0
    assert not marker.exists()
    assert float(out.rewards[1]) == 1.0  # the next answer is scored as usual
    metrics = math_env.global_post_process_and_metrics({})[1]
    assert metrics["env/math_errors"] == 1
    # each attempt is refused once and reported; the memory cap is the kernel's, not a refusal
    assert metrics["env/math_sandbox_refusals"] == (0 if attack == "memory" else 1)
    assert metrics["env/math_protocol_errors"] == 0


def test_model_text_reaching_sympy_eval_runs_nothing(math_env, tmp_path):
    marker = tmp_path / "pwned"
    answer = f"\\boxed{{__import__('os').system('touch {marker}')}}"
    out = math_env.step([log(answer)], [{"ground_truth": "0"}])
    assert float(out.rewards[0]) == 0.0 and not marker.exists()
    math_env.global_post_process_and_metrics({})


def test_verifier_retires_before_its_cpu_budget_runs_out(math_env):
    module = importlib.import_module("tempering_test_faulty_verify")  # math_env put it on the path
    env = MathEnvironment(
        num_workers=1, timeout_s=10, verify_fn=module.faulty_verify, cpu_limit_s=3
    )
    try:
        out = env.step([log("BURN \\boxed{4}"), log("\\boxed{4}")], [{"ground_truth": "4"}] * 2)
        # the burning sample still counts (past 80% of 3 s; the kill at 3 s leaves room for load)
        assert out.rewards.tolist() == [1.0, 1.0]
        assert env._pool.num_retired == 1
        assert env.global_post_process_and_metrics({})[1]["env/math_workers_replaced"] == 1
    finally:
        env.shutdown()


def test_math_env_requires_ground_truth(math_env):
    with pytest.raises(KeyError, match="ground_truth"):
        math_env.step([log("1")], [{"answer": "1"}])


def test_arithmetic_env_first_integer():
    assert first_integer("  42 because") == 42
    assert first_integer("-7") == -7
    assert first_integer("the answer is 42") is None
    env = ArithmeticEnvironment()
    answers = [" 12", "12\n+3", "13", "answer: 12", "", "120"]
    ret = env.step(
        [log(a) for a in answers], [{"ground_truth": 12}] * 5 + [{"ground_truth": "120"}]
    )
    assert ret.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert ret.answers == ["12", "12", "13", None, None, "120"]
    _, metrics = env.global_post_process_and_metrics({"rewards": ret.rewards})
    assert metrics["env/arithmetic_no_integer"] == 2
    assert metrics["env/arithmetic_accuracy"] == pytest.approx(0.5)


def test_arithmetic_env_survives_an_integer_python_will_not_convert():
    """A 5000-digit answer raised ValueError (Python's 4300-digit limit) out of step."""
    from tempering.environments.arithmetic import ArithmeticRetryEnvironment

    huge = ["9" * 5000, "-" + "1" * 2_000_000, "0" * 5000 + "12"]
    env = ArithmeticEnvironment()
    ret = env.step([log(a) for a in huge], [{"ground_truth": 12}] * 3)
    assert ret.rewards.tolist() == [0.0, 0.0, 1.0]  # leading zeros are still the number
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics["env/arithmetic_too_long"] == 2 and metrics["env/arithmetic_no_integer"] == 0
    retry = ArithmeticRetryEnvironment().step(
        [log("9" * 5000)], [{"ground_truth": 1, "prompt": "Q"}]
    )
    assert retry.rewards.tolist() == [0.0] and retry.terminateds.tolist() == [False]
    with pytest.raises(ValueError, match=r"Sample 0: metadata\['ground_truth'\]='1.5'"):
        env.step([log("1")], [{"ground_truth": "1.5"}])


def test_reward_fn_loading_and_scoring(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    env = RewardFunctionEnvironment("examples.custom_reward:length_penalty")
    long_answer = " ".join(["w"] * 15)
    ret = env.step(
        [log("one two three"), log(long_answer), log("")],
        [{"target_words": 10}, {"target_words": 10}, {}],
    )
    # 3 words <= 10 -> 1; 15 words -> 1 - 5/10 = 0.5; empty -> 0
    assert ret.rewards.tolist() == pytest.approx([1.0, 0.5, 0.0])
    # dotted form and file form name the same function
    assert load_reward_fn("examples.custom_reward.length_penalty").__name__ == "length_penalty"
    monkeypatch.chdir(REPO)
    fn = load_reward_fn("examples/custom_reward.py:length_penalty")
    assert fn("p", "a b", {"target_words": 1}) == 0.0


def test_reward_fn_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(AttributeError, match="has no attribute 'nope'.*length_penalty"):
        load_reward_fn("examples.custom_reward:nope")
    with pytest.raises(ValueError, match="not an import path"):
        load_reward_fn("justaname")
    with pytest.raises(ImportError, match="does not exist"):
        load_reward_fn("missing/file.py:fn")


def test_reward_fn_receives_prompt_and_completion(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards_mod.py"
    module.write_text(
        "def echo(prompt, completion, metadata):\n"
        "    return len(prompt) * 100 + len(completion) + metadata['bonus']\n"
        "def broken(prompt, completion, metadata):\n"
        "    raise RuntimeError('boom')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = RewardFunctionEnvironment("my_rewards_mod:echo")
    ret = env.step([log("abc", prompt="hello")], [{"bonus": 0.5}])
    assert ret.rewards.tolist() == [5 * 100 + 3 + 0.5]
    with pytest.raises(RuntimeError, match="failed on sample 0.*boom"):
        RewardFunctionEnvironment("my_rewards_mod:broken").step([log("x")], [{}])


def test_reward_fn_failing_on_one_answer_scores_it_zero_and_counts_it(tmp_path, monkeypatch):
    """One answer the function cannot take (or a NaN it returns) must not end the run: it
    scores 0 and is counted; more than max_error_rate of a step still stops it (issue 27)."""
    module = tmp_path / "picky_rewards_mod.py"
    module.write_text(
        "def picky(prompt, completion, metadata):\n"
        "    if completion == 'nan':\n"
        "        return float('nan')\n"
        "    return float(int(completion))  # ValueError on anything but an integer\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = RewardFunctionEnvironment("picky_rewards_mod:picky", max_error_rate=0.25)
    answers = ["1", "2", "x" * 10, "3", "4", "5", "nan", "6"]
    ret = env.step([log(a) for a in answers], [{}] * len(answers))
    assert ret.rewards.tolist() == [1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 0.0, 6.0]
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics == {"env/reward_fn_samples": 8.0, "env/reward_fn_errors": 2.0}
    with pytest.raises(RuntimeError, match=r"failed on sample 0 \(and 1 more of 2.*'a'"):
        env.step([log("a"), log("b")], [{}, {}])


def test_several_reward_functions_sum_with_their_weights_and_report_each(tmp_path, monkeypatch):
    """TRL's ``reward_funcs`` + ``reward_weights``: ``env.reward_fn`` as a list (a format
    reward beside an answer reward) was a validation error, and combining them meant writing
    a wrapper. Each function's own mean is reported; one that fails on a sample adds 0 there
    and the sample is counted once."""
    from tempering.config import GRPOMasterConfig, load_config
    from tempering.config.loader import ConfigError

    module = tmp_path / "two_rewards_mod.py"
    module.write_text(
        "def right(prompt, completion, metadata):\n"
        "    return float(completion.strip() == metadata['ground_truth'])\n"
        "def short(prompt, completion, metadata):\n"
        "    if completion == 'boom':\n"
        "        raise ValueError('no')\n"
        "    return float(len(completion) <= 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = RewardFunctionEnvironment(
        ["two_rewards_mod:right", "two_rewards_mod:short"], weights=[1.0, 0.25], max_error_rate=0.5
    )
    answers = ["42", "43", "  42  ", "boom"]
    ret = env.step([log(a) for a in answers], [{"ground_truth": "42"}] * 4)
    assert ret.rewards.tolist() == pytest.approx([1.25, 0.25, 1.0, 0.0])
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics == {"env/reward_fn_samples": 4.0, "env/reward_fn_errors": 1.0,
                       "env/reward_fn/right_mean": 0.5,
                       "env/reward_fn/short_mean": 2 / 3}  # over the answers it scored  # fmt: skip
    with pytest.raises(ConfigError, match=r"env.reward_weights=\[1.0\] has 1 weights for 2"):
        load_config(REPO / "examples/configs/grpo_math_tiny.yaml",
                    ["env.reward_fn=[a:b, c:d]", "env.reward_weights=[1.0]"],
                    schema=GRPOMasterConfig)  # fmt: skip
    cfg, _ = load_config(REPO / "examples/configs/grpo_math_tiny.yaml",
                         ["env.reward_fn=[a:b, c:d]", "env.reward_weights=[1.0, 0.1]"],
                         schema=GRPOMasterConfig)  # fmt: skip
    assert cfg.env.reward_fn == ["a:b", "c:d"]


def test_trl_reward_functions_run_unchanged_once_per_step(tmp_path, monkeypatch):
    """A TRL reward function (``fn(prompts, completions, **columns) -> list``, None where it
    does not apply) is called TRL's way: once per step, the metadata as keyword lists, and in
    a chat-template run the conversational form TRL passes."""
    module = tmp_path / "trl_rewards_mod.py"
    module.write_text(
        "def accuracy(prompts, completions, ground_truth, **kwargs):\n"
        "    texts = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [None if g is None else float(t.strip() == g)\n"
        "            for t, g in zip(texts, ground_truth)]\n"
        "def seen(prompts, completions, **kwargs):\n"
        "    return [float(isinstance(p, list) and p[-1]['role'] == 'user') for p in prompts]\n"
        "def wrong_length(prompts, completions, **kwargs):\n"
        "    return [1.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fns = ["trl_rewards_mod:accuracy", "trl_rewards_mod:seen"]
    metas = [{"ground_truth": "42"}, {"ground_truth": "42"}, {"ground_truth": None}]
    logs = [log("42"), log("7"), log("42")]
    plain = RewardFunctionEnvironment(fns).step(logs, metas)
    assert plain.rewards.tolist() == [1.0, 0.0, 0.0]  # strings: `seen` gives 0
    chat = RewardFunctionEnvironment(fns, conversational=True)
    assert chat.step(logs, metas).rewards.tolist() == [2.0, 1.0, 1.0]
    _, metrics = chat.global_post_process_and_metrics({})
    assert metrics["env/reward_fn/accuracy_mean"] == 0.5  # None: not scored, not an error
    assert metrics["env/reward_fn_errors"] == 0
    with pytest.raises(RuntimeError, match=r"wrong_length: returned 1 values for 2 completions"):
        RewardFunctionEnvironment("trl_rewards_mod:wrong_length").step(logs[:2], metas[:2])


class _Constant(EnvironmentInterface):
    """Test environment: reward = a constant, answer = the task's name (to trace routing)."""

    def __init__(self, value: float, label: str) -> None:
        self.value, self.label, self.batch_sizes = value, label, []

    def step(self, message_logs, metadata):
        self.batch_sizes.append(len(message_logs))
        n = len(message_logs)
        return EnvironmentReturn(
            [{"role": "environment", "content": m[-1]["content"]} for m in message_logs],
            list(metadata),
            [None] * n,
            torch.full((n,), self.value),
            torch.ones(n, dtype=torch.bool),
            [self.label] * n,
        )


def test_route_step_preserves_order():
    envs = {"a": _Constant(1.0, "a"), "b": _Constant(2.0, "b")}
    tasks = ["b", "a", "b", "b", "a"]
    logs = [log(f"ans{i}") for i in range(5)]
    metas = [{"i": i} for i in range(5)]
    ret = route_step(envs, logs, metas, tasks)
    assert ret.rewards.tolist() == [2.0, 1.0, 2.0, 2.0, 1.0]
    assert ret.answers == tasks
    assert [o["content"] for o in ret.observations] == [f"ans{i}" for i in range(5)]
    assert ret.metadata == metas
    assert envs["a"].batch_sizes == [2] and envs["b"].batch_sizes == [3]  # one call per task
    with pytest.raises(KeyError, match=r"\['c'\]"):
        route_step(envs, logs[:1], metas[:1], ["c"])


def test_route_step_takes_an_actors_read_only_numpy_without_a_warning():
    # Ray deserialises an actor's numpy rewards read-only; torch.as_tensor on them warns
    # "The given NumPy array is not writable" into every GRPO run's log.
    class ReadOnly(_Constant):
        def step(self, logs, metas):
            ret = super().step(logs, metas)
            rewards, terminateds = ret.rewards.numpy(), ret.terminateds.numpy()
            rewards.flags.writeable = terminateds.flags.writeable = False
            return ret._replace(rewards=rewards, terminateds=terminateds)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ret = route_step({"a": ReadOnly(3.0, "a")}, [log("x"), log("y")], [{}, {}], ["a", "a"])
    assert ret.rewards.tolist() == [3.0, 3.0] and ret.terminateds.tolist() == [True, True]


def test_an_environment_actor_class_hands_its_metrics_tensors_sent_as_numpy():
    class Recording(_Constant):
        def global_post_process_and_metrics(self, batch):
            self.seen = batch
            return batch, {}

    env = actor_class(Recording)(1.0, "a")
    sent = to_wire(torch.tensor([1.0, 0.0]))
    assert isinstance(sent, np.ndarray)
    sent.flags.writeable = False  # as Ray hands it to the actor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.global_post_process_and_metrics({"rewards": sent, "note": "kept"})
    assert isinstance(env.seen["rewards"], torch.Tensor) and env.seen["rewards"].tolist() == [1, 0]
    assert env.seen["note"] == "kept"


def test_registry():
    assert set(ENVIRONMENT_REGISTRY) >= {"math", "arithmetic", "reward_fn"}
    assert get_environment_class("arithmetic") is ArithmeticEnvironment
    assert isinstance(create_environment("arithmetic"), ArithmeticEnvironment)
    with pytest.raises(KeyError, match="nope.*arithmetic"):
        get_environment_class("nope")
    register_environment("constant_test", _Constant)
    try:
        assert create_environment("constant_test", value=3.0, label="x").value == 3.0
        with pytest.raises(ValueError, match="already registered"):
            register_environment("constant_test", ArithmeticEnvironment)
    finally:
        del ENVIRONMENT_REGISTRY["constant_test"]
    with pytest.raises(TypeError, match="EnvironmentInterface"):
        register_environment("bad", dict)


@pytest.fixture(scope="module")
def ray_running():
    """Reuse a running Ray (a session fixture's) or start one for this module."""
    import ray

    from tempering.distributed.virtual_cluster import init_ray

    started = not ray.is_initialized()
    init_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()


@pytest.mark.slow  # Ray start-up + two actors importing torch/sympy: ~90 s on a busy 2-core box
def test_math_and_arithmetic_as_ray_actors(ray_running):
    import ray

    from tempering.environments.math import make_math_environment_actor
    from tempering.environments.registry import create_environment_actor

    math_actor = make_math_environment_actor(num_workers=1, timeout_s=TIMEOUT_S)
    arith_actor = create_environment_actor("arithmetic")
    try:
        tasks = ["math", "arithmetic", "math", "arithmetic"]
        logs = [log("\\boxed{0.5}"), log(" 5"), log("\\boxed{9}"), log("6")]
        metas = [
            {"ground_truth": "1/2"},
            {"ground_truth": 5},
            {"ground_truth": "8"},
            {"ground_truth": 5},
        ]
        ret = route_step({"math": math_actor, "arithmetic": arith_actor}, logs, metas, tasks)
        assert ret.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
        batch = {"rewards": to_wire(torch.tensor([1.0, 0.0, 0.0, 0.0]))}  # as GRPO sends it
        _, metrics = ray.get(math_actor.global_post_process_and_metrics.remote(batch))
        assert metrics["env/math_samples"] == 2 and metrics["env/math_accuracy"] == 0.25
    finally:
        ray.get(math_actor.shutdown.remote())
        ray.kill(math_actor)
        ray.kill(arith_actor)


# ---------------------------------------------------------------- multi-turn environments
def test_retry_environment_rewards_by_attempt_and_asks_again():
    from tempering.environments.arithmetic import ArithmeticRetryEnvironment

    env = ArithmeticRetryEnvironment(max_attempts=2, discount=0.5)
    meta = {"ground_truth": "68", "prompt": "Q: 23+45=? A:"}
    first = env.step(
        [[{"role": "user", "content": "Q"}, {"role": "assistant", "content": " 67"}]] * 2
        + [[{"role": "assistant", "content": " 68"}]],
        [meta, {**meta, "attempt": 1}, meta],
    )
    # wrong at attempt 1: continue with the question; wrong at the last attempt: fail; right: 1
    assert first.rewards.tolist() == [0.0, 0.0, 1.0]
    assert first.terminateds.tolist() == [False, True, True]
    assert first.observations[0] == {"role": "user", "content": "Q: 23+45=? A:"}
    assert [m["attempt"] for m in first.metadata] == [1, 2, 1]
    second = env.step([[{"role": "assistant", "content": " 68"}]], [first.metadata[0]])
    assert second.rewards.tolist() == [0.5] and second.terminateds.tolist() == [True]
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics == {"env/retry_solved_at_1": 1.0, "env/retry_solved_at_2": 1.0,
                       "env/retry_failed": 1.0}  # fmt: skip


def _calc_call(arguments) -> dict:
    return {"id": "c", "type": "function",
            "function": {"name": "calculator", "arguments": arguments}}  # fmt: skip


@pytest.mark.parametrize(
    "expression,value",
    [("2+3*4", 14), ("(2+3)*4", 20), ("7/2", 3.5), ("2**10", 1024), ("-3 - -4", 1), ("17 % 5", 2)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    from tempering.environments.calculator import evaluate_expression

    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "expression,needle",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd')", "not allowed"),
        ("2**100000", "exponent"),
        ("1/0", "division by zero"),
        ("1e30**11", "out of range"),  # OverflowError from float pow: it ended a GRPO run
        ("(1e-300)**-64", "out of range"),
        ("9" * 300, "longer than"),
        ("x + 1", "not allowed"),
        ("2 +", "not an arithmetic"),
    ],
)
def test_calculator_refuses_everything_but_arithmetic(expression, needle):
    from tempering.environments.calculator import evaluate_expression

    with pytest.raises(ValueError, match=needle):
        evaluate_expression(expression)


@pytest.mark.parametrize(
    "call,needle",
    [
        (_calc_call("[" * 100_000 + "]" * 100_000), "longer than"),  # RecursionError in json
        (_calc_call("[" * 5_000 + "]" * 5_000), "RecursionError|arguments must be"),
        (_calc_call('{"expression": "1e309"}'), "out of range"),  # inf, a literal
        (_calc_call('{"expression": "1e309 - 1e309"}'), "out of range"),  # nan
        (_calc_call('{"expression": ["1"]}'), "arguments must be"),
        (_calc_call({"expression": "2+2"}), "^4$"),  # arguments already an object
        ("not a call", "must be"),  # AttributeError on str.get
        ({"function": "calculator"}, "must be"),
    ],
)
def test_calculator_tool_answers_any_call_with_a_value_or_an_error(call, needle):
    """Model-written tool calls of any shape get an answer, never an exception."""
    import re

    from tempering.environments.calculator import _run_call

    assert re.search(needle, _run_call(call)), _run_call(call)


def test_calculator_environment_answers_tool_calls_then_scores_the_final_answer():
    from tempering.environments.calculator import CalculatorEnvironment

    env = CalculatorEnvironment(max_tool_calls=1, num_workers=1)
    call = {"id": "c1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "23+45"}'}}  # fmt: skip
    user = {"role": "user", "content": "23+45?"}
    try:
        ret = env.step(
            [
                [user, {"role": "assistant", "content": None, "tool_calls": [call]}],
                [user, {"role": "assistant", "content": "The answer is \\boxed{68}"}],
                [user, {"role": "assistant", "content": None, "tool_calls": [call]}],
            ],
            [
                {"ground_truth": "68"},
                {"ground_truth": "68"},
                {"ground_truth": "68", "tool_calls": 1},
            ],
        )
    finally:
        env.shutdown()
    assert ret.observations[0] == {"role": "tool", "content": "68", "tool_call_id": "c1"}
    assert ret.terminateds.tolist() == [False, True, True]  # the third is over its call budget
    assert ret.rewards.tolist() == [0.0, 1.0, 0.0]
    assert ret.metadata[0]["tool_calls"] == 1
