"""NeMo Gym shards and replicas (tempering/environments/nemo_gym_shards.py): claims, which
servers a shard runs, which rows go where, the refusals before Ray, and the sharded client
over three protocol stand-in Gyms on loopback (the real package: tests/functional/
test_nemo_gym_real.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tempering.config import MASTER_CONFIGS, ConfigError, load_config
from tempering.config.rl_sections import NemoGymConfig, gym_shards
from tempering.data.nemo_gym import problem_row
from tempering.environments.nemo_gym import GymServerError
from tempering.environments.nemo_gym_shards import (
    GroupRouter,
    GymShard,
    GymShardError,
    check_rows_hosted,
    claims,
    hosted_entries,
    instance_names,
    instance_ports,
    placement_strategy,
)

ROOT = Path(__file__).resolve().parents[2]
SHARDS_YAML = ROOT / "examples/configs/grpo_nemo_gym_shards.yaml"
TINY_YAML = ROOT / "examples/configs/grpo_nemo_gym_tiny.yaml"


def _server(kind: str, impl: str, **conf) -> dict:
    return {kind: {impl: {"entrypoint": "app.py", **conf}}}


def _ref(kind: str, name: str) -> dict:
    return {"type": kind, "name": name}


# Gym's merged global config, as the launcher reads it offline (shape of nemo-gym 0.7's)
GYM_CONFIG = {
    "policy_model": _server("responses_api_models", "vllm_model", base_url="${policy_base_url}"),
    "judge_model": _server("responses_api_models", "vllm_model"),
    "math": _server("resources_servers", "math_with_judge",
                    judge_model_server=_ref("responses_api_models", "judge_model")),
    "math_agent": _server("responses_api_agents", "simple_agent",
                          resources_server=_ref("resources_servers", "math"),
                          model_server=_ref("responses_api_models", "policy_model")),
    "math_environment_server": _server("environment_servers", "legacy_agent",
                                       agent_server=_ref("responses_api_agents", "math_agent")),
    "tools": _server("resources_servers", "example_single_tool_call"),
    "tools_agent": _server("responses_api_agents", "simple_agent",
                           resources_server=_ref("resources_servers", "tools"),
                           model_server=_ref("responses_api_models", "policy_model")),
    "tools_environment_server": _server("environment_servers", "legacy_agent",
                                        agent_server=_ref("responses_api_agents", "tools_agent")),
    "policy_base_url": ["http://127.0.0.1:8000/v1"],
    "head_server": {"host": "127.0.0.1", "port": 11000},
}  # fmt: skip


# ------------------------------------------------------------------------------- claims
def test_each_entry_is_claimed_once_and_a_second_claim_names_both_shards():
    shards = [GymShard("a", ("math_agent",)), GymShard("b", ("tools_agent", "tools"), 2)]
    assert claims(shards) == {"math_agent": "a", "tools_agent": "b", "tools": "b"}
    with pytest.raises(GymShardError, match="'math_agent' is claimed by shards 'a' and 'b'"):
        claims([GymShard("a", ("math_agent",)), GymShard("b", ("math_agent",))])
    with pytest.raises(GymShardError, match="claimed by shard 'a' twice"):
        claims([GymShard("a", ("math_agent", "math_agent"))])
    with pytest.raises(GymShardError, match="shard name 'a' is used 2 times"):
        claims([GymShard("a", ("x",)), GymShard("a", ("y",))])


def test_a_shard_runs_what_its_entries_need_and_nothing_it_does_not():
    assert hosted_entries(GYM_CONFIG, ["math_agent"], "m") == [
        "policy_model", "judge_model", "math", "math_agent", "math_environment_server",
    ]  # the agent's resources server, its judge, the policy model, the server in front  # fmt: skip
    # an environment server brings its agent and what that needs
    assert hosted_entries(GYM_CONFIG, ["tools_environment_server"], "t") == [
        "policy_model", "tools", "tools_agent", "tools_environment_server",
    ]  # fmt: skip
    # a claimed resources server brings the agents that use it
    assert "tools_agent" in hosted_entries(GYM_CONFIG, ["tools"], "t")


def test_disjoint_claims_host_every_claimed_entry_in_exactly_one_shard():
    shards = [GymShard("m", ("math_agent",)), GymShard("t", ("tools_environment_server",))]
    hosted = {s.name: set(hosted_entries(GYM_CONFIG, list(s.entries), s.name)) for s in shards}
    for entry, owner in claims(shards).items():
        assert [name for name, h in hosted.items() if entry in h] == [owner]
    assert hosted["m"] & hosted["t"] == {"policy_model"}  # only the shared dependency repeats


def test_a_claim_the_gym_config_lacks_names_the_shard_and_the_entries():
    with pytest.raises(GymShardError) as err:
        hosted_entries(GYM_CONFIG, ["math_simple_agent"], "math")
    text = str(err.value)
    assert "'math' claims ['math_simple_agent']" in text and "'math_agent'" in text
    assert "policy_model" not in text  # a model server is not something rows name


# -------------------------------------------------------------------------------- rows
def test_rows_route_to_the_shard_claiming_their_target_and_groups_alternate_replicas():
    shards = [GymShard("m", ("math_agent",), replicas=2), GymShard("t", ("tools_agent",))]
    router = GroupRouter(shards, default_route="tools_agent")
    math = {"agent_ref": {"name": "math_agent"}}
    env = {"_ng_environment_server": "math_agent"}  # takes precedence over agent_ref
    rows = [m for r in (math, math, {}, env, math) for m in [r] * 3]  # 5 groups of 3
    where = router.assign(rows, group_size=3)
    assert where == [k for k in [("m", 0), ("m", 1), ("t", 0), ("m", 0), ("m", 1)]
                     for _ in range(3)]  # fmt: skip
    # the turn carries over: the next step's first math group goes to replica 0 again
    assert router.assign([math] * 3, 3) == [("m", 0)] * 3
    counts = Counter(k for k in router.assign([math] * 40, 4)[::4])
    assert counts == {("m", 1): 5, ("m", 0): 5}  # replicas share the load evenly
    with pytest.raises(ValueError, match="not whole groups"):
        router.assign([math] * 5, 2)


def test_a_row_no_shard_hosts_is_refused_naming_row_agent_shards_and_fix():
    shards = [GymShard("m", ("math_agent",), replicas=2), GymShard("t", ("tools_agent",))]
    rows = [{"agent_ref": {"name": "math_agent"}}] + [{"agent_ref": {"name": "weather"}}] * 2
    with pytest.raises(GymShardError) as err:
        check_rows_hosted(rows, shards, None, "the training data")
    text = str(err.value)
    assert "agent 'weather': 2 row(s) of the training data (row 1, 2)" in text
    assert "m (2 replicas): ['math_agent']; t: ['tools_agent']" in text
    assert "add ['weather'] to a shard's entries" in text
    check_rows_hosted(rows[:1], shards, None)  # hosted: nothing to say
    with pytest.raises(GymShardError, match="no routing field and no default_route"):
        check_rows_hosted([{}], shards, None)
    check_rows_hosted([{}], shards, "tools_agent")  # the default route is hosted


def test_instances_get_their_own_head_port_and_server_port_range():
    shards = [GymShard("m", ("a",), replicas=2), GymShard("t", ("b",))]
    assert instance_names(shards) == [("m", 0), ("m", 1), ("t", 0)]
    ports = instance_ports(11000, shards)
    assert [head for head, _ in ports] == [11000, 11001, 11002]
    ranges = [set(range(lo, hi + 1)) for _, (lo, hi) in ports]
    assert all(not (a & b) for i, a in enumerate(ranges) for b in ranges[i + 1 :])
    assert placement_strategy(3, 1) is None  # one node: all on the driver's, where the venv is
    assert placement_strategy(3, 4) == "STRICT_SPREAD"
    assert placement_strategy(3, 2) == "SPREAD"  # more instances than nodes


# ------------------------------------------------------------------------------ config
def test_the_shipped_shards_config_loads_and_its_plan_shows_every_instance():
    from tempering.models.shapes import plan_for

    cfg, _ = load_config(SHARDS_YAML, schema=MASTER_CONFIGS["grpo"])
    shards = gym_shards(cfg.env.nemo_gym)
    assert [(s.name, s.replicas) for s in shards] == [("math", 2), ("tools", 1)]
    table = plan_for(cfg).table()
    assert "math[1]  head port 11001" in table and "tools[0]  head port 11002" in table


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("env.nemo_gym.shards=[{name: a, entries: [x]}, {name: b, entries: [x]}]",
         "'x' is claimed by shards 'a' and 'b'"),
        ("env.nemo_gym.shards=[{name: a, entries: []}]", "env.nemo_gym.shards.0.entries"),
        ("env.nemo_gym.shards=[{name: a, entries: [x], replicas: 0}]",
         "env.nemo_gym.shards.0.replicas"),
        ("env.nemo_gym.shards=[{name: a, entries: [x], replica: 2}]", "replica"),
        ("env.nemo_gym.head_server_port=65535", "lower env.nemo_gym.head_server_port"),
    ],
)  # fmt: skip
def test_bad_shards_are_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(SHARDS_YAML, [override], schema=MASTER_CONFIGS["grpo"])


def test_shards_refuse_attach_mode():
    with pytest.raises(ValueError, match="shards splits a Gym tempering launches"):
        NemoGymConfig(head_server_url="http://127.0.0.1:11000",
                      shards=[{"name": "a", "entries": ["x"]}])  # fmt: skip


def test_grpo_refuses_rows_no_shard_hosts_before_ray_starts(monkeypatch):
    import ray

    from tempering.algorithms import common, grpo
    from tempering.models.hf import load_tokenizer

    started = []
    monkeypatch.setattr(common, "start_ray", lambda *a, **k: started.append(1))
    # tiny-arith problems go to default_route, which this shard does not claim
    cfg, _ = load_config(
        TINY_YAML,
        ["env.nemo_gym.shards=[{name: tools, entries: [example_single_tool_call_simple_agent]}]"],
        schema=MASTER_CONFIGS["grpo"],
    )
    with pytest.raises(GymShardError) as err:
        grpo._problems(cfg, load_tokenizer("tiny-arith"))
    assert "agent 'lc_equivalence_rule_environment_server'" in str(err.value)
    assert "of the training data" in str(err.value)
    assert not started and not ray.is_initialized()


# ---------------------------------------------------- the sharded client, over HTTP
def test_sharded_client_runs_each_group_on_its_shards_replica_and_counts_it():
    from tempering.environments.nemo_gym import NemoGymClient, NemoGymEnvironment
    from tempering.environments.nemo_gym_instances import ShardedGymClient
    from tempering.environments.nemo_gym_standin import GymStandIn
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer
    from tempering.models.hf import load_tokenizer
    from tests.scripted_backend import ScriptedBackend

    tokenizer = load_tokenizer("tiny-arith")
    sampling = SamplingConfig(max_new_tokens=6)
    settings = ServerSettings(model_name="policy", max_model_len=64, default_sampling=sampling)
    backend = ScriptedBackend(tokenizer, lambda prompt: " 68" if "23+45" in prompt else " 0")
    # shard "env" claims the environment server (2 replicas), shard "agent" the agent: the
    # stand-in has both, so where a row went shows only in which Gym saw its model calls
    shards = [GymShard("env", (GymStandIn.ENVIRONMENT_SERVER,), replicas=2),
              GymShard("agent", (GymStandIn.AGENT,))]  # fmt: skip
    with OpenAIServer(ChatCompletionService(backend, tokenizer, settings)) as server:
        gyms = {key: GymStandIn(server.base_url, "policy").start()
                for key in instance_names(shards)}  # fmt: skip
        try:
            client = ShardedGymClient(
                {k: NemoGymClient(g.head_url, retry_backoff_s=0.01) for k, g in gyms.items()},
                GroupRouter(shards),
            )
            client.wait_ready(10)
            env_row = {
                **problem_row("Q: 23+45=? A:", "68"),
                "_ng_environment_server": GymStandIn.ENVIRONMENT_SERVER,
            }
            agent_row = {**problem_row("Q: 1+1=? A:", "2"), "agent_ref": {"name": GymStandIn.AGENT}}
            rows = [env_row, agent_row, env_row, env_row]  # fmt: skip
            env = NemoGymEnvironment(client, max_seq_len=64)
            batch = env.rollouts(rows, sampling=sampling, repeat=2)
            _, metrics = env.global_post_process_and_metrics({})
            seen = {k: len(g.chat_requests) for k, g in gyms.items()}
        finally:
            for g in gyms.values():
                g.stop()
    # results in row order: rows 0, 2, 3 answered 68 (reward 1), row 1 wrongly (reward 0)
    assert batch["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # env groups: rows 0, 2, 3 -> replicas 0, 1, 0; agent group -> its one instance
    assert seen == {("env", 0): 4, ("env", 1): 2, ("agent", 0): 2}
    assert metrics["gym/shard/env/groups"] == 3.0 and metrics["gym/shard/env/samples"] == 6.0
    assert metrics["gym/shard/env/replica_0_groups"] == 2.0
    assert metrics["gym/shard/env/replica_1_groups"] == 1.0
    assert metrics["gym/shard/agent/groups"] == 1.0 and metrics["gym/shard/agent/retries"] == 0
    assert metrics["gym/retries"] == 0.0
    # a row built later whose target no shard claims is refused, not sent somewhere
    with pytest.raises(GymShardError, match="agent 'nobody'"):
        client.run([{"agent_ref": {"name": "nobody"}}])


# ------------------------------------------- an instance that dies mid-step, restarted
class _StandInLaunch:
    """`LaunchedGym`'s restart surface over stand-in Gyms in child processes (the real
    launcher's restart runs in tests/functional/test_nemo_gym_real.py): `kill` SIGKILLs an
    instance's process, `restart` kills what is left and starts a fresh one."""

    timeout_s = 5.0  # a stand-in is up in well under a second

    def __init__(self, base_url, keys, dies_again=()):
        from tempering.environments.nemo_gym_standin import StandInProcess

        self.base_url, self.dies_again, self.restarted = base_url, set(dies_again), []
        self.procs = {key: StandInProcess(base_url, "policy").__enter__() for key in keys}

    def kill(self, key):
        self.procs[key]._proc.kill()
        self.procs[key]._proc.wait()

    def restart(self, key):
        from tempering.environments.nemo_gym_standin import StandInProcess

        self.kill(key)
        self.restarted.append(key)
        self.procs[key] = StandInProcess(self.base_url, "policy").__enter__()
        if key in self.dies_again:  # comes up, then dies before it answers
            self.kill(key)
        return self.procs[key].head_url

    def work_dir_of(self, key):
        return f"<{key}>"

    def shutdown(self):
        for proc in self.procs.values():
            proc.__exit__(None, None, None)


