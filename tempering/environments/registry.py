"""Which environment scores which task, and routing a mixed batch to them.

`ENVIRONMENT_REGISTRY` is the one literal map from task name (a dataset row's ``task_name``)
to environment class; plugins add theirs with `register_environment`. `route_step` splits a
batch by task name, calls each task's environment (a plain instance or a Ray actor handle;
actors are called concurrently) and reassembles the results in the original sample order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tempering.environments.actors import actor_class, from_wire
from tempering.environments.arithmetic import ArithmeticEnvironment, ArithmeticRetryEnvironment
from tempering.environments.calculator import CalculatorEnvironment
from tempering.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog
from tempering.environments.math import MathEnvironment
from tempering.environments.reward_fn import RewardFunctionEnvironment
from tempering.environments.reward_model import RewardModelEnvironment

__all__ = [
    "ENVIRONMENT_REGISTRY",
    "correct_above",
    "create_environment",
    "create_environment_actor",
    "get_environment_class",
    "offered_tools",
    "register_environment",
    "route_step",
]

ENVIRONMENT_REGISTRY: dict[str, type[EnvironmentInterface]] = {
    "math": MathEnvironment,
    "arithmetic": ArithmeticEnvironment,
    "arithmetic_retry": ArithmeticRetryEnvironment,
    "calculator": CalculatorEnvironment,
    "reward_fn": RewardFunctionEnvironment,
    "reward_model": RewardModelEnvironment,
}


def register_environment(
    name: str, cls: type[EnvironmentInterface], overwrite: bool = False
) -> None:
    """Add an environment class under task name `name`."""
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(
            f"register_environment('{name}', {cls!r}): not an EnvironmentInterface subclass."
        )
    if name in ENVIRONMENT_REGISTRY and not overwrite and ENVIRONMENT_REGISTRY[name] is not cls:
        raise ValueError(
            f"Environment '{name}' is already registered to {ENVIRONMENT_REGISTRY[name].__name__}; "
            f"pick another name or pass overwrite=True."
        )
    ENVIRONMENT_REGISTRY[name] = cls


def get_environment_class(name: str) -> type[EnvironmentInterface]:
    try:
        return ENVIRONMENT_REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"No environment registered for task '{name}'; known: {sorted(ENVIRONMENT_REGISTRY)}. "
            f"Add one with tempering.environments.registry.register_environment()."
        ) from None


def offered_tools(name: str) -> list[dict[str, Any]] | None:
    """The OpenAI tool specs a task's environment offers the model (its class attribute
    ``tools``), or None when it offers none or no environment is registered as ``name``."""
    cls = ENVIRONMENT_REGISTRY.get(name)
    tools = getattr(cls, "tools", None) if cls is not None else None
    return list(tools) if tools else None


def correct_above(name: str) -> float | None:
    """The reward above which the environment registered as ``name`` counts an answer
    correct (its class attribute ``correct_above``; None: its rewards are scores). Tasks
    without a registered class (NeMo Gym's, whose verifiers reward 0 or 1) count 0.5."""
    cls = ENVIRONMENT_REGISTRY.get(name)
    return cls.correct_above if cls is not None else 0.5


def create_environment(name: str, **kwargs: Any) -> EnvironmentInterface:
    """A plain (in-process) instance of the environment registered as `name`."""
    return get_environment_class(name)(**kwargs)


def create_environment_actor(name: str, **kwargs: Any) -> Any:
    """The environment registered as `name`, started as a Ray actor with ``num_cpus=0``."""
    import ray

    return ray.remote(num_cpus=0)(actor_class(get_environment_class(name))).remote(**kwargs)


def route_step(
    environments: Mapping[str, Any],
    message_logs: Sequence[MessageLog],
    metadata: Sequence[dict[str, Any]],
    task_names: Sequence[str],
) -> EnvironmentReturn:
    """Call each sample's environment (by task name) and return results in input order.

    `environments` maps task name to a plain environment or a Ray actor handle.
    """
    if not len(message_logs) == len(metadata) == len(task_names):
        raise ValueError(
            f"route_step got {len(message_logs)} message logs, {len(metadata)} metadata "
            f"entries and {len(task_names)} task names; they must be equal."
        )
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(task_names):
        groups.setdefault(name, []).append(i)
    missing = sorted(set(groups) - set(environments))
    if missing:
        raise KeyError(
            f"No environment for task(s) {missing}; environments given: {sorted(environments)}."
        )

    pending: dict[str, Any] = {}
    for name, idx in groups.items():
        env = environments[name]
        logs = [message_logs[i] for i in idx]
        metas = [metadata[i] for i in idx]
        step = env.step
        pending[name] = step.remote(logs, metas) if hasattr(step, "remote") else step(logs, metas)
    refs = {n: r for n, r in pending.items() if not isinstance(r, EnvironmentReturn)}
    if refs:
        import ray

        from tempering.distributed.deadlines import DeadlineExceeded, deadline_s

        limit = deadline_s("environment")
        try:
            pending.update(zip(refs, ray.get(list(refs.values()), timeout=limit), strict=True))
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(
                f"phase 'environment': an environment actor of {sorted(refs)} died during "
                f"step() (killed, out of memory, or a crash in native code); Ray says: {exc}"
            ) from None
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceeded(
                f"phase 'environment': environment(s) {sorted(refs)} did not return step() "
                f"within {limit:g} s. If they are only slow, raise deadlines.environment_s; "
                "otherwise an environment actor is hung (its log is under the Ray session's "
                "logs/ folder).",
                phase="environment",
                ranks=[],
                stack_files=[],
            ) from None

    n = len(task_names)
    observations: list[Any] = [None] * n
    metas_out: list[Any] = [None] * n
    stops: list[Any] = [None] * n
    answers: list[Any] = [None] * n
    rewards = torch.zeros(n, dtype=torch.float32)
    terminateds = torch.zeros(n, dtype=torch.bool)
    for name, idx in groups.items():
        ret: EnvironmentReturn = pending[name]
        if len(ret.rewards) != len(idx):
            raise RuntimeError(
                f"Environment for task '{name}' returned {len(ret.rewards)} rewards for "
                f"{len(idx)} samples."
            )
        for j, i in enumerate(idx):
            observations[i] = ret.observations[j]
            metas_out[i] = ret.metadata[j]
            stops[i] = ret.next_stop_strings[j]
            answers[i] = ret.answers[j]
        position = torch.tensor(idx, dtype=torch.long)
        # a tensor, a list, or the numpy an actor sends (read-only: from_wire copies it)
        rewards[position] = torch.as_tensor(from_wire(ret.rewards), dtype=torch.float32)
        terminateds[position] = torch.as_tensor(from_wire(ret.terminateds), dtype=torch.bool)
    return EnvironmentReturn(observations, metas_out, stops, rewards, terminateds, answers)
