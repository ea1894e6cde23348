"""NeMo Gym split over several Ray actors: shards, replicas, and which rows go where.

One Gym config (``env.nemo_gym.config_paths``) can be split into shards
(``env.nemo_gym.shards``): each shard *claims* Gym entries by instance name (the agents or
environment servers rows name, or resources servers) and runs them in a Gym of its own, a
`NemoGymLauncher` actor with its own head server; ``replicas: N`` runs N identical copies.

    env:
      nemo_gym:
        config_paths: [.../example_single_tool_call.yaml, .../lc.yaml]
        shards:
          - {name: tools, entries: [example_single_tool_call_simple_agent]}
          - {name: arith, entries: [lc_equivalence_rule_environment_server], replicas: 2,
             extra_config: {lc_equivalence_rule: {resources_servers: {equivalence_rule:
                                                    {grading_rule: exact}}}}}

- **Claims** (`claims`): an entry belongs to exactly one shard; claiming it twice is refused
  at config load. A shard hosts what it claims plus what that needs (`hosted_entries`): every
  server its entries reference (resources server, policy model), the agents of a claimed
  resources server and the environment servers in front of a hosted agent. A dependency two
  shards need (the policy model, a shared resources server) runs in each of them.
- **Rows** (`row_target`, `check_rows_hosted`): a row goes to the shard claiming its
  ``_ng_environment_server``, else its ``agent_ref.name``, else its ``task_source``, else
  ``env.nemo_gym.default_route``. A row whose target no shard claims is refused before Ray
  starts, naming the row, the target, every shard's entries and the fix.
- **Replicas** (`GroupRouter`): each prompt group (the ``repeat`` copies of one row) goes to
  one replica of its shard, round-robin per shard across steps, so a group's samples share a
  server and replicas share the load; counted per shard and per replica.
- **Ports** (`instance_ports`): instance ``k`` (shards in order, replicas within) has head
  port ``head_server_port + k`` and the ``k``-th slice of Gym's server port range, so
  instances starting at the same time cannot pick the same port.

Standard library only: the launcher imports it inside Gym's own venv.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.utils.gym_shards import (  # the shards as declared; re-exported here
    GymShard,
    GymShardError,
    claims,
    describe,
    instance_names,
    instance_ports,
    placement_strategy,
)

__all__ = [
    "GymShardError",
    "GroupRouter",
    "GymShard",
    "claims",
    "check_rows_hosted",
    "hosted_entries",
    "instance_names",
    "instance_ports",
    "placement_strategy",
    "row_target",
    "server_entries",
]

SERVER_KINDS = ("resources_servers", "responses_api_agents", "responses_api_models",
                "environment_servers")  # fmt: skip


def row_target(row: Mapping[str, Any], default_route: str | None) -> str | None:
    """The Gym entry a row is sent to, for choosing its shard (see the module docstring)."""
    if row.get("_ng_environment_server"):
        return str(row["_ng_environment_server"])
    ref = row.get("agent_ref")
    if isinstance(ref, Mapping) and ref.get("name"):
        return str(ref["name"])
    if row.get("task_source"):
        return str(row["task_source"])
    return default_route


def check_rows_hosted(
    rows: Iterable[Mapping[str, Any]],
    shards: Sequence[GymShard],
    default_route: str | None,
    source: str = "the data",
) -> None:
    """ValueError naming the first rows (by index) whose target no shard claims, the
    targets, the shards and the fix; nothing where every row has a host."""
    owner = claims(shards)
    missing: dict[str | None, list[int]] = {}
    for i, row in enumerate(rows):
        target = row_target(row, default_route)
        if target not in owner:
            missing.setdefault(target, []).append(i)
    if not missing:
        return
    lines = []
    for target, where in missing.items():
        rows_text = ", ".join(map(str, where[:5])) + (" ..." if len(where) > 5 else "")
        what = f"agent {target!r}" if target else "no routing field and no default_route"
        lines.append(f"{what}: {len(where)} row(s) of {source} (row {rows_text})")
    named = sorted(t for t in missing if t)
    fix = (
        f"add {named} to a shard's entries (env.nemo_gym.shards[i].entries)"
        if named
        else "give the rows an agent_ref or set env.nemo_gym.default_route"
    )
    raise GymShardError(
        "NeMo Gym rows whose agent no shard hosts: " + "; ".join(lines)
        + f". The shards host {describe(shards)}. Fix: {fix}, or drop those rows"
    )  # fmt: skip


# ---------------------------------------------------------------- inside a shard's Gym
def server_entries(config: Mapping[str, Any]) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """Instance name -> (server kind, its config) in Gym's merged global config."""
    out = {}
    for name, value in config.items():
        if not isinstance(value, Mapping) or len(value) != 1:
            continue
        ((kind, impls),) = value.items()
        if kind in SERVER_KINDS and isinstance(impls, Mapping) and len(impls) == 1:
            (conf,) = impls.values()
            if isinstance(conf, Mapping):
                out[str(name)] = (kind, conf)
    return out