def _dying_shards_run(dies_again=(), max_restarts=2):
    """Shards `env` (2 replicas) and `agent` over stand-in processes; the model's first call
    for 5+6 (a group of replica env/1) kills that replica while its episode is in flight.
    Returns (batch or the exception raised, metrics, the launcher's restarts)."""
    import threading

    from tempering.environments.nemo_gym import NemoGymClient, NemoGymEnvironment
    from tempering.environments.nemo_gym_instances import ShardedGymClient
    from tempering.environments.nemo_gym_standin import GymStandIn
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.openai_server import OpenAIServer
    from tempering.models.hf import load_tokenizer
    from tests.scripted_backend import ScriptedBackend

    killed = threading.Event()
    launch = None

    def reply(prompt: str) -> str:
        a, b = map(int, prompt.rsplit("Q: ", 1)[1].split("=")[0].split("+"))
        if (a, b) == (5, 6) and not killed.is_set():
            killed.set()
            launch.kill(("env", 1))  # mid-episode: the agent waits on this very call
        return f" {a + b}"

    tokenizer = load_tokenizer("tiny-arith")
    sampling = SamplingConfig(max_new_tokens=6)
    settings = ServerSettings(model_name="policy", max_model_len=64, default_sampling=sampling)
    backend = ScriptedBackend(tokenizer, reply)
    shards = [GymShard("env", (GymStandIn.ENVIRONMENT_SERVER,), replicas=2),
              GymShard("agent", (GymStandIn.AGENT,))]  # fmt: skip
    with OpenAIServer(ChatCompletionService(backend, tokenizer, settings)) as server:
        launch = _StandInLaunch(server.base_url, instance_names(shards), dies_again)
        try:
            clients = {k: NemoGymClient(p.head_url, retry_backoff_s=0.01)
                       for k, p in launch.procs.items()}  # fmt: skip
            client = ShardedGymClient(clients, GroupRouter(shards), launch, max_restarts)
            env = NemoGymEnvironment(client, max_seq_len=64)
            env_rows = [
                {
                    **problem_row(f"Q: {a}+{b}=? A:", str(a + b)),
                    "_ng_environment_server": GymStandIn.ENVIRONMENT_SERVER,
                }
                for a, b in ((1, 2), (5, 6), (3, 4))
            ]  # replicas 0, 1, 0
            agent_row = {**problem_row("Q: 2+2=? A:", "4"), "agent_ref": {"name": GymStandIn.AGENT}}
            try:
                out = env.rollouts([*env_rows, agent_row], sampling=sampling, repeat=2)
            except Exception as err:  # noqa: BLE001 -- the test reads it
                out = err
            _, metrics = env.global_post_process_and_metrics({})
        finally:
            launch.shutdown()
    assert killed.is_set()
    return out, metrics, launch.restarted


