"""Environment that scores completions with a user function named by import path.

``RewardFunctionEnvironment("examples.custom_reward:length_penalty")`` loads
``length_penalty`` from module ``examples.custom_reward`` and calls, per sample,

    fn(prompt: str, completion: str, metadata: dict) -> float

where ``prompt`` is the text of the messages before the last assistant message (joined by
newlines) and ``completion`` is the last assistant message. Paths may be written
``"pkg.mod:fn"``, ``"pkg.mod.fn"`` or ``"path/to/file.py:fn"`` (a file loaded directly,
relative to the current directory). A function that raises, or returns something that is
not a finite number, scores that sample 0 and is counted (``env/reward_fn_errors``): one odd
answer from the model must not end the run. When more than ``max_error_rate`` of a step's
samples fail, the step raises `ScoringErrorRateExceeded` naming the first failing sample: a
reward bug should be fixed, not averaged away.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    check_error_rate,
    last_assistant_content,
    prompt_text,
    samples,
)
from tempering.errors import UserInputError

__all__ = ["RewardFn", "RewardFunctionEnvironment", "check_reward_fn", "load_reward_fn"]

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


class RewardFnNotFoundError(ImportError, UserInputError):
    """``env.reward_fn`` names a module or file that is not there."""


def check_reward_fn(path: str | None) -> None:
    """Before any worker starts: the module or file ``env.reward_fn`` names can be found
    (found, not imported: the function is loaded where it runs, in its environment actor)."""
    if not path:
        return
    module_path, _ = _split(path)
    if module_path.endswith(".py"):
        found = Path(module_path).is_file()
    else:
        sys.path.insert(0, os.getcwd())  # where the actor looks too: Ray adds the driver's cwd
        try:
            found = importlib.util.find_spec(module_path) is not None
        except (ImportError, ValueError):  # a parent package that is missing or broken
            found = False
        finally:
            sys.path.remove(os.getcwd())
    if not found:
        raise RewardFnNotFoundError(
            f"env.reward_fn={path!r}: {module_path!r} is not found from {Path.cwd()}; run from "
            "the folder that holds it (it must be importable) or give a file path "
            "'dir/file.py:fn'"
        )


def _split(path: str) -> tuple[str, str]:
    """``(module or file, attribute)`` of ``"module:attr"``, ``"module.attr"`` or
    ``"file.py:attr"``; a ValueError naming the form for anything else."""
    module_path, _, attr = path.rpartition(":" if ":" in path else ".")
    if not module_path or not attr:
        raise ValueError(
            f"reward_fn='{path}' is not an import path; write 'package.module:function' "
            f"(e.g. 'examples.custom_reward:length_penalty')."
        )
    return module_path, attr


def load_reward_fn(path: str) -> RewardFn:
    """Import the callable named by ``"module:attr"``, ``"module.attr"`` or ``"file.py:attr"``."""
    module_path, attr = _split(path)
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

    def __init__(self, reward_fn: str, max_error_rate: float = 0.05) -> None:
        self.reward_fn_path = reward_fn
        self.max_error_rate = max_error_rate
        self._fn = load_reward_fn(reward_fn)
        self._counts = {"samples": 0, "errors": 0}

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        rewards: list[float] = []
        errors: list[tuple[int, str, str]] = []
        for i, log, meta in samples("RewardFunctionEnvironment", message_logs, metadata):
            completion = last_assistant_content(log)
            try:
                value = float(self._fn(prompt_text(log), completion, meta or {}))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}, not a finite number")
            except Exception as exc:  # the function's bug or an answer it cannot take
                errors.append((i, completion, f"{type(exc).__name__}: {exc}"))
                value = 0.0
            rewards.append(value)
        self._counts["samples"] += len(rewards)
        self._counts["errors"] += len(errors)
        check_error_rate(
            f"reward function '{self.reward_fn_path}'", errors, len(rewards), self.max_error_rate,
            "Fix the function (it must return a finite float for any text).",
        )  # fmt: skip
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": f"reward {r:g}"} for r in rewards],
            metadata=list(metadata),
            next_stop_strings=[None] * len(rewards),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(rewards), dtype=torch.bool),
            answers=[None] * len(rewards),
        )

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Report (and reset) ``env/reward_fn_samples`` and ``env/reward_fn_errors``."""
        metrics = {f"env/reward_fn_{k}": float(v) for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        return batch, metrics
