"""Wall-clock timers for the phases of a training step.

    timer = Timer()
    with timer.time("generation"):
        ...
    with timer.time("training"):
        ...
    logger.log_metrics(timer.get_timing_metrics(), step)   # {"timing/generation_s": ...}
    timer.reset()

A name timed several times between resets keeps every duration; ``reduction`` says how they
are combined (``sum`` for "time spent in this phase this step", ``mean`` for "per call").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Literal

Reduction = Literal["sum", "mean", "max", "min", "count"]
_REDUCTIONS: dict[str, object] = {
    "sum": sum,
    "mean": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
    "count": len,
}


class Timer:
    """Accumulates named durations (seconds, ``time.perf_counter``)."""

    def __init__(self, prefix: str = "timing") -> None:
        self.prefix = prefix
        self._durations: dict[str, list[float]] = {}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        """Start timing ``name``; prefer ``with timer.time(name):``."""
        if name in self._started:
            raise RuntimeError(
                f"Timer: '{name}' is already running; stop it before starting it again"
            )
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        """Stop timing ``name``; returns and records the elapsed seconds."""
        if name not in self._started:
            raise RuntimeError(f"Timer: '{name}' was never started; call start('{name}') first")
        elapsed = time.perf_counter() - self._started.pop(name)
        self._durations.setdefault(name, []).append(elapsed)
        return elapsed

    def record(self, name: str, seconds: float) -> None:
        """Record a duration measured elsewhere (e.g. by another thread) under ``name``."""
        self._durations.setdefault(name, []).append(seconds)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the body of a ``with`` block under ``name`` (recorded even if it raises)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def durations(self, name: str) -> list[float]:
        """Every recorded duration for ``name`` since the last reset (a copy)."""
        return list(self._durations.get(name, []))

    def get_timing_metrics(self, reduction: Reduction = "sum") -> dict[str, float]:
        """``{"<prefix>/<name>_s": reduced seconds}`` for every name recorded since the last reset."""
        if reduction not in _REDUCTIONS:
            raise ValueError(f"Timer: reduction={reduction!r} is not one of {sorted(_REDUCTIONS)}")
        fn = _REDUCTIONS[reduction]
        out: dict[str, float] = {}
        for name, values in self._durations.items():
            key = f"{name}_s" if reduction != "count" else f"{name}_count"
            out[f"{self.prefix}/{key}" if self.prefix else key] = float(fn(values))  # type: ignore[operator]
        return out

    def reset(self, name: str | None = None) -> None:
        """Forget recorded durations (of ``name`` only, or of all names). Running timers keep running."""
        if name is None:
            self._durations.clear()
        else:
            self._durations.pop(name, None)


class PhaseLog:
    """When each role ran each phase, for ``tempering plot --timeline LOG_DIR``: one JSON line
    per phase (``role``, ``phase``, ``step``, ``start``, ``end``; wall-clock seconds since the
    epoch) appended to ``path``. Thread-safe (the async collector and the trainer share one);
    ``path=None`` records nothing."""

    def __init__(self, path: str | None) -> None:
        import threading

        self._lock = threading.Lock()
        self._file = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115

    @contextlib.contextmanager
    def phase(self, role: str, name: str, step: int) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.record(role, name, step, start, time.time())

    def record(self, role: str, name: str, step: int, start: float, end: float) -> None:
        if self._file is None:
            return
        import json

        line = json.dumps({"role": role, "phase": name, "step": step, "start": start, "end": end})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
