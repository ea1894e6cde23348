"""What scores a GRPO run, and what its rewards mean.

`build_environments` starts one environment actor per task in the data (a reward model or
custom reward functions replacing them all), `build_gym` the NeMo Gym environment;
`reward_threshold` reads which rewards are correct answers from the scorers'
``correct_above`` (None: the rewards are scores, and the run reports its mean reward, not an
accuracy), `checkpoint_ranking` keeps `keep_top_k` meaningful then, and
`environment_metrics` collects each environment's own counters once a step.
"""

from __future__ import annotations

import logging
from typing import Any

from tempering.config.schemas import GRPOMasterConfig

log = logging.getLogger("tempering.algorithms.grpo")  # one logger for the run's messages


def build_environments(cfg: GRPOMasterConfig, task_names: set[str]) -> dict[str, Any]:
    """One environment actor per task name in the data (plus a custom reward fn if set)."""
    from tempering.environments.registry import create_environment_actor

    m = cfg.env.math
    math = {
        "num_workers": m.num_workers,
        "timeout_s": m.timeout_s,
        "memory_limit_mb": m.memory_limit_mb,  # each sandboxed verifier process
        "cpu_limit_s": m.cpu_limit_s,
        "max_error_rate": m.max_error_rate,
    }
    kwargs: dict[str, dict[str, Any]] = {
        "math": math,
        "arithmetic_retry": cfg.env.arithmetic_retry.model_dump(),
        "calculator": {**math, "max_tool_calls": cfg.env.calculator.max_tool_calls},
        "reward_model": {"reward_model_path": cfg.env.reward_model_path},
        "reward_fn": {"reward_fn": cfg.env.reward_fn, "weights": cfg.env.reward_weights,
                      "conversational": cfg.data.use_chat_template},
    }  # fmt: skip
    names = sorted(task_names - {"nemo_gym"})  # Gym needs the server: see setup()
    # one scorer replaces the data's own; in a blend, only the entries naming it use it
    if (cfg.env.reward_fn or cfg.env.reward_model_path) and not cfg.data.blend:
        replacing = "reward_fn" if cfg.env.reward_fn else "reward_model"
        return dict.fromkeys(names, create_environment_actor(replacing, **kwargs[replacing]))
    return {t: create_environment_actor(t, **kwargs.get(t, {})) for t in names}


def reward_threshold(cfg: GRPOMasterConfig, task_names: set[str]) -> float | None:
    """The reward above which an episode answered correctly (`val/accuracy`,
    `train/accuracy`, pass@k), from the scoring environments' ``correct_above``; None (said
    once) where the rewards are scores -- a reward model, custom reward functions, or tasks
    that disagree -- and the run reports its mean reward instead."""
    from tempering.environments.registry import correct_above

    if (cfg.env.reward_model_path or cfg.env.reward_fn) and not cfg.data.blend:
        scorers = {"reward_model" if cfg.env.reward_model_path else "reward_fn"}
    else:
        scorers = task_names
    found = {correct_above(name) for name in scorers}
    threshold = found.pop() if len(found) == 1 else None
    if threshold is None and cfg.grpo.val_pass_at_k:
        raise ValueError(
            f"grpo.val_pass_at_k={cfg.grpo.val_pass_at_k} counts the problems any of "
            f"{cfg.grpo.val_pass_at_k} samples answers correctly, but the rewards of "
            f"{', '.join(sorted(scorers))} are scores with no correct answer: set "
            "grpo.val_pass_at_k=0 (val/reward_mean is logged either way)"
        )
    if threshold is None:
        log.warning(
            "the rewards of %s are scores, not correct answers: this run reports the held-out "
            "mean reward (val/reward_mean, train/reward_mean) and no accuracy",
            ", ".join(sorted(scorers)),
        )
    return threshold


ACCURACY_METRICS = ("val/accuracy", "val/success", "train/accuracy")


def checkpoint_ranking(cfg: GRPOMasterConfig, threshold: float | None) -> Any:
    """The checkpointing config, ranking by ``val/reward_mean`` (logged) where it names an
    accuracy a run with score rewards does not have (the shipped tiny config ranks by
    ``val/accuracy``, and the README runs it with ``env.reward_fn``)."""
    ckpt = cfg.checkpointing
    if threshold is not None or ckpt.metric_name not in ACCURACY_METRICS:
        return ckpt
    log.warning(
        "checkpointing.metric_name=%s: this run's rewards are scores, so it logs no accuracy; "
        "keep_top_k ranks checkpoints by val/reward_mean instead (set "
        "checkpointing.metric_name=val/reward_mean to say so)", ckpt.metric_name,
    )  # fmt: skip
    return ckpt.model_copy(update={"metric_name": "val/reward_mean", "higher_is_better": True})


def build_gym(cfg: GRPOMasterConfig, server: Any, tokenizer: Any) -> Any:
    """The NeMo Gym environment, whose agents call the run's generation server."""
    from pathlib import Path

    from tempering.data.collate import pad_token_id_of
    from tempering.environments.nemo_gym_instances import build_nemo_gym_environment

    return build_nemo_gym_environment(
        cfg.env.nemo_gym,
        policy_base_url=server.base_url,
        policy_model_name=server.service.settings.model_name,
        policy_api_key=server.api_key,
        max_seq_len=cfg.policy.max_total_sequence_length,
        pad_token_id=pad_token_id_of(tokenizer),
        work_dir=str(Path(cfg.logger.log_dir).resolve() / "nemo_gym"),
        num_nodes=cfg.cluster.num_nodes,
    )


def check_gym_hosts(cfg: GRPOMasterConfig, train: list[Any], val: list[Any]) -> None:
    """With `env.nemo_gym.shards`, every Gym row's target hosted by a shard (else a
    ValueError naming the rows, the agents, the shards and the fix); nothing otherwise."""
    from tempering.config.rl_sections import gym_shards
    from tempering.data.nemo_gym import problem_row
    from tempering.environments.nemo_gym_shards import check_rows_hosted

    gym = cfg.env.nemo_gym
    if not gym.shards:
        return
    for name, problems in (("the training data", train), ("the validation data", val)):
        rows = [p.row or problem_row(p.prompt, p.answer) for p in problems
                if p.task_name == "nemo_gym"]  # fmt: skip
        check_rows_hosted(rows, gym_shards(gym), gym.default_route, name)


def environment_metrics(
    environments: dict[str, Any], rewards: Any, tasks: list[str] | None = None
) -> Any:
    """Each environment's own counters (timeouts, parse failures, tool errors...), reset;
    ``tasks`` (each sample's task name) gives an environment the rewards of its own samples
    alone (a blend's, or any mix of tasks), None all of them.

    Returns a function that gives the metrics: actor environments are asked now and answered
    while the policy trains, so the step does not wait for their round trips."""
    import ray

    from tempering.environments.actors import to_wire

    pending, ready = [], {}
    for env in {id(e): e for e in environments.values()}.values():
        own = rewards
        if tasks is not None:
            names = {t for t, e in environments.items() if e is env}
            own = rewards[[i for i, t in enumerate(tasks) if t in names]]
        batch = {"rewards": own} if len(own) else {}  # none of its samples: no reward figures
        method = env.global_post_process_and_metrics
        if hasattr(method, "remote"):
            pending.append(method.remote({k: to_wire(v) for k, v in batch.items()}))
        else:
            ready.update(method(batch)[1])

    def collect() -> dict[str, float]:
        for _, m in ray.get(pending):
            ready.update(m)
        return ready

    return collect