def _references(value: Any) -> set[str]:
    """Names of every server reference (``{type: <kind>, name: ...}``) inside `value`."""
    if isinstance(value, Mapping):
        found = set()
        if value.get("type") in SERVER_KINDS and isinstance(value.get("name"), str):
            found.add(value["name"])
        for item in value.values():
            found |= _references(item)
        return found
    if isinstance(value, list | tuple):
        return set().union(*(_references(v) for v in value)) if value else set()
    return set()


def _ref_name(conf: Mapping[str, Any], key: str) -> str | None:
    ref = conf.get(key)
    return ref.get("name") if isinstance(ref, Mapping) else None


def hosted_entries(config: Mapping[str, Any], claimed: Sequence[str], shard: str) -> list[str]:
    """The server instances a shard claiming `claimed` runs, in config order (see the module
    docstring); ValueError naming the shard and Gym's entries when one it claims is not in
    the config."""
    servers = server_entries(config)
    unknown = [e for e in claimed if e not in servers]
    if unknown:
        known = sorted(n for n, (k, _) in servers.items() if k != "responses_api_models")
        raise GymShardError(
            f"env.nemo_gym.shards {shard!r} claims {unknown}, which the Gym config "
            f"(env.nemo_gym.config_paths) does not define; its entries: {known}"
        )
    hosted = set(claimed)
    for name, (kind, conf) in servers.items():  # the agents of a claimed resources server
        if kind == "responses_api_agents" and _ref_name(conf, "resources_server") in claimed:
            hosted.add(name)
    while True:
        grown = set(hosted)
        for name in hosted:
            grown |= _references(servers[name][1]) & servers.keys()
        for name, (kind, conf) in servers.items():  # environment servers in front
            if kind == "environment_servers" and _ref_name(conf, "agent_server") in grown:
                grown.add(name)
        if grown == hosted:
            break
        hosted = grown
    return [n for n in servers if n in hosted]


# -------------------------------------------------------------------- instances, groups
@dataclass
class GroupRouter:
    """Which instance runs each prompt group: the shard claiming its target, then that
    shard's replicas in turn (the turn carries over from step to step)."""

    shards: Sequence[GymShard]
    default_route: str | None = None
    _owner: dict[str, str] = field(init=False, repr=False)
    _turn: Counter[str] = field(default_factory=Counter, init=False, repr=False)
    _replicas: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._owner = claims(self.shards)
        self._replicas = {s.name: s.replicas for s in self.shards}

    def shard_of(self, row: Mapping[str, Any]) -> str:
        """The shard claiming the row's target; ValueError (`check_rows_hosted`'s) if none."""
        target = row_target(row, self.default_route)
        shard = self._owner.get(target) if target else None
        if shard is None:  # refused before Ray for the data; here for rows built later
            check_rows_hosted([row], self.shards, self.default_route, "this batch")
            raise AssertionError(target)  # check_rows_hosted raised
        return shard

    def assign(self, rows: Sequence[Mapping[str, Any]], group_size: int) -> list[tuple[str, int]]:
        """(shard, replica) for every row; rows ``k*group_size .. (k+1)*group_size - 1`` are
        one group and share an instance."""
        if group_size < 1 or len(rows) % group_size:
            raise ValueError(f"{len(rows)} rows are not whole groups of {group_size}")
        out: list[tuple[str, int]] = []
        for start in range(0, len(rows), group_size):
            shard = self.shard_of(rows[start])
            replica = self._turn[shard] % self._replicas[shard]
            self._turn[shard] += 1
            out += [(shard, replica)] * group_size
        return out
