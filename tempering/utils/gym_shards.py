"""NeMo Gym shards as the config declares them (`env.nemo_gym.shards`): what each claims, the
instances they make, their ports and placement. Pure and standard-library only, so the config
checks it at load and the planner places it (tempering/environments/nemo_gym_shards.py routes
rows and groups over them; its docstring tells the whole story).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.errors import UserInputError

__all__ = [
    "GYM_PORT_RANGE",
    "GymShard",
    "GymShardError",
    "claims",
    "describe",
    "instance_names",
    "instance_ports",
    "placement_strategy",
]

# Gym spreads servers over this range by default (nemo_gym.global_config)
GYM_PORT_RANGE = (10_001, 20_000)


class GymShardError(ValueError, UserInputError):
    """Shards that claim an entry twice, or rows that no shard hosts; names the fix."""


@dataclass(frozen=True)
class GymShard:
    """One shard: the Gym entries it claims, its copies, its own overrides of Gym's config
    (merged over ``env.nemo_gym.extra_config``)."""

    name: str
    entries: tuple[str, ...]
    replicas: int = 1
    extra_config: Mapping[str, Any] = field(default_factory=dict)


def claims(shards: Sequence[GymShard]) -> dict[str, str]:
    """Entry -> the shard claiming it; ValueError where a shard name repeats or an entry is
    claimed twice (by one shard or by two), naming them."""
    problems: list[str] = []
    names = Counter(s.name for s in shards)
    problems += [f"shard name {n!r} is used {k} times" for n, k in names.items() if k > 1]
    owner: dict[str, str] = {}
    for shard in shards:
        for entry in shard.entries:
            if entry in owner:
                by = (
                    f"shard {shard.name!r} twice"
                    if owner[entry] == shard.name
                    else f"shards {owner[entry]!r} and {shard.name!r}"
                )
                problems.append(f"entry {entry!r} is claimed by {by}")
            else:
                owner[entry] = shard.name
    if problems:
        raise GymShardError(
            "env.nemo_gym.shards: " + "; ".join(problems) + " (each Gym entry belongs to "
            "exactly one shard: name it once, and use replicas: N for copies)"
        )
    return owner


def describe(shards: Sequence[GymShard]) -> str:
    """``tools: [a, b]; arith (2 replicas): [c]``, for messages."""
    return "; ".join(
        f"{s.name}{f' ({s.replicas} replicas)' if s.replicas > 1 else ''}: {list(s.entries)}"
        for s in shards
    )


def instance_names(shards: Sequence[GymShard]) -> list[tuple[str, int]]:
    """(shard, replica index) for every Gym instance, in start order."""
    return [(s.name, r) for s in shards for r in range(s.replicas)]


def instance_ports(head_port: int, shards: Sequence[GymShard]) -> list[tuple[int, tuple[int, int]]]:
    """(head port, (server port low, high)) per instance (see the module docstring)."""
    n = len(instance_names(shards))
    low, high = GYM_PORT_RANGE
    width = (high - low + 1) // n
    return [(head_port + k, (low + k * width, low + (k + 1) * width - 1)) for k in range(n)]


def placement_strategy(instances: int, num_nodes: int) -> str | None:
    """How the Gym actors are placed: None (all on the driver's node, where Gym's venv is)
    on one node; on several, STRICT_SPREAD (one instance per node) where there are nodes
    enough, else SPREAD."""
    if num_nodes <= 1:
        return None
    return "STRICT_SPREAD" if instances <= num_nodes else "SPREAD"
