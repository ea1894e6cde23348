"""GRPO on a weighted blend (``data.blend``): each entry's problems, scored by the entry's
environment, and each step's prompts drawn by the entries' weights (tempering/data/blend.py).

`blend_problems` loads every entry (with the ``data`` section's settings where the entry sets
none) and refuses, before Ray starts, what cannot run: an unknown environment, an entry with no
training problems, rows that no environment would score (``env_name: reward_fn`` without
``env.reward_fn``), and the keys a blend replaces (``env.task_name``, ``data.train_data_path``,
...). `blend_loader` is the run's data loader; `entry_metrics` gives each entry's
``<name>/reward_mean``, ``<name>/accuracy`` and ``<name>/samples`` (``env/`` every step,
``val/`` at validation).
"""

from __future__ import annotations

import logging
from typing import Any

from tempering.config.schemas import BlendEntryConfig, DataConfig, GRPOMasterConfig
from tempering.data.blend import BlendError, BlendLoader
from tempering.data.grpo_problems import Problem, load_problems
from tempering.errors import UserInputError

log = logging.getLogger("tempering.algorithms.grpo")  # one logger for the run's messages


def blend_problems(cfg: GRPOMasterConfig) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems of every entry, each tagged with its entry (``blend``) and
    scored by the entry's environment; the held-out ones interleaved entry by entry, so that
    ``grpo.max_val_samples`` keeps every entry in the validation."""
    _refuse_replaced_keys(cfg)
    train: list[Problem] = []
    held_out: list[list[Problem]] = []
    for i, entry in enumerate(cfg.data.blend):
        try:
            rows, val = load_problems(entry_data(cfg.data, entry, i))
        except UserInputError as exc:  # a missing or empty file: said with its entry
            raise type(exc)(f"data.blend[{i}] ({entry.label()!r}): {exc}") from None
        if not rows:
            raise BlendError(
                f"data.blend[{i}] ({entry.label()!r}, dataset_name={entry.dataset_name!r}) has "
                "no training problems: point it at data that holds some, or remove the entry"
            )
        task = entry.env_name or rows[0].task_name  # the dataset's own environment
        _check_route(cfg, i, entry, task)
        for p in rows + val:
            p.task_name, p.blend = task, entry.label()
        if not val:
            log.warning(
                "data.blend[%d] (%r) has no held-out problems: validation has no val/%s/ figures",
                i, entry.label(), entry.label(),
            )  # fmt: skip
        train += rows
        held_out.append(val)
    _refuse_unused_scorers(cfg, {p.task_name for p in train})
    longest = max(len(v) for v in held_out)
    val_problems = [v[j] for j in range(longest) for v in held_out if j < len(v)]
    return train, val_problems


def entry_data(data: DataConfig, entry: BlendEntryConfig, index: int) -> DataConfig:
    """The ``data`` settings entry ``index``'s problems load with: the entry's own keys over
    the section's (`load_problems` reads them as it reads a run without a blend), seeded
    ``data.seed + index`` so that two entries of one generated dataset hold other problems."""
    own = {
        "dataset_name": entry.dataset_name,
        "train_data_path": entry.data_path,
        "val_data_path": entry.val_data_path,
        "num_train_samples": entry.num_train_samples or data.num_train_samples,
        "num_val_samples": entry.num_val_samples or data.num_val_samples,
        "prompt_file": entry.prompt_file or data.prompt_file,
        "system_prompt_file": entry.system_prompt_file or data.system_prompt_file,
        "seed": data.seed + index,
        "reasoning_gym_tasks": [],
        "blend": [],
    }
    return data.model_copy(update=own)


def blend_loader(cfg: GRPOMasterConfig, train_problems: list[Problem]) -> BlendLoader:
    """The run's loader: ``grpo.num_prompts_per_step`` problems a step, each entry's drawn with
    probability its normalised weight (said once at start)."""
    by_entry: dict[str, list[Problem]] = {e.label(): [] for e in cfg.data.blend}
    for p in train_problems:
        by_entry[str(p.blend)].append(p)
    loader = BlendLoader(
        by_entry, [e.weight for e in cfg.data.blend], cfg.grpo.num_prompts_per_step,
        seed=cfg.grpo.seed,
    )  # fmt: skip
    log.info(
        "data.blend: each prompt drawn from %s (weights normalised to sum to 1)",
        ", ".join(f"{n} {s:.1%} ({len(by_entry[n])} problems)" for n, s in loader.shares.items()),
    )
    return loader


def entry_metrics(problems: list[Problem], rewards: Any, repeat: int = 1) -> dict[str, float]:
    """Per blend entry of ``problems`` (each repeated ``repeat`` times in ``rewards``, in
    order): ``<name>/reward_mean``, ``<name>/samples`` and, where the entry's environment's
    rewards are correct answers, ``<name>/accuracy``. Empty without a blend."""
    from tempering.environments.registry import correct_above

    groups: dict[str, tuple[str, list[float]]] = {}
    for i, p in enumerate(problems):
        if p.blend is not None:
            values = groups.setdefault(p.blend, (p.task_name, []))[1]
            values.extend(float(r) for r in rewards[i * repeat : (i + 1) * repeat])
    out: dict[str, float] = {}
    for name, (task, values) in groups.items():
        out[f"{name}/reward_mean"] = sum(values) / len(values)
        out[f"{name}/samples"] = float(len(values))
        threshold = correct_above(task)
        if threshold is not None:
            out[f"{name}/accuracy"] = sum(v > threshold for v in values) / len(values)
    return out


def env_metrics(problems: list[Problem], rewards: Any, repeat: int) -> dict[str, float]:
    """A step's `entry_metrics` as ``env/<name>/...``."""
    return {f"env/{k}": v for k, v in entry_metrics(problems, rewards, repeat).items()}


