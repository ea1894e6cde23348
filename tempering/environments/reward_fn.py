"""Environment that scores completions with a user function named by import path.

``RewardFunctionEnvironment("examples.custom_reward:length_penalty")`` loads
``length_penalty`` from module ``examples.custom_reward`` and calls, per sample,

    fn(prompt: str, completion: str, metadata: dict) -> float

where ``prompt`` is the text of the messages before the last assistant message (joined by
newlines) and ``completion`` is the last assistant message. Paths may be written
``"pkg.mod:fn"``, ``"pkg.mod.fn"`` or ``"path/to/file.py:fn"`` (a file loaded directly,
relative to the current directory). A function that raises fails the step with the sample
index in the message: a reward bug should be fixed, not averaged away.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    last_assistant_content,
    prompt_text,
    samples,
)

__all__ = ["RewardFn", "RewardFunctionEnvironment", "load_reward_fn"]

RewardFn = Callable[[str, str, dict[str, Any]], float]


def _import_module(module_path: str) -> Any:
    if module_path.endswith(".py"):
        file = Path(module_path)
        if not file.is_file():
            raise ImportError(
                f"reward function file '{module_path}' does not exist (cwd={Path.cwd()})."
            )
        spec = importlib.util.spec_from_file_location(f"_reward_fn_{file.stem}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(module_path)


def load_reward_fn(path: str) -> RewardFn:
    """Import the callable named by ``"module:attr"``, ``"module.attr"`` or ``"file.py:attr"``."""
    if ":" in path:
        module_path, _, attr = path.rpartition(":")
    else:
        module_path, _, attr = path.rpartition(".")
    if not module_path or not attr:
        raise ValueError(
            f"reward_fn='{path}' is not an import path; write 'package.module:function' "
            f"(e.g. 'examples.custom_reward:length_penalty')."
        )
    try:
        module = _import_module(module_path)
    except ImportError as exc:
        raise ImportError(
            f"reward_fn='{path}': cannot import module '{module_path}' ({exc}). Make sure it is "
            f"on PYTHONPATH (run from the repository root) or give a file path 'dir/file.py:fn'."
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise AttributeError(
            f"reward_fn='{path}': module '{module_path}' has no attribute '{attr}'; it defines "
            f"{public}."
        )
    if not callable(fn):
        raise TypeError(f"reward_fn='{path}' names a {type(fn).__name__}, not a function.")
    return fn


class RewardFunctionEnvironment(EnvironmentInterface):
    """Single-turn environment whose reward is ``fn(prompt, completion, metadata)``."""

    def __init__(self, reward_fn: str) -> None:
        self.reward_fn_path = reward_fn
        self._fn = load_reward_fn(reward_fn)

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        rewards = []
        for i, log, meta in samples("RewardFunctionEnvironment", message_logs, metadata):
            try:
                value = float(self._fn(prompt_text(log), last_assistant_content(log), meta or {}))
            except Exception as exc:
                raise RuntimeError(
                    f"reward function '{self.reward_fn_path}' failed on sample {i}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            rewards.append(value)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"reward {r:g}"} for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(rewards), dtype=torch.bool),
            answers=[None] * len(rewards),
        )
