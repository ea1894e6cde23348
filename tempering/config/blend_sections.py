"""GRPO's weighted blends (``data.blend``): one entry per dataset and the environment that
scores it, each step's prompts drawn by the entries' weights (tempering/data/blend.py).

An entry names its data with NeMo RL's keys for one of ``data.train``'s datasets
(``dataset_name``, ``data_path``, ``env_name``, ``prompt_file``, ``system_prompt_file``);
``weight`` and ``name`` are ours (NeMo RL's several datasets have no sampling weights). What an
entry leaves unset comes from the ``data`` section (e.g. ``data.num_val_samples``,
``data.seed``). Checked here, at load: the weights, the names, a built-in dataset given a file
or a file format given none. Checked at set-up, before Ray starts: the environments, empty
data, rows that no environment scores.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, Field

from tempering.config.section import Section

# GRPO datasets a blend entry can name (NeMo Gym rows cannot join a blend: Gym's agents run
# whole episodes, and a step's batch would mix them with tempering's own rollouts).
BLEND_DATASETS = ("arithmetic", "gsm8k", "problems")
BLEND_BUILT_IN = ("arithmetic", "gsm8k")


class BlendEntryConfig(Section):
    """One dataset of a blend and its share of each step's prompts."""

    name: str | None = Field(
        None,
        description="the entry's name in metrics (env/<name>/..., val/<name>/...); null: its "
        "env_name, else its dataset_name; names must differ",
    )
    weight: float = Field(
        1.0,
        description="sampling weight, relative: the weights are normalised to sum to 1 (2, 1, 1 "
        "draw half of the prompts from the first entry); must be positive and finite",
    )
    dataset_name: str = Field(
        "arithmetic", description=f"the entry's GRPO dataset: {' | '.join(BLEND_DATASETS)}"
    )
    data_path: str | None = Field(
        None, description="dataset_name=problems: the training file (or Hugging Face dataset)"
    )
    val_data_path: str | None = Field(
        None,
        description="dataset_name=problems: a validation file (null: data.num_val_samples held "
        "out of data_path)",
    )
    env_name: str | None = Field(
        None,
        description="the environment that scores the entry's rows (e.g. arithmetic, "
        "arithmetic_retry, calculator, math, reward_fn with env.reward_fn); null: the "
        "dataset's own (arithmetic: arithmetic, gsm8k and problems: math)",
    )
    num_train_samples: int | None = Field(
        None, ge=1, description="the entry's training problems (null: data.num_train_samples)"
    )
    num_val_samples: int | None = Field(
        None, ge=1, description="the entry's held-out problems (null: data.num_val_samples)"
    )
    prompt_file: str | None = Field(
        None, description="a prompt template with one {} for this entry (null: data.prompt_file)"
    )
    system_prompt_file: str | None = Field(
        None, description="a system prompt for this entry (null: data.system_prompt_file)"
    )

    def label(self) -> str:
        """The entry's name in metrics and messages."""
        return self.name or self.env_name or self.dataset_name


def check_blend(entries: list[BlendEntryConfig]) -> list[BlendEntryConfig]:
    """What a blend's entries say alone: positive finite weights, distinct names, a dataset
    each entry can read. Every problem is one clause naming ``data.blend[i].key``, the value
    and the fix."""
    problems = []
    for i, e in enumerate(entries):
        at = f"data.blend[{i}]"
        if not (math.isfinite(e.weight) and e.weight > 0):
            problems.append(
                f"{at}.weight={e.weight!r} must be a positive finite number (weights are "
                "relative and normalised to sum to 1); give it a share such as 1.0, or remove "
                "the entry"
            )
        if e.dataset_name not in BLEND_DATASETS:
            problems.append(
                f"{at}.dataset_name={e.dataset_name!r} is not a dataset a blend reads; use one "
                f"of {list(BLEND_DATASETS)} (NeMo Gym rows run whole episodes in Gym's agents "
                "and cannot join a blend: train on them with data.dataset_name=nemo_gym)"
            )
        elif e.dataset_name in BLEND_BUILT_IN and (e.data_path or e.val_data_path):
            problems.append(
                f"{at}.dataset_name={e.dataset_name!r} is built in and reads no file: remove "
                f"{at}.data_path / val_data_path, or set {at}.dataset_name=problems"
            )
        elif e.dataset_name == "problems" and not e.data_path:
            problems.append(
                f"{at}.dataset_name='problems' reads your file: set {at}.data_path=<file, "
                "folder or dataset id>"
            )
    labels = [e.label() for e in entries]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        at = [f"data.blend[{i}]" for i, x in enumerate(labels) if x == label]
        problems.append(
            f"{', '.join(at)} are all named {label!r} (name, else env_name, else dataset_name): "
            f"give each a distinct name, e.g. name: {label}_2"
        )
    if problems:
        raise ValueError("; ".join(problems))
    return entries


BlendList = Annotated[list[BlendEntryConfig], AfterValidator(check_blend)]
