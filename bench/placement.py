"""Where the host put this machine's two cores: on one L3 cache, or split across two.

The 2-vCPU EPYC (Zen 4) machines these benchmarks run on move between two states, for a
second to a minute at a time: both vCPUs on cores of one CCD (one shared L3), or on two
CCDs, where a cache line written by one core and read by the other crosses the package
(2026-11-29: a C ping-pong of one cache line, pinned threads, 56-118 ns a round trip against
330-400 ns split). A two-thread torch step hands tensors between its threads at every
operation, so it slows where the cores are split -- tempering's tiny-arith SFT step 40-45 ms
on one L3 against 55-60 split, its element-wise operations 1.5-3x slower and its products
~10% -- while a step that is mostly single-threaded Python (TRL's) moves ~13%. Nothing in a
process can choose its cores' L3; a benchmark can say which state each run met.

`PlacementProbe` (a context manager) measures the round trip in the background: two small
processes pinned one per core ping-pong one byte of shared memory, ``rounds`` round trips
every ``interval_s`` (~1 ms of both cores every 0.25 s), and `split_share` says which share
of a time window's samples were split. Pure Python (no compiler): its round trip is slower
than C's but as bimodal (180-230 ns on one L3, 350-550 split), so ``SPLIT_NS`` divides them
on this machine; on another CPU read the printed round trips first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

SPLIT_NS = 300.0  # a Python round trip above this: the two cores on two L3s (see above)
_SKIP = 200  # round trips left out of each sample: the pong's wake-up


def _pong(name: str, cpu: int, go, stop, rounds: int) -> None:
    os.sched_setaffinity(0, {cpu})
    shm = shared_memory.SharedMemory(name=name)
    flag = shm.buf
    try:
        while not stop.is_set():
            if not go.wait(0.5) or stop.is_set():
                continue
            go.clear()
            for _ in range(rounds):
                while flag[0] != 1:
                    pass
                flag[0] = 0
    finally:
        del flag
        shm.close()


def _ping(name: str, cpu: int, go, stop, rounds: int, interval_s: float, out: str) -> None:
    os.sched_setaffinity(0, {cpu})
    shm = shared_memory.SharedMemory(name=name)
    flag = shm.buf
    try:
        with open(out, "a", buffering=1) as log:
            while not stop.wait(interval_s):
                go.set()
                start = 0.0
                for i in range(rounds):
                    if i == _SKIP:
                        start = time.perf_counter()
                    flag[0] = 1
                    while flag[0] != 0:
                        pass
                ns = (time.perf_counter() - start) / (rounds - _SKIP) * 1e9
                log.write(f"{time.monotonic():.3f} {ns:.0f}\n")
    finally:
        del flag
        shm.close()


class PlacementProbe:
    """Background round trips between this process's first two CPUs (see module doc); does
    nothing where it may run on fewer than two."""

    def __init__(self, interval_s: float = 0.25, rounds: int = 2200) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.cpus = cpus[:2] if len(cpus) >= 2 else None
        self.interval_s, self.rounds = interval_s, rounds
        self._procs: list = []

    def __enter__(self) -> PlacementProbe:
        if self.cpus is None:
            return self
        ctx = mp.get_context("spawn")
        self._shm = shared_memory.SharedMemory(create=True, size=64)
        self._shm.buf[0] = 0
        self._go, self._stop = ctx.Event(), ctx.Event()
        fd, self._out = tempfile.mkstemp(prefix="placement_", suffix=".txt")
        os.close(fd)
        name, (a, b) = self._shm.name, self.cpus
        self._procs = [
            ctx.Process(target=_pong, args=(name, b, self._go, self._stop, self.rounds)),
            ctx.Process(
                target=_ping,
                args=(name, a, self._go, self._stop, self.rounds, self.interval_s, self._out),
            ),
        ]
        for p in self._procs:
            p.daemon = True
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cpus is None:
            return
        self._stop.set()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self._shm.close()
        self._shm.unlink()
        Path(self._out).unlink(missing_ok=True)

    def timed_samples(self, start: float, end: float) -> list[tuple[float, float]]:
        """``(time.monotonic(), round trip ns)`` samples taken between ``start`` and ``end``."""
        if self.cpus is None:
            return []
        rows = (line.split() for line in Path(self._out).read_text().splitlines())
        return [(float(t), float(ns)) for t, ns in rows if start <= float(t) <= end]

    def samples(self, start: float, end: float) -> list[float]:
        """Round trips (ns) sampled between ``time.monotonic()`` readings ``start`` and ``end``."""
        return [ns for _, ns in self.timed_samples(start, end)]

    def placed_steps(
        self, ends: list[float], seconds: list[float], work: list[float] | None = None
    ) -> list[tuple[str | None, float, float]]:
        """Each step as ``(placement, seconds, work)`` for `print_matched`: its placement from
        the samples taken while it ran or within half a sampling interval of it (`state_of`
        their split share; ``ends``: each step's end on the monotonic clock, ``seconds``: its
        length), ``work`` 1 a step unless given (a GRPO step's generated tokens)."""
        if not ends:
            return []
        work = work or [1.0] * len(ends)
        margin = self.interval_s / 2
        got = self.timed_samples(ends[0] - seconds[0] - margin, ends[-1] + margin)
        out = []
        for end, length, done in zip(ends, seconds, work, strict=True):
            near = [ns > SPLIT_NS for t, ns in got if end - length - margin <= t <= end + margin]
            out.append((state_of(sum(near) / len(near) if near else None), length, done))
        return out

    def split_share(self, start: float, end: float) -> float | None:
        """The share of the window's samples with the cores on two L3s (None: no sample)."""
        got = self.samples(start, end)
        return sum(ns > SPLIT_NS for ns in got) / len(got) if got else None


def placement_note(shares: list[float | None]) -> str:
    """``[ours, theirs]`` split shares as ``"tempering 0%, TRL 100%"``."""
    names = ("tempering", "TRL")
    return ", ".join(
        f"{n} {'no sample' if s is None else f'{s:.0%}'}"
        for n, s in zip(names, shares, strict=True)
    )


def state_of(share: float | None) -> str | None:
    """A split share as a placement: "one L3" (at most 20% of samples split), "two L3s" (at
    least 80%), or None (mixed, or no sample)."""
    if share is None or 0.2 < share < 0.8:
        return None
    return "one L3" if share <= 0.2 else "two L3s"


def print_by_placement(ratios: list[float], shares: list[float | None]) -> None:
    """The speed-ups again, grouped by where tempering's timed steps ran (``shares``: their
    split share per run): on one L3 (at most 20% of samples split), split (at least 80%), or
    mixed / unknown."""
    groups: dict[str, list[float]] = {"one L3": [], "two L3s": [], "mixed or unknown": []}
    for ratio, share in zip(ratios, shares, strict=True):
        groups[state_of(share) or "mixed or unknown"].append(ratio)
    for key, got in groups.items():
        if got:
            low, mid, high = min(got), statistics.median(got), max(got)
            print(f"  runs with tempering's cores on {key} ({len(got)}): "
                  f"{mid:.2f} ({low:.2f}-{high:.2f})x")  # fmt: skip


def print_matched(ours: list[tuple], theirs: list[tuple], unit: str = "steps") -> None:
    """The speed-up on the same placement: every timed step of all runs, each side's as
    ``(state, seconds, work)`` (`PlacementProbe.placed_steps`), grouped by state; per state
    each side's median rate (work per second over its steps) and their ratio. Runs pair
    whatever placement each side met; this compares the two where the host gave both the same
    cores."""
    for state in ("one L3", "two L3s"):
        rates = [[w / s for st, s, w in side if st == state] for side in (ours, theirs)]
        if not all(rates):
            print(f"  steps on {state}: tempering {len(rates[0])}, TRL {len(rates[1])} "
                  "(no ratio: a side has none)")  # fmt: skip
            continue
        mine, peer = (statistics.median(r) for r in rates)
        shown = [f"{r:,.0f}" if r >= 1000 else f"{r:.4g}" for r in (mine, peer)]
        print(f"  steps on {state} (tempering {len(rates[0])}, TRL {len(rates[1])}): "
              f"{shown[0]} against {shown[1]} {unit}/s, {mine / peer:.2f}x")  # fmt: skip


if __name__ == "__main__":  # watch the placement: one line a second
    with PlacementProbe() as probe:
        while True:
            t = time.monotonic()
            time.sleep(1.0)
            got = probe.samples(t, time.monotonic())
            print(f"{[round(x) for x in got]} ns -> split {probe.split_share(t, time.monotonic())}")
