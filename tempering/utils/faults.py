"""Fault injection for the reliability tests: kill or interrupt this process at a chosen point.

    TEMPERING_FAULT="<role>:<phase>:<n>[:<delay_s>[:INT|TERM]]"

kills (``SIGKILL``, like the OOM killer or ``kill -9``) the process playing ``role``
(``controller``, ``policy``, ``generation`` or ``environment``) when it enters ``phase``
(``generation``, ``logprobs``, ``train``, ``refit``, ``checkpoint``, ``environment``) for the
``n``-th time -- after ``delay_s`` seconds when given, from a timer thread, so the kill lands
while the phase is running. ``INT`` sends instead what a Ctrl-C sends a script started by
``uv run``: SIGINT to the whole process group twice (the terminal delivers it to the group,
and uv forwards it to its child again); ``TERM`` sends SIGTERM to this process, as ``docker
stop`` or a scheduler does. Unset (always, outside tests), :func:`maybe_fault` is one
dictionary lookup. Several faults: separate them with commas. With
``TEMPERING_FAULT_MARKER=<file>`` a fault fires once across all processes (it creates that
file first), so restarted workers, which count afresh, are not killed again.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable

FAULT_ENV = "TEMPERING_FAULT"
MARKER_ENV = "TEMPERING_FAULT_MARKER"
_seen: Counter[tuple[str, str]] = Counter()


def maybe_fault(role: str, phase: str, fire: Callable[[], None] | None = None) -> None:
    """Count this entry into ``phase`` as ``role``; die here if ``TEMPERING_FAULT`` says so
    (or, with `fire`, call it instead: the caller kills what plays `role`, e.g. a Gym
    instance the trainer launched)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    _seen[(role, phase)] += 1
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (3, 4, 5) or parts[:2] != [role, phase]:
            continue
        if int(parts[2]) != _seen[(role, phase)]:
            continue
        marker = os.environ.get(MARKER_ENV)
        if marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # fired already
        delay = float(parts[3]) if len(parts) >= 4 else 0.0
        send = fire or _SENDERS[parts[4] if len(parts) == 5 else "KILL"]
        if delay > 0:
            timer = threading.Timer(delay, send)
            timer.daemon = True
            timer.start()
        else:
            send()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _ctrl_c() -> None:
    for _ in range(2):
        os.killpg(os.getpgrp(), signal.SIGINT)


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


_SENDERS = {"KILL": _die, "INT": _ctrl_c, "TERM": _terminate}