def _check_route(cfg: GRPOMasterConfig, i: int, entry: BlendEntryConfig, task: str) -> None:
    """An entry's rows must reach an environment that can score them."""
    from tempering.environments.registry import ENVIRONMENT_REGISTRY

    at = f"data.blend[{i}].env_name={task!r}"
    if task == "nemo_gym" or task not in ENVIRONMENT_REGISTRY:
        raise BlendError(
            f"{at} names no environment a blend can score with; known: "
            f"{sorted(ENVIRONMENT_REGISTRY)} (NeMo Gym's run whole episodes and cannot join a "
            "blend; register your own with tempering.environments.registry."
            "register_environment)"
        )
    needs = {"reward_fn": ("env.reward_fn", cfg.env.reward_fn),
             "reward_model": ("env.reward_model_path", cfg.env.reward_model_path)}  # fmt: skip
    if task in needs and not needs[task][1]:
        raise BlendError(
            f"{at}: its rows would reach no scorer, since {needs[task][0]} is not set; set it "
            f"(e.g. {needs[task][0]}=examples/custom_reward.py:closeness for reward_fn), or "
            "give the entry another env_name"
        )


def _refuse_replaced_keys(cfg: GRPOMasterConfig) -> None:
    """Keys whose job ``data.blend`` takes over, refused rather than ignored."""
    d, default = cfg.data, DataConfig()
    replaced = {
        "env.task_name": (cfg.env.task_name, None, "give each entry its env_name"),
        "data.dataset_name": (
            d.dataset_name,
            default.dataset_name,
            "set each entry's dataset_name",
        ),
        "data.train_data_path": (d.train_data_path, None, "set each entry's data_path"),
        "data.val_data_path": (d.val_data_path, None, "set each entry's val_data_path"),
        "data.reasoning_gym_tasks": (d.reasoning_gym_tasks, [], "remove it"),
    }
    problems = [
        f"{key}={value!r} (with data.blend, each entry's keys say this: {fix})"
        for key, (value, unset, fix) in replaced.items()
        if value != unset
    ]
    if problems:
        raise BlendError("; ".join(problems))


def _refuse_unused_scorers(cfg: GRPOMasterConfig, tasks: set[str]) -> None:
    """With a blend, ``env.reward_fn`` and ``env.reward_model_path`` score only the entries
    that name them: set with none that does, they would be read by nothing."""
    for key, value, task in (("env.reward_fn", cfg.env.reward_fn, "reward_fn"),
                             ("env.reward_model_path", cfg.env.reward_model_path,
                              "reward_model")):  # fmt: skip
        if value and task not in tasks:
            raise BlendError(
                f"{key}={value!r}: with data.blend it scores only the entries with env_name: "
                f"{task}, and none has it; give an entry env_name: {task}, or remove {key}"
            )
