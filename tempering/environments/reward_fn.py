"""Environment that scores completions with a user function named by import path.

``RewardFunctionEnvironment("examples.custom_reward:length_penalty")`` loads
``length_penalty`` from module ``examples.custom_reward`` and calls, per sample,

    fn(prompt: str, completion: str, metadata: dict) -> float

where ``prompt`` is the text of the messages before the last assistant message (joined by
newlines) and ``completion`` is the last assistant message. A TRL reward function
(``fn(prompts, completions, **columns) -> list[float | None]``) runs unchanged, once per step
(`RewardFunctionEnvironment`); several functions are summed with weights. Paths may be written
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
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    check_error_rate,
    last_assistant_content,
    prompt_messages,
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


class _Reward(NamedTuple):
    path: str
    fn: Callable[..., Any]
    weight: float
    name: str  # in metrics
    batched: bool  # TRL's convention: fn(prompts, completions, **columns) -> list


def _is_trl_style(fn: Callable[..., Any]) -> bool:
    """TRL's reward functions take ``prompts`` and ``completions`` (lists) first."""
    try:
        return list(inspect.signature(fn).parameters)[:2] == ["prompts", "completions"]
    except (TypeError, ValueError):  # a builtin without a signature: ours, per sample
        return False


class RewardFunctionEnvironment(EnvironmentInterface):
    """Single-turn environment whose reward is ``fn(prompt, completion, metadata)``, or the
    weighted sum of several functions (TRL's ``reward_funcs`` and ``reward_weights``):
    ``reward_fn`` a path or a list of paths, ``weights`` one float per path (default 1.0).

    A function whose first parameters are ``prompts, completions`` is called TRL's way, once
    per step: ``fn(prompts=[...], completions=[...], **columns)`` with the samples' metadata
    as keyword lists (``ground_truth=[...]``), returning one float or None (does not apply)
    per sample. ``conversational`` (the run's ``data.use_chat_template``) passes prompts as
    message lists and each completion as ``[{"role": "assistant", "content": ...}]``, as TRL
    does for conversational datasets; else both are strings. The rewards are whatever the
    functions return, not correctness (``correct_above`` None): GRPO reports their mean,
    not an accuracy."""

    correct_above = None

    def __init__(
        self,
        reward_fn: str | Sequence[str],
        max_error_rate: float = 0.05,
        weights: Sequence[float] | None = None,
        conversational: bool = False,
    ) -> None:
        paths = [reward_fn] if isinstance(reward_fn, str) else list(reward_fn)
        weights = list(weights) if weights is not None else [1.0] * len(paths)
        if not paths or len(weights) != len(paths):
            raise ValueError(
                f"reward_fn={paths} and weights={weights}: one weight per reward function"
            )
        self.reward_fn_path = ", ".join(paths)
        self.max_error_rate = max_error_rate
        self.conversational = conversational
        self._fns = []
        for path, weight, name in zip(paths, weights, _metric_names(paths), strict=True):
            fn = load_reward_fn(path)
            self._fns.append(_Reward(path, fn, weight, name, _is_trl_style(fn)))
        self._counts = {"samples": 0, "errors": 0}
        self._sums = {f.name: [0.0, 0] for f in self._fns}  # unweighted sum, samples scored

    def _values(self, f: _Reward, logs: list[MessageLog], metas: list[dict[str, Any]]) -> list:
        """One value per sample: a float, None (does not apply), or a `_Failure`."""
        if not f.batched:
            return [_reward(f, _call(f, f.fn, prompt_text(log), last_assistant_content(log), meta))
                    for log, meta in zip(logs, metas, strict=True)]  # fmt: skip
        completions: list[Any] = [last_assistant_content(log) for log in logs]
        prompts: list[Any] = [prompt_text(log) for log in logs]
        if self.conversational:  # TRL's form: role/content messages
            prompts = [[{"role": m["role"], "content": m.get("content")}
                        for m in prompt_messages(log)] for log in logs]  # fmt: skip
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {k: [m.get(k) for m in metas] for k in {k for m in metas for k in m}}
        got = _call(f, lambda: f.fn(prompts=prompts, completions=completions, **columns))
        if isinstance(got, _Failure):
            return [got] * len(logs)
        if not isinstance(got, list | tuple) or len(got) != len(logs):
            what = f"{len(got)} values" if isinstance(got, list | tuple) else type(got).__name__
            return [_Failure(f"{f.path}: returned {what} for {len(logs)} completions")] * len(logs)
        return [v if v is None else _reward(f, v) for v in got]

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        items = list(samples("RewardFunctionEnvironment", message_logs, metadata))
        logs, metas = [log for _, log, _ in items], [meta or {} for _, _, meta in items]
        rewards, failures = [0.0] * len(items), [""] * len(items)
        for f in self._fns:
            for i, value in enumerate(self._values(f, logs, metas)):
                if isinstance(value, _Failure):
                    failures[i] = failures[i] or value
                elif value is not None:
                    self._sums[f.name][0] += value
                    self._sums[f.name][1] += 1
                    rewards[i] += f.weight * value
        errors = [(i, last_assistant_content(logs[i]), failure)
                  for i, failure in enumerate(failures) if failure]  # fmt: skip
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
        if len(self._fns) > 1:
            metrics.update({f"env/reward_fn/{k}_mean": total / n
                            for k, (total, n) in self._sums.items() if n})  # fmt: skip
        self._counts = dict.fromkeys(self._counts, 0)
        self._sums = {k: [0.0, 0] for k in self._sums}
        return batch, metrics


class _Failure(str):
    """A function's failure on a sample: the text that names it."""


def _call(f: _Reward, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or a `_Failure` naming the exception."""
    try:
        return fn(*args)
    except Exception as exc:  # the function's bug or an answer it cannot take
        return _Failure(f"{f.path}: {type(exc).__name__}: {exc}")


def _reward(f: _Reward, value: Any) -> float | _Failure:
    """A returned value as a finite float, or a `_Failure` saying why it is not one."""
    if isinstance(value, _Failure):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return _Failure(f"{f.path}: returned {type(value).__name__} {value!r:.60}, not a number")
    if not math.isfinite(number):
        return _Failure(f"{f.path}: ValueError: returned {number}, not a finite number")
    return number


def _metric_names(paths: list[str]) -> list[str]:
    """Each function's name in metrics: its attribute (``format_reward``), or the whole path
    where two share one."""
    attrs = [_split(p)[1] for p in paths]
    return [
        a if attrs.count(a) == 1 else p.replace("/", ".") for a, p in zip(attrs, paths, strict=True)
    ]
