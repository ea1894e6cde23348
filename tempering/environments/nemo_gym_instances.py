"""The Gyms a run launches, and the client over several of them (`env.nemo_gym.shards`).

- `LaunchedGym` starts one Gym, or one per shard replica, each in a `NemoGymLauncher` Ray
  actor under Gym's own venv; every instance is its own process group (the actor and the
  servers Gym starts under it), so `kill` and `restart` take the whole instance down, servers
  included, and `restart` starts it again with the arguments it was first started with
  (same head port and server port range).
- `build_nemo_gym_environment` turns ``env.nemo_gym`` into the environment (launching Gym
  first in launch mode); with shards, its client is a `ShardedGymClient`.
- `ShardedGymClient` sends each prompt group to a replica of the shard claiming its target
  (`nemo_gym_shards.GroupRouter`), every instance's rows in flight at once. An instance whose
  servers cannot be reached mid-step (`GymUnreachableError`: connections refused or reset,
  timeouts, 5xx after the client's retries) is restarted and its in-flight groups are sent
  again, once, while ``env.nemo_gym.shard_restarts`` lasts; each restart and each retried
  group is counted (``gym/shard/<name>/restarts``, ``.../retried_groups``). A second failure,
  or one past the budget, is an error naming the instance; nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.environments.nemo_gym import (
    LAUNCHER_FQN,
    GymServerError,
    GymUnreachableError,
    NemoGymClient,
    NemoGymEnvironment,
)
from tempering.utils import faults

log = logging.getLogger(__name__)

__all__ = ["LaunchedGym", "ShardedGymClient", "build_nemo_gym_environment"]

Instance = tuple[str, int]  # (shard, replica)


@dataclass(eq=False)
class ShardedGymClient:
    """Several launched Gyms behind `NemoGymClient`'s methods (see the module docstring).
    `launched` (a `LaunchedGym` whose instances are `clients`' keys in order) restarts a dead
    instance; without it a dead instance fails the step."""

    clients: dict[Instance, NemoGymClient]
    router: Any  # nemo_gym_shards.GroupRouter
    launched: Any = None
    max_restarts: int = 0
    stats: Counter[str] = field(default_factory=Counter, init=False)
    restarts_left: int = field(init=False)
    _counts: Counter[str] = field(default_factory=Counter, init=False, repr=False)

    def __post_init__(self) -> None:
        self.restarts_left = self.max_restarts

    @property
    def head_server_url(self) -> str:
        return ", ".join(c.head_server_url for c in self.clients.values())

    def wait_ready(self, timeout_s: float) -> None:
        import time

        deadline = time.monotonic() + timeout_s  # one deadline for every instance
        for client in self.clients.values():
            client.wait_ready(max(deadline - time.monotonic(), 1.0))

    def route(self, row: dict[str, Any]) -> tuple[str, str]:
        """(agent name for metrics, /run URL on the shard's first replica) for `row`."""
        return self.clients[(self.router.shard_of(row), 0)].route(row)

    def run(self, rows: Sequence[dict[str, Any]], group_size: int = 1) -> list[dict[str, Any]]:
        by_instance: dict[Instance, list[int]] = defaultdict(list)
        for i, key in enumerate(self.router.assign(rows, group_size)):
            by_instance[key].append(i)
        for (shard, replica), idx in by_instance.items():
            self._counts[f"gym/shard/{shard}/samples"] += len(idx)
            self._counts[f"gym/shard/{shard}/groups"] += len(idx) // group_size
            self._counts[f"gym/shard/{shard}/replica_{replica}_groups"] += len(idx) // group_size
            if self.launched is not None:  # the reliability tests' "an instance dies" hook
                faults.maybe_fault(f"gym_{shard}_{replica}", "rollout",
                                   fire=lambda key=(shard, replica): self.launched.kill(key))  # fmt: skip
        batches = {key: [rows[i] for i in idx] for key, idx in by_instance.items()}
        try:
            answers = self._post(batches, return_exceptions=True)
            for key, answer in list(answers.items()):
                if isinstance(answer, GymUnreachableError):
                    answers[key] = self._restart_and_retry(key, batches[key], group_size, answer)
                elif isinstance(answer, BaseException):
                    raise answer
        finally:
            self._collect_stats()
        results: list[dict[str, Any]] = [{}] * len(rows)
        for key, idx in by_instance.items():
            for i, result in zip(idx, answers[key], strict=True):
                results[i] = result
        return results

    def _post(
        self, batches: dict[Instance, list[dict[str, Any]]], return_exceptions: bool
    ) -> dict[Instance, Any]:
        """Every instance's rows at once; its answers (or, with `return_exceptions`, the
        error it raised) by instance."""
        from tempering.utils.aio import run_async

        # routed here, not on the loop: `route` may fetch Gym's config, which waits on it
        urls = {key: [self.clients[key].route(r)[1] for r in b] for key, b in batches.items()}

        async def every_instance() -> list[Any]:
            return list(await asyncio.gather(*(
                self.clients[key].post_rows(batch, urls[key]) for key, batch in batches.items()
            ), return_exceptions=return_exceptions))  # fmt: skip

        return dict(zip(batches, run_async(every_instance()), strict=True))

    def _restart_and_retry(
        self, key: Instance, rows: list[dict[str, Any]], group_size: int, err: Exception
    ) -> list[Any]:
        """Restart the instance `key` and send its rows once more (see the module docstring)."""
        shard, replica = key
        where = f"NeMo Gym shard {shard!r} replica {replica}"
        if self.launched is None or self.restarts_left <= 0:
            budget = ("it is not one tempering launched" if self.launched is None else
                      f"env.nemo_gym.shard_restarts={self.max_restarts} are used up")  # fmt: skip
            raise GymServerError(f"{where} failed mid-step and {budget}: {err}") from err
        self.restarts_left -= 1
        log.warning("%s failed mid-step (%s); restarting it and retrying its %d group(s) once",
                    where, err, len(rows) // group_size)  # fmt: skip
        old = self.clients[key]
        self.clients[key] = dataclasses.replace(old, head_server_url=self.launched.restart(key))
        self._counts[f"gym/shard/{shard}/restarts"] += 1
        self._counts[f"gym/shard/{shard}/retried_groups"] += len(rows) // group_size
        self._take_stats(shard, old)  # the dead instance's retries count with its shard's
        try:
            self.clients[key].wait_ready(self.launched.timeout_s)
            return self._post({key: rows}, return_exceptions=False)[key]
        except GymServerError as again:
            raise GymServerError(
                f"{where} failed mid-step, was restarted, and its {len(rows) // group_size} "
                f"group(s) failed again: {again}. Its log: {self.launched.work_dir_of(key)}"
            ) from again

    def _collect_stats(self) -> None:
        for (shard, _), client in self.clients.items():
            self._take_stats(shard, client)

    def _take_stats(self, shard: str, client: NemoGymClient) -> None:
        """Move `client`'s counters into this step's: the shard's retries and the total."""
        self._counts[f"gym/shard/{shard}/retries"] += client.stats["retries"]
        self.stats += client.stats
        client.stats.clear()

    def take_metrics(self) -> dict[str, float]:
        """Every shard's and replica's counts since the last call, zeros included."""
        out: dict[str, float] = {}
        for shard, replica in self.clients:
            for key in ("samples", "groups", "retries", "restarts", "retried_groups"):
                out[f"gym/shard/{shard}/{key}"] = float(self._counts[f"gym/shard/{shard}/{key}"])
            key = f"gym/shard/{shard}/replica_{replica}_groups"
            out[key] = float(self._counts[key])
        self._counts.clear()
        return out


# ---------------------------------------------------------------------------- launching
@dataclass
class _Spec:
    """How one instance was started: enough to start it again."""

    key: tuple[str | None, int]
    work_dir: str
    strategy: Any
    args: tuple[Any, ...]


class LaunchedGym:
    """Gyms started for this run, each by a `NemoGymLauncher` actor in Gym's own venv: one,
    or one per shard replica (`env.nemo_gym.shards`)."""

    def __init__(
        self, actors: list[Any], head_urls: list[str], group: Any = None,
        specs: Sequence[_Spec] = (), python: str = "", timeout_s: float = 600.0,
        processes: Sequence[tuple[str, int]] = (),
    ) -> None:  # fmt: skip
        self.actors, self.head_urls, self.group = actors, head_urls, group
        self.specs, self.python, self.timeout_s = list(specs), python, timeout_s
        self.processes = list(processes)  # (node id, process group) of each instance

    @property
    def head_url(self) -> str:
        return self.head_urls[0]

    @classmethod
    def start(
        cls,
        *,
        work_dir: str,
        config_paths: list[str],
        policy_base_urls: list[str],
        policy_model_name: str,
        policy_api_key: str,
        head_port: int,
        extra_config: dict[str, Any],
        prebuilt_server_venvs: bool,
        timeout_s: float,
        shards: Sequence[Any] = (),
        num_nodes: int = 1,
    ) -> LaunchedGym:
        """Start Gym (`shards` empty) or every shard's replicas, all within `timeout_s`."""
        import ray

        from tempering.distributed.actor_environments import get_actor_executable, resolve_python
        from tempering.environments.nemo_gym_shards import (
            instance_names,
            instance_ports,
            placement_strategy,
        )

        python = resolve_python(LAUNCHER_FQN, get_actor_executable(LAUNCHER_FQN))
        names = instance_names(shards) if shards else [(None, 0)]
        ports = instance_ports(head_port, shards) if shards else [(head_port, None)]
        by_name = {s.name: s for s in shards}
        strategies, group = _gym_placement(placement_strategy(len(names), num_nodes), len(names))
        ray_address = ray.get_runtime_context().gcs_address
        specs = []
        for (shard, replica), (port, port_range), strategy in zip(
            names, ports, strategies, strict=True
        ):
            spec = by_name.get(shard)
            extra = {**extra_config, **(dict(spec.extra_config) if spec else {})}
            specs.append(_Spec(
                (shard, replica), work_dir if shard is None else f"{work_dir}/{shard}_{replica}",
                strategy,
                (config_paths, policy_base_urls, policy_model_name, policy_api_key, ray_address,
                 port, extra, prebuilt_server_venvs, shard,
                 list(spec.entries) if spec else None, port_range,
                 [p for p, _ in ports] if shards else None, group is not None),
            ))  # fmt: skip
        actors = [_actor(python, s) for s in specs]
        try:
            starts = [a.start.remote(*s.args) for a, s in zip(actors, specs, strict=True)]
            head_urls = ray.get(starts, timeout=timeout_s)
            processes = ray.get([a.process.remote() for a in actors], timeout=60)
        except BaseException as err:
            for actor in actors:
                ray.kill(actor)
            if group is not None:
                ray.util.remove_placement_group(group)
            if isinstance(err, ray.exceptions.GetTimeoutError):
                raise TimeoutError(
                    f"NeMo Gym ({len(names)} instance(s)) did not come up within "
                    f"env.nemo_gym.startup_timeout_s={timeout_s:.0f} s (config files "
                    f"{config_paths}); see {work_dir}"
                ) from None
            raise
        log.info("NeMo Gym is up: head server(s) %s (venv %s)", ", ".join(head_urls), python)
        return cls(actors, head_urls, group, specs, python, timeout_s, processes)

    def _index(self, key: Instance) -> int:
        return [s.key for s in self.specs].index(key)

    def work_dir_of(self, key: Instance) -> str:
        return self.specs[self._index(key)].work_dir

    def kill(self, key: Instance) -> None:
        """SIGKILL the instance's whole process group (its actor and every Gym server), as
        the OOM killer would; the actor is then gone too."""
        node, pgid = self.processes[self._index(key)]
        _kill_group(node, pgid)

    def restart(self, key: Instance) -> str:
        """Kill what is left of the instance and start it again as first started; its head
        URL once it is up (within env.nemo_gym.startup_timeout_s)."""
        import ray

        k = self._index(key)
        self.kill(key)
        ray.kill(self.actors[k])
        spec = self.specs[k]
        actor = _actor(self.python, spec)
        try:
            url = ray.get(actor.start.remote(*spec.args), timeout=self.timeout_s)
            self.processes[k] = ray.get(actor.process.remote(), timeout=60)
        except BaseException:
            ray.kill(actor)
            raise
        self.actors[k], self.head_urls[k] = actor, url
        log.info("NeMo Gym instance %s restarted: %s", key, url)
        return url

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=120)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)


def _actor(python: str, spec: _Spec) -> Any:
    import ray

    from tempering.environments.nemo_gym_launcher import NemoGymLauncher

    return (
        ray.remote(num_cpus=0, max_restarts=0)(NemoGymLauncher)
        .options(runtime_env={"py_executable": python}, scheduling_strategy=spec.strategy)
        .remote(spec.work_dir)
    )


def _kill_group(node_id: str, pgid: int) -> None:
    """SIGKILL process group `pgid` on node `node_id` (here, or by a task pinned there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id == ray.get_runtime_context().get_node_id():
        _signal_group(pgid)
        return
    here = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    ray.get(ray.remote(num_cpus=0)(_signal_group).options(scheduling_strategy=here).remote(pgid))


def _signal_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already


def _gym_placement(strategy: str | None, n: int) -> tuple[list[Any], Any]:
    """Ray scheduling strategies for `n` Gym actors, and the placement group holding them:
    on one node, all on the driver's (where Gym's venv was built); on several, one bundle
    each under `strategy` (STRICT_SPREAD: one instance per node)."""
    import ray
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    if strategy is None:
        here = ray.get_runtime_context().get_node_id()
        return [NodeAffinitySchedulingStrategy(node_id=here, soft=False)] * n, None
    group = ray.util.placement_group([{"CPU": 0.01}] * n, strategy=strategy)
    ray.get(group.ready(), timeout=120)
    return [PlacementGroupSchedulingStrategy(group, k) for k in range(n)], group


# ---------------------------------------------------------------------------- builder
def build_nemo_gym_environment(
    gym: Any,
    *,
    policy_base_url: str,
    policy_model_name: str,
    policy_api_key: str | None,
    max_seq_len: int,
    pad_token_id: int,
    work_dir: str,
    num_nodes: int = 1,
) -> NemoGymEnvironment:
    """`env.nemo_gym` (a NemoGymConfig) -> the environment; launches Gym in launch mode (one
    instance per shard replica with `shards`, placed over `num_nodes` nodes)."""
    from tempering.config.rl_sections import gym_shards
    from tempering.environments.nemo_gym_shards import GroupRouter

    launched = None
    head = gym.head_server_url
    shards = gym_shards(gym)
    spread = bool(shards) and num_nodes > 1  # instances on other nodes: reachable addresses
    _check_launch(gym, policy_base_url, spread, num_nodes)
    common = dict(
        default_route=gym.default_route,
        concurrency=gym.concurrency,
        request_timeout_s=gym.request_timeout_s,
        max_retries=gym.max_retries,
        retry_backoff_s=gym.retry_backoff_s,
    )
    if gym.config_paths:
        launched = LaunchedGym.start(
            work_dir=work_dir,
            config_paths=list(gym.config_paths),
            policy_base_urls=[policy_base_url],
            policy_model_name=policy_model_name,
            policy_api_key=policy_api_key or "none",  # Gym's OpenAI client needs some key
            head_port=gym.head_server_port,
            extra_config=dict(gym.extra_config),
            prebuilt_server_venvs=gym.prebuilt_server_venvs,
            timeout_s=gym.startup_timeout_s,
            shards=shards,
            num_nodes=num_nodes if spread else 1,
        )
        head = launched.head_url
    client: Any
    if shards:
        from tempering.environments.nemo_gym_shards import instance_names

        urls = dict(zip(instance_names(shards), launched.head_urls, strict=True))  # type: ignore[union-attr]
        client = ShardedGymClient(
            {key: NemoGymClient(url, **common) for key, url in urls.items()},  # type: ignore[arg-type]
            GroupRouter(shards, gym.default_route),
            launched,
            max_restarts=gym.shard_restarts,
        )
    else:
        client = NemoGymClient(head, **common)  # type: ignore[arg-type]
    client.wait_ready(gym.startup_timeout_s)  # attach mode: Gym may still be starting
    return NemoGymEnvironment(
        client,
        max_seq_len=max_seq_len,
        on_noncontiguous=gym.on_noncontiguous,
        pad_token_id=pad_token_id,
        launcher=launched,
    )


def _check_launch(gym: Any, policy_base_url: str, spread: bool, num_nodes: int) -> None:
    """What launch mode refuses before any Gym starts: an https generation server, and shards
    spread over nodes (`spread`) while the generation server listens on loopback."""
    from urllib.parse import urlparse

    if gym.config_paths and policy_base_url.startswith("https://"):
        raise ValueError(
            f"env.nemo_gym.config_paths (launch mode) with the generation server on https "
            f"({policy_base_url}): Gym's model server cannot be handed our CA, so it would "
            "refuse the certificate. Gym runs on this node: serve the generation server on "
            "127.0.0.1 without policy.generation.http_server.ssl_certfile/ssl_keyfile, or run "
            "Gym yourself (env.nemo_gym.head_server_url) with SSL_CERT_FILE naming the CA"
        )
    if spread and urlparse(policy_base_url).hostname in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(
            f"env.nemo_gym.shards over cluster.num_nodes={num_nodes} nodes, and the generation "
            f"server listens on loopback ({policy_base_url}): Gym's model servers on other "
            "nodes could not reach it. Set policy.generation.http_server.host to this node's "
            "address (with an api_key), or cluster.num_nodes=1"
        )