def test_a_shard_replica_killed_mid_step_is_restarted_and_its_groups_retried_once():
    batch, metrics, restarted = _dying_shards_run()
    # every episode came back, the killed replica's group from its restarted instance
    assert batch["rewards"].tolist() == [1.0] * 8 and batch["sample_mask"].all()
    assert restarted == [("env", 1)]
    assert metrics["gym/shard/env/restarts"] == 1.0
    assert metrics["gym/shard/env/retried_groups"] == 1.0  # the one group replica 1 held
    assert metrics["gym/shard/agent/restarts"] == 0.0
    assert metrics["gym/shard/env/replica_1_groups"] == 1.0  # counted once, not per try
    # the dead instance's failed tries count with its shard's retries (its client is replaced)
    assert metrics["gym/shard/env/retries"] >= 1.0 and metrics["gym/retries"] >= 1.0


def test_a_replica_that_dies_again_after_its_restart_fails_the_step_naming_it():
    err, _, restarted = _dying_shards_run(dies_again=[("env", 1)])
    assert restarted == [("env", 1)]  # retried once, not again
    assert isinstance(err, GymServerError)
    assert "shard 'env' replica 1" in str(err) and "failed again" in str(err)


def test_with_no_restarts_left_a_dead_replica_fails_the_step_naming_the_budget():
    err, _, restarted = _dying_shards_run(max_restarts=0)
    assert restarted == [] and isinstance(err, GymServerError)
    assert "shard 'env' replica 1" in str(err) and "shard_restarts=0" in str(err)


def test_shard_restarts_without_shards_is_refused():
    with pytest.raises(ValueError, match="shard_restarts=5 is read only with env.nemo_gym.shards"):
        NemoGymConfig(config_paths=["x.yaml"], shard_restarts=5)
