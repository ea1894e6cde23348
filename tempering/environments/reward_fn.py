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
from collections.abc import Callable, Sequence
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


def check_reward_fn(path: str | Sequence[str] | None) -> None:
    """Before any worker starts: the module or file ``env.reward_fn`` names (each of a list)
    can be found (found, not imported: the function is loaded where it runs, in its
    environment actor)."""
    if not path:
        return
    if not isinstance(path, str):
        for one in path:
            check_reward_fn(one)
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
    """Single-turn environment whose reward is ``fn(prompt, completion, metadata)``, or the
    weighted sum of several such functions (TRL's ``reward_funcs`` and ``reward_weights``):
    ``reward_fn`` a path or a list of paths, ``weights`` one float per path (default 1.0)."""

    def __init__(
        self,
        reward_fn: str | Sequence[str],
        max_error_rate: float = 0.05,
        weights: Sequence[float] | None = None,
    ) -> None:
        paths = [reward_fn] if isinstance(reward_fn, str) else list(reward_fn)
        weights = list(weights) if weights is not None else [1.0] * len(paths)
        if not paths or len(weights) != len(paths):
            raise ValueError(
                f"reward_fn={paths} and weights={weights}: one weight per reward function"
            )
        self.reward_fn_path = ", ".join(paths)
        self.max_error_rate = max_error_rate
        self._fns = [
            (path, load_reward_fn(path), w) for path, w in zip(paths, weights, strict=True)
        ]
        self._names = _metric_names(paths)
        self._counts = {"samples": 0, "errors": 0}
        self._sums = dict.fromkeys(self._names, 0.0)  # each function's unweighted rewards

    def _score(self, prompt: str, completion: str, meta: dict[str, Any]) -> tuple[float, str]:
        """The weighted sum, and the first failure's text ("" when none failed); a function
        that raises or returns a non-finite number adds 0."""
        total, failure = 0.0, ""
        for (path, fn, weight), name in zip(self._fns, self._names, strict=True):
            try:
                value = float(fn(prompt, completion, meta))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}, not a finite number")
            except Exception as exc:  # the function's bug or an answer it cannot take
                failure = failure or f"{path}: {type(exc).__name__}: {exc}"
                continue
            self._sums[name] += value
            total += weight * value
        return total, failure

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        rewards: list[float] = []
        errors: list[tuple[int, str, str]] = []
        for i, log, meta in samples("RewardFunctionEnvironment", message_logs, metadata):
            completion = last_assistant_content(log)
            value, failure = self._score(prompt_text(log), completion, meta or {})
            if failure:
                errors.append((i, completion, failure))
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
        """Report (and reset) ``env/reward_fn_samples``, ``env/reward_fn_errors`` and, with
        several functions, each one's unweighted mean (``env/reward_fn/<name>_mean``)."""
        metrics = {f"env/reward_fn_{k}": float(v) for k, v in self._counts.items()}
        if len(self._fns) > 1 and self._counts["samples"]:
            n = self._counts["samples"]
            metrics.update({f"env/reward_fn/{k}_mean": v / n for k, v in self._sums.items()})
        self._counts = dict.fromkeys(self._counts, 0)
        self._sums = dict.fromkeys(self._sums, 0.0)
        return batch, metrics


def _metric_names(paths: list[str]) -> list[str]:
    """Each function's name in metrics: its attribute (``format_reward``), or the whole path
    where two share one."""
    attrs = [_split(p)[1] for p in paths]
    return [
        a if attrs.count(a) == 1 else p.replace("/", ".") for a, p in zip(attrs, paths, strict=True)
    ]
