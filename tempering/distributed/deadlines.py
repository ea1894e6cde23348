"""Deadlines for every remote wait, per phase, and Python stack dumps when one expires.

Each wait on workers belongs to a *phase* -- startup (a worker group starting: imports, venv,
model load), generation, refit, train, logprobs, environment, checkpoint, or call (anything
else) -- and has that phase's deadline (``deadlines.*_s`` in
the config; on by default, 30 minutes each). :func:`phase_of` names the phase of a worker
method. When a deadline expires the worker group sends ``SIGUSR1`` to each worker that did not
answer; every worker registered :mod:`faulthandler` for that signal at start-up
(:func:`install_stack_dump_handler`), so it writes the Python stacks of all its threads --
even when it is stuck inside a C call such as a gloo collective -- to
``$TEMPERING_STACK_DUMP_DIR/<group>-rank<r>-pid<pid>.txt``. The error then names the phase,
the group, the ranks and those files, and the caller tears the run down.

The controller sets the deadlines and the dump folder once per run (:func:`configure`); the
defaults hold for library use without a config.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path

PHASES = (
    "startup",
    "generation",
    "refit",
    "train",
    "logprobs",
    "environment",
    "checkpoint",
    "call",
)
DEFAULT_DEADLINE_S = 1800.0
STACK_DUMP_DIR_ENV = "TEMPERING_STACK_DUMP_DIR"
GROUP_NAME_ENV = "TEMPERING_WORKER_GROUP"
STACK_DUMP_SIGNAL = signal.SIGUSR1

_deadlines: dict[str, float] = dict.fromkeys(PHASES, DEFAULT_DEADLINE_S)


class DeadlineExceeded(TimeoutError):
    """A phase's deadline expired: names the phase, where, who did not answer, and the stacks."""

    def __init__(
        self, message: str, *, phase: str, ranks: list[int], stack_files: list[str]
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.ranks = ranks
        self.stack_files = stack_files


def configure(deadlines: Mapping[str, float], stack_dump_dir: str | None = None) -> None:
    """Set the per-phase deadlines (seconds) for this process, and where workers started from
    now on dump their stacks (exported as ``TEMPERING_STACK_DUMP_DIR``)."""
    unknown = sorted(set(deadlines) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown deadline phases {unknown}; the phases are {list(PHASES)}")
    for phase, seconds in deadlines.items():
        if not seconds > 0:
            raise ValueError(f"deadline for phase {phase!r} must be > 0 s, got {seconds}")
        _deadlines[phase] = float(seconds)
    if stack_dump_dir is not None:
        Path(stack_dump_dir).mkdir(parents=True, exist_ok=True)
        os.environ[STACK_DUMP_DIR_ENV] = str(Path(stack_dump_dir).resolve())


def deadline_s(phase: str) -> float:
    """The deadline of ``phase`` in seconds."""
    return _deadlines[phase]


def phase_of(method: str) -> str:
    """The phase a worker method belongs to (by its name). A dotted name is a method of one of
    the worker's components (``"refit.bucket"``, see `IsolatedWorkerInitializer.execute`):
    the policy worker's ``refit.*`` are refit, ``checkpoint.*`` checkpoint, and its colocated
    ``generation.init`` / ``generation.generate`` generation (``generation.refit`` is refit,
    ``generation.reseed`` a plain call, as their undotted forms were)."""
    name = method.lower()
    if "logprob" in name:
        return "logprobs"
    if "refit" in name or "state_dict" in name or "update_weights" in name or "reload" in name:
        return "refit"
    if name.startswith(
        ("generate", "init_colocated_generation", "generation.init", "generation.generate")
    ):
        return "generation"
    if name.startswith(("save", "load_checkpoint", "export", "checkpoint.")):
        return "checkpoint"
    if name.startswith("train"):
        return "train"
    return "call"


def deadline_for_methods(methods: Iterable[str]) -> tuple[str, float]:
    """The phase and deadline of a wait on ``methods``: the longest of their phases'."""
    phases = {phase_of(m) for m in methods} or {"call"}
    phase = max(sorted(phases), key=lambda p: _deadlines[p])
    return phase, _deadlines[phase]


def install_stack_dump_handler(rank: int) -> Path | None:
    """In a worker: dump all threads' stacks to a file on ``SIGUSR1`` (when a dump folder was
    configured); return the file's path. The file is created empty now and filled on dump."""
    folder = os.environ.get(STACK_DUMP_DIR_ENV)
    if not folder:
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)  # to the worker's stderr
        return None
    group = os.environ.get(GROUP_NAME_ENV, "worker")
    path = Path(folder) / f"{group}-rank{rank}-pid{os.getpid()}.txt"
    handle = open(path, "a")  # noqa: SIM115 - stays open for the signal handler
    faulthandler.register(STACK_DUMP_SIGNAL, file=handle, all_threads=True)
    return path


def remove_if_empty(path: Path | None) -> None:
    """Tidy a worker's stack file at a clean shutdown when no dump was written."""
    if path is not None and path.exists() and path.stat().st_size == 0:
        path.unlink()
