"""Torch threads that follow the free cores (CPU workers).

torch's CPU kernels split each operation across OpenMP threads that meet at a barrier. When
another program holds one of the cores a worker computes on, the thread sharing that core is
descheduled and its siblings wait for it at every barrier: spinning (libgomp spins 300,000
times before it sleeps) the step went 8-13x slower beside one busy loop; sleeping at once
costs a wake-up per operation on an idle machine (README "Shared machines"). One thread per
free core has no sibling to wait for: beside a busy loop the tiny SFT step ran at 1.0-1.35x of
the idle machine's with one thread, against 2.4x with two and a short spin.

:class:`ThreadGovernor` measures, during the worker's own calls, how much CPU other processes
took on the cores this process may run on (``/proc/stat`` for those cores, minus this
process's CPU time from ``os.times``, host steal included), and between calls sets torch's
threads to the cores they left free: never more than the worker was configured with, never
fewer than one. Long calls also decide at safe points inside them (:func:`tick`: between
micro-batches and between decode steps). Measured over calls only (the controller's work
between calls is not a competitor), in windows of at least ``WINDOW_S`` of call time. Each
change is counted and shown (``resources/<role>/threads`` and ``thread_changes`` in
metrics.jsonl, ``tempering.utils.resources``); the first ``LOGGED_CHANGES`` of a process are
logged as warnings with their reason (the worker's stderr, which Ray forwards to the driver's).
``TEMPERING_ADAPTIVE_THREADS=0`` keeps the configured count (a machine of your own).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

ENV = "TEMPERING_ADAPTIVE_THREADS"
WINDOW_S = 0.3  # call time per decision: /proc/stat counts in 10 ms ticks
LOGGED_CHANGES = 5
GOVERNED_SPINCOUNT = "300000"  # libgomp's default, for workers that follow the free cores
_governor: ThreadGovernor | None = None  # this process's (a worker has one)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cores_busy_s(cores: frozenset[int]) -> float:
    """CPU seconds the ``cores`` have spent busy (or stolen by the host) since boot."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:  # "cpu" (all), then "cpu0", "cpu1", ..., then other counters
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu"):
                break
            if name != "cpu" and int(name[3:]) in cores:
                # user nice system idle iowait irq softirq steal (guest is inside user)
                ticks = [int(x) for x in rest.split()[:8]]
                total += sum(ticks) - ticks[3] - ticks[4]
    return total * _TICK_S


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Sets torch's thread count, between calls, to the cores other processes left free.

    Args:
        max_threads: the configured count (torch's when the worker started); never exceeded.
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.changes = 0
        self._cores = frozenset(os.sched_getaffinity(0))
        self._lock = threading.Lock()
        self._in_flight = 0
        self._start: tuple[float, float, float] | None = None
        self._caller = 0  # the thread of the call being measured
        self._wall = self._others = 0.0

    @classmethod
    def for_this_process(cls) -> ThreadGovernor | None:
        """A governor for torch's current thread count; None where torch is not loaded, it
        runs one thread, the process sees a GPU (its CPU threads only feed the device there:
        left as configured), or ``TEMPERING_ADAPTIVE_THREADS=0``."""
        global _governor
        torch = sys.modules.get("torch")
        if torch is None or os.environ.get(ENV, "1") == "0" or not os.path.exists("/proc/stat"):
            return None
        if torch.cuda.is_available():
            return None
        threads = torch.get_num_threads()
        _governor = cls(threads) if threads > 1 else None
        return _governor

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), _cores_busy_s(self._cores), _own_cpu_s()

    def enter(self) -> None:
        """A call starts: measure from here (only when no other call of this process is in
        flight: overlapping calls measure nothing)."""
        with self._lock:
            self._in_flight += 1
            self._start = self._sample() if self._in_flight == 1 else None
            self._caller = threading.get_ident() if self._in_flight == 1 else 0

    def leave(self) -> None:
        """A call ended: add its window; decide once ``WINDOW_S`` of call time is in."""
        with self._lock:
            self._in_flight -= 1
            start, self._start = self._start, None
            if start is not None and not self._in_flight:
                self._add(start, self._sample())

    def tick(self) -> None:
        """A safe point inside a long call (between micro-batches, decode steps): once
        ``WINDOW_S`` has passed since the window started, measure and decide now, so a
        competitor that arrives halfway through a call costs at most that much. Cheap
        otherwise (one clock read)."""
        start = self._start
        if start is None or time.monotonic() - start[0] + self._wall < WINDOW_S:
            return
        with self._lock:  # only the call's own thread (a server thread may decode meanwhile)
            if self._start is None or self._in_flight != 1:
                return
            if self._caller != threading.get_ident():
                return
            now = self._sample()
            self._add(self._start, now)
            self._start = now

    def _add(self, start: tuple[float, float, float], end: tuple[float, float, float]) -> None:
        self._wall += end[0] - start[0]
        self._others += max((end[1] - start[1]) - (end[2] - start[2]), 0.0)
        if self._wall >= WINDOW_S:
            self._decide(self._others / self._wall)
            self._wall = self._others = 0.0

    def _decide(self, others_cores: float) -> None:
        free = len(self._cores) - others_cores
        want = max(1, min(self.max_threads, int(free + 0.5)))
        if want == self.threads:
            return
        import torch

        if self.changes < LOGGED_CHANGES:
            log.warning(
                "torch threads %d -> %d: other processes kept %.2f of this worker's %d cores "
                "busy during its last %.2f s of calls (%s=0 keeps %d)%s",
                self.threads, want, others_cores, len(self._cores), self._wall, ENV,
                self.max_threads, "; further changes are counted in resources/*/thread_changes"
                if self.changes == LOGGED_CHANGES - 1 else "",
            )  # fmt: skip
        torch.set_num_threads(want)
        self.threads = want
        self.changes += 1


def governed_openmp_env() -> dict[str, str]:
    """OpenMP settings for CPU workers that run a governor: libgomp's own spin (300,000)
    instead of the driver's short one. A worker that follows the free cores meets a competitor
    with one thread (no sibling to spin for), and on an idle machine the long spin saves a
    wake-up per operation: SmolLM2-135M SFT steps 8.1-9.2 s against 9.5-11.1 with the short spin
    (README "Shared machines"). Nothing where the user set an OpenMP variable (theirs holds)
    or turned the governor off."""
    from tempering import OPENMP_USER_SET

    if OPENMP_USER_SET or os.environ.get(ENV, "1") == "0":
        return {}
    return {"GOMP_SPINCOUNT": GOVERNED_SPINCOUNT}


def tick() -> None:
    """`ThreadGovernor.tick` of this process's governor, if it has one (a no-op elsewhere)."""
    if _governor is not None:
        _governor.tick()


def changes() -> int | None:
    """How often this process's governor changed torch's threads (None: it has none)."""
    return None if _governor is None else _governor.changes
