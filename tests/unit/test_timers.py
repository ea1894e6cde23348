"""Timer: named durations, reductions, reset, and misuse errors."""

from __future__ import annotations

import time

import pytest

from tempering.utils.timers import Timer


def _busy(seconds: float) -> None:
    """Spin (not sleep) so the measured time is real CPU-clock work of known length."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_time_records_and_reduces() -> None:
    timer = Timer()
    for _ in range(3):
        with timer.time("generation"):
            _busy(0.02)
    with timer.time("training"):
        _busy(0.05)
    durations = timer.durations("generation")
    assert len(durations) == 3 and all(d >= 0.02 for d in durations)
    total = timer.get_timing_metrics()
    assert set(total) == {"timing/generation_s", "timing/training_s"}
    assert total["timing/generation_s"] == pytest.approx(sum(durations))
    assert total["timing/training_s"] >= 0.05
    assert timer.get_timing_metrics("mean")["timing/generation_s"] == pytest.approx(
        sum(durations) / 3
    )
    assert timer.get_timing_metrics("max")["timing/generation_s"] == max(durations)
    assert timer.get_timing_metrics("count")["timing/generation_count"] == 3
    with pytest.raises(ValueError, match="reduction='median'"):
        timer.get_timing_metrics("median")  # type: ignore[arg-type]


def test_records_on_exception_and_reset() -> None:
    timer = Timer(prefix="t")
    with pytest.raises(KeyError), timer.time("step"):
        raise KeyError("boom")
    assert list(timer.get_timing_metrics()) == ["t/step_s"]
    with timer.time("other"):
        pass
    timer.reset("step")
    assert list(timer.get_timing_metrics()) == ["t/other_s"]
    timer.reset()
    assert timer.get_timing_metrics() == {}


def test_start_stop_misuse() -> None:
    timer = Timer()
    timer.start("a")
    with pytest.raises(RuntimeError, match="'a' is already running"):
        timer.start("a")
    assert timer.stop("a") >= 0
    with pytest.raises(RuntimeError, match="'b' was never started"):
        timer.stop("b")
