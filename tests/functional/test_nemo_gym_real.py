"""The real `nemo-gym` package (0.7.0) against tempering's generation server (slow tier).

Gym runs in a venv of its own (PY_EXECUTABLES.NEMO_GYM, built by the project's own
machinery into the session's venvs folder), started by `LaunchedGym` exactly as GRPO's launch
mode does, joined to the test session's Ray. Three of its bundled environments roll out
through their real agents, resources servers and `vllm_model` policy server:
example_single_tool_call (a tool call, then an answer), math_with_judge with the judge off
(math-verify on ``\\boxed{}``), and equivalence_rule (exact match) on tiny-arith problems.

The model behind our server is scripted (tests/scripted_backend.py): no model we can build
offline calls Gym's tools reliably. Everything else is real, and the assertions are Gym's
own rewards and the token ids it hands back, which must pass our contiguity check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "San Francisco"}}</tool_call>'


def _rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]


def test_real_gym_rollouts_score_and_return_contiguous_token_ids(
    ray_session, worker_venvs_dir, tmp_path
):
    from tempering.config.schemas import NemoGymConfig
    from tempering.data.nemo_gym import problem_row
    from tempering.distributed.actor_environments import (
        get_actor_executable,
        resolve_python,
        site_packages,
    )
    from tempering.environments.nemo_gym import (
        LAUNCHER_FQN,
        GymServerError,
        NemoGymClient,
        NemoGymEnvironment,
    )
    from tempering.environments.nemo_gym_instances import build_nemo_gym_environment
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer
    from tempering.models.hf import load_tokenizer
    from tests.scripted_backend import ScriptedBackend

    site = site_packages(resolve_python(LAUNCHER_FQN, get_actor_executable(LAUNCHER_FQN)))
    tool_rows = _rows(site / "resources_servers/example_single_tool_call/data/example.jsonl", 2)
    math_rows = _rows(site / "resources_servers/math_with_judge/data/example.jsonl", 3)
    for row in tool_rows:
        row["_ng_environment_server"] = "example_single_tool_call_environment_server"
    for row in math_rows:
        row["_ng_environment_server"] = "math_with_judge_environment_server"
    arith = [problem_row("Q: 23+45=? A:", "68"), problem_row("Q: 11+12=? A:", "23")]
    for row in arith:
        row["_ng_environment_server"] = "lc_equivalence_rule_environment_server"
    wrong_math = math_rows[-1]["question"]  # answered wrongly on purpose: Gym must give 0

    def reply(prompt: str) -> str:
        tail = prompt[-400:]
        if prompt.count("<tool_response>") > 1:  # one is in the default tool prompt
            return "It is cold in San Francisco."
        if '"name": "get_weather"' in prompt:  # offered the weather tool, not called yet
            return TOOL_CALL
        for row in math_rows:
            if row["question"][-60:] in tail:
                answer = "7" if row["question"] == wrong_math else row["expected_answer"]
                return f"The answer is \\boxed{{{answer}}}."
        found = re.findall(r"Q: (\d+)\+(\d+)=\? A:", tail)
        assert found, f"no rule for the prompt ending {tail[-300:]!r}"
        a, b = map(int, found[-1])
        return f" {a + b if a != 11 else 0}"  # 11+12 answered wrongly on purpose

    tokenizer = load_tokenizer("tiny-arith")
    settings = ServerSettings(
        model_name="policy", max_model_len=16384, default_sampling=SamplingConfig(max_new_tokens=64)
    )
    service = ChatCompletionService(ScriptedBackend(tokenizer, reply), tokenizer, settings)
    with OpenAIServer(service) as server:
        gym_cfg = NemoGymConfig(
            config_paths=[
                "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
                "resources_servers/math_with_judge/configs/math_with_judge.yaml",
                "resources_servers/equivalence_rule/configs/lc.yaml",
            ],
            head_server_port=_free_port(),
            retry_backoff_s=0.1,
        )
        env = build_nemo_gym_environment(
            gym_cfg,
            policy_base_url=server.base_url,
            policy_model_name="policy",
            policy_api_key=None,
            max_seq_len=16384,
            pad_token_id=0,
            work_dir=str(tmp_path / "gym"),
        )
        head = env.client.head_server_url
        try:
            rows = tool_rows + math_rows + arith
            batch = env.rollouts(rows, sampling=SamplingConfig(max_new_tokens=64))
            _, metrics = env.global_post_process_and_metrics({})
        finally:
            env.shutdown()
    n_tool, n_math = len(tool_rows), len(math_rows)
    rewards = batch["rewards"].tolist()
    assert rewards[:n_tool] == [1.0] * n_tool  # Gym saw a get_weather call
    assert rewards[n_tool : n_tool + n_math] == [1.0] * (n_math - 1) + [0.0]
    assert rewards[n_tool + n_math :] == [1.0, 0.0]
    assert batch["turns"][:n_tool].tolist() == [2] * n_tool
    assert (batch["turns"][n_tool:] == 1).all() and batch["sample_mask"].all()
    for b in range(batch.size):  # every generated token is masked in, with the sampler's log-prob
        mask = batch["token_mask"][b].bool()
        lps = batch["generation_logprobs"][b][mask]
        assert abs(float(lps[0]) + 0.01) < 1e-6 and int(mask.sum()) == int(
            batch["generation_lengths"][b]
        )
    assert metrics["env/example_single_tool_call_simple_agent/reward_mean"] == 1.0
    assert metrics["gym/noncontiguous_truncated"] == 0.0
    # shut down means gone: the head server no longer answers
    with pytest.raises(GymServerError):
        NemoGymClient(head, max_retries=0).global_config()
    assert isinstance(env, NemoGymEnvironment)


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # Gym takes a port number, not a socket: a small race, tests only
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gym_examples_command_writes_routed_rows(worker_venvs_dir, tmp_path):
    from tempering.cli import main
    from tempering.data.nemo_gym import load_gym_rows

    out = tmp_path / "rows.jsonl"
    envs = "example_single_tool_call,math_with_judge"
    assert main(["gym-examples", str(out), "--environments", envs]) == 0
    rows = load_gym_rows(out)  # every row passes the loader's checks, routing included
    names = {r["agent_ref"]["name"] for r in rows}
    assert names == {"example_single_tool_call_simple_agent", "math_with_judge_simple_agent"}
    assert len(rows) == 10  # Gym 0.7 ships 5 example rows for each
    assert main(["gym-examples", str(out), "--environments", "no_such_env"]) == 2


def test_the_smollm2_gym_config_fits_the_rows_gym_ships(worker_venvs_dir, tmp_path):
    """grpo_nemo_gym_smollm2.yaml runs on the rows `tempering gym-examples` writes: each row's
    first prompt, as our generation server renders it for SmolLM2 (tools included), leaves
    room for max_new_tokens within max_total_sequence_length. At 4096 every workplace_assistant
    row (27 tools, 4,271 tokens) was refused and the run died at its first step."""
    from tempering.cli import main
    from tempering.config import MASTER_CONFIGS, load_config
    from tempering.data.nemo_gym import load_gym_rows
    from tempering.environments.nemo_gym_standin import chat_messages_and_tools
    from tempering.models.generation.chat import ChatPromptBuilder
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    config = Path(__file__).parents[2] / "examples/configs/grpo_nemo_gym_smollm2.yaml"
    cfg, _ = load_config(config, schema=MASTER_CONFIGS["grpo"])
    out = tmp_path / "rows.jsonl"
    assert main(["gym-examples", str(out)]) == 0  # the default environments, as the config says
    rows = load_gym_rows(out)
    tokenizer = load_tokenizer(resolve_model_path(cfg.policy.model_name))
    server = cfg.policy.generation.http_server  # the service GRPO builds: the model's template
    prompts = ChatPromptBuilder(tokenizer, None, server.tool_parser, server.eot_token)
    budget = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    lengths = {}
    for row in rows:
        messages, tools = chat_messages_and_tools(row["responses_create_params"])
        n = len(prompts.encode(messages, tools or None).ids)
        lengths[row["agent_ref"]["name"]] = max(n, lengths.get(row["agent_ref"]["name"], 0))
    assert len(lengths) == 3 and lengths["workplace_assistant_simple_agent"] > 4096, lengths
    assert max(lengths.values()) <= budget, (lengths, budget)


def test_real_gym_split_over_shards_and_replicas(ray_session, worker_venvs_dir, tmp_path):
    """One Gym config (two environments) split over three Ray actors: shard `arith` hosts
    equivalence_rule in two replicas, shard `tools` the single-tool-call agent (its
    environment server and resources server come along). Each instance's own Gym must run
    only its shard's entries plus the policy model, with its shard's overrides over the
    common ones; rows must reach their shard (Gym's rewards say so) and the arith groups
    must alternate between the replicas. Mid-step, while its episode for 5+6 waits on the
    model, replica arith/1 is SIGKILLed (its process group: the launcher actor and every Gym
    server under it): it must be restarted on its ports and its two in-flight groups sent
    again, counted, with every reward as without the kill. Measured 2026-12-07 on 2 cores: 43 s
    after the test above built Gym's venv (three Gyms, 12 servers, up together under one
    deadline), before the kill was added; 71 s with it, run alone (the restart brings one
    Gym up again, 4 servers)."""
    from tempering.config.schemas import NemoGymConfig
    from tempering.data.nemo_gym import problem_row
    from tempering.distributed.actor_environments import (
        get_actor_executable,
        resolve_python,
        site_packages,
    )
    from tempering.environments.nemo_gym import (
        LAUNCHER_FQN,
        GymServerError,
        NemoGymClient,
    )
    from tempering.environments.nemo_gym_instances import build_nemo_gym_environment
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer
    from tempering.models.hf import load_tokenizer
    from tests.scripted_backend import ScriptedBackend

    killed: list = []  # the launched Gym, once it has killed replica arith/1

    def reply(prompt: str) -> str:
        if prompt.count("<tool_response>") > 1:
            return "It is cold in San Francisco."
        if '"name": "get_weather"' in prompt:
            return TOOL_CALL
        a, b = map(int, re.findall(r"Q: (\d+)\+(\d+)=\? A:", prompt[-400:])[-1])
        if (a, b) == (5, 6) and not killed:  # replica arith/1's episode waits on this call
            killed.append(env.launcher)
            env.launcher.kill(("arith", 1))  # its whole process group: actor and servers
        return f" {a + b if a != 11 else 0}"  # 11+12 answered wrongly on purpose

    tokenizer = load_tokenizer("tiny-arith")
    settings = ServerSettings(
        model_name="policy", max_model_len=16384, default_sampling=SamplingConfig(max_new_tokens=64)
    )
    service = ChatCompletionService(ScriptedBackend(tokenizer, reply), tokenizer, settings)
    site = site_packages(resolve_python(LAUNCHER_FQN, get_actor_executable(LAUNCHER_FQN)))
    (tool_row,) = _rows(site / "resources_servers/example_single_tool_call/data/example.jsonl", 1)
    tool_row.pop("_ng_environment_server", None)
    tool_row["agent_ref"] = {"name": "example_single_tool_call_simple_agent"}  # claimed by tools
    pairs = ((23, 45), (11, 12), (3, 4), (5, 6))
    arith = [problem_row(f"Q: {a}+{b}=? A:", str(a + b)) for a, b in pairs]
    gym_cfg = NemoGymConfig(
        config_paths=[
            "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
            "resources_servers/equivalence_rule/configs/lc.yaml",
        ],
        default_route="lc_equivalence_rule_environment_server",  # the arith rows' target
        head_server_port=_free_port(),
        retry_backoff_s=0.1,
        extra_config={"tempering_tag": "common", "tempering_common": 1},
        shards=[
            {"name": "arith", "entries": ["lc_equivalence_rule_environment_server"],
             "replicas": 2, "extra_config": {"tempering_tag": "arith"}},
            {"name": "tools", "entries": ["example_single_tool_call_simple_agent"]},
        ],
    )  # fmt: skip
    with OpenAIServer(service) as server:
        env = build_nemo_gym_environment(
            gym_cfg,
            policy_base_url=server.base_url,
            policy_model_name="policy",
            policy_api_key=None,
            max_seq_len=16384,
            pad_token_id=0,
            work_dir=str(tmp_path / "gym"),
        )
        heads = {key: c.head_server_url for key, c in env.client.clients.items()}
        try:
            configs = {key: c.global_config() for key, c in env.client.clients.items()}
            batch = env.rollouts([tool_row, *arith], sampling=settings.default_sampling, repeat=2)
            _, metrics = env.global_post_process_and_metrics({})
        finally:
            env.shutdown()
    assert sorted(heads) == [("arith", 0), ("arith", 1), ("tools", 0)]
    servers = {key: {n for n, v in c.items() if isinstance(v, dict) and len(v) == 1
                     and next(iter(v)) in ("resources_servers", "responses_api_agents",
                                           "responses_api_models", "environment_servers")}
               for key, c in configs.items()}  # fmt: skip
    lc = {"lc_equivalence_rule", "lc_equivalence_rule_simple_agent",
          "lc_equivalence_rule_environment_server"}  # fmt: skip
    tools = {"example_single_tool_call", "example_single_tool_call_simple_agent",
             "example_single_tool_call_environment_server"}  # fmt: skip
    assert servers[("arith", 0)] == servers[("arith", 1)] == lc | {"policy_model"}
    assert servers[("tools", 0)] == tools | {"policy_model"}
    assert [configs[k]["tempering_tag"] for k in sorted(configs)] == ["arith", "arith", "common"]
    assert all(c["tempering_common"] == 1 for c in configs.values())
    assert batch["rewards"].tolist() == [1.0] * 2 + [1.0] * 2 + [0.0] * 2 + [1.0] * 4
    assert batch["turns"][:2].tolist() == [2, 2] and batch["sample_mask"].all()
    assert metrics["gym/shard/tools/samples"] == 2.0 and metrics["gym/shard/arith/groups"] == 4.0
    assert metrics["gym/shard/arith/replica_0_groups"] == 2.0
    assert metrics["gym/shard/arith/replica_1_groups"] == 2.0  # counted once, not per try
    assert killed and metrics["gym/shard/arith/restarts"] == 1.0
    assert metrics["gym/shard/arith/retried_groups"] == 2.0  # 11+12 and 5+6, both in flight
    assert metrics["gym/shard/tools/restarts"] == 0.0
    for url in heads.values():  # shut down means gone, every instance
        with pytest.raises(GymServerError):
            NemoGymClient(url, max_retries=0).global_config()


def test_grpo_on_two_real_gym_shards_learns(ray_session, worker_venvs_dir, tmp_path):
    """examples/configs/grpo_nemo_gym_shards_tiny.yaml as shipped, its rows made by
    `tempering gym-examples --arithmetic`: GRPO on tiny-arith through the real Gym split over
    shard `arith` (2 replicas) and shard `agent`. Every step's groups reach both shards and
    both replicas; held-out greedy accuracy (Gym's rewards on the 256 test problems the
    in-process runs hold out, 39.8% at the start) rises at least 6 points in 20 steps.
    Measured 2026-12-07 on 2 cores: 39.8% -> 51.2% and 50.4% in two runs (+11.3, +10.5);
    87 s after the test above built Gym's venv (144 s run alone, the build included). The
    Gym path does not repeat exactly (test_grpo_nemo_gym.py: its 40-step runs spread over
    4.7 points), hence the margin below the measured gain."""
    import json
    import subprocess
    import sys

    from tests.grpo_runs import train

    for name, extra in (("train", ["--arithmetic", "2000"]),
                        ("test", ["--arithmetic", "256", "--split", "test"])):  # fmt: skip
        cmd = [sys.executable, "-m", "tempering.cli", "gym-examples",
               str(tmp_path / f"{name}.jsonl"), *extra]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
    summary = train("grpo_nemo_gym_shards_tiny.yaml", 20, tmp_path, [
        f"data.train_data_path={tmp_path / 'train.jsonl'}",
        f"data.val_data_path={tmp_path / 'test.jsonl'}",
        f"env.nemo_gym.head_server_port={_free_port()}",
    ])  # fmt: skip
    print(f"two Gym shards: {summary['start_accuracy']:.1%} -> {summary['end_accuracy']:.1%} "
          f"in {summary['wall_time_s']:.0f} s")  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "gym/shard/arith/groups" in r]
    assert len(steps) >= 20
    for key in ("arith/replica_0_groups", "arith/replica_1_groups", "agent/groups"):
        assert all(r[f"gym/shard/{key}"] > 0 for r in steps), key
    assert abs(summary["start_accuracy"] - 0.398) < 0.02, summary
    assert summary["end_accuracy"] >= summary["start_accuracy"] + 0.06, summary
