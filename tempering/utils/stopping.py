"""Ctrl-C and SIGTERM stop a run cleanly: workers freed, one line saying where to resume.

Under ``uv run`` a Ctrl-C reaches the script twice: from the terminal (to the whole
foreground process group) and again from uv, which forwards it to its child. Python's
default turns each into a ``KeyboardInterrupt``; the second one used to land inside Ray's
``shutdown()`` and leave two of Ray's agent processes running after the script had exited,
under a 100-line traceback. A SIGTERM (``docker stop``, a batch scheduler's preemption) went
to Ray's own handler and aborted the process with status 134.

:func:`stop_cleanly` wraps an entry point. The first SIGINT or SIGTERM raises `Stopped` in
the main thread, so every ``finally`` frees its workers as on any error. A repeat within
`REPEAT_S` seconds is the same request delivered twice and is ignored; a later one means
"now": every process below this one (Ray's, its workers') is killed and the process exits.
After the cleanup, Ray is shut down, one line names the newest complete checkpoint (the
command, run again, resumes from it) and the process exits with ``128 + signal number`` (130
for SIGINT, 143 for SIGTERM), as a shell reports a signalled command. ``ray.init()`` installs
its own SIGTERM handler in the driver; :func:`reclaim_signals` (called by ``init_ray``) puts
the guard's back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 2.0  # a repeat sooner than this is the same Ctrl-C (terminal + `uv run`)


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal. A `KeyboardInterrupt`, so ``except Exception``
    does not swallow it and code that treats Ctrl-C specially (Ray's, too) still does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Guard:
    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = (signum, now)
            name = signal.Signals(signum).name
            print(f"{name} received: stopping (freeing the workers)...", file=sys.stderr)
            raise Stopped(signum)
        if now - self.first[1] < REPEAT_S:
            return  # the same request, delivered twice
        killed = kill_descendants()
        print(
            f"{signal.Signals(signum).name} again while stopping: exiting now; killed "
            f"{killed} processes below this one (Ray's and its workers') without waiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)


_active: _Guard | None = None


def process_table() -> dict[int, tuple[str, int, int]]:
    """``{pid: (state, parent pid, session id)}`` of every process, from /proc (empty where
    there is none); a process that ends while the table is read is left out."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the fields after the command name, which may hold spaces and parentheses
            state, ppid, _pgrp, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
            table[int(stat.parent.name)] = (state, int(ppid), int(session))
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return table


def kill_descendants() -> int:
    """SIGKILL every process below this one -- Ray's node processes, its workers and what
    they started -- and return how many (an interrupted ``ray.shutdown()`` leaves Ray's agents
    running otherwise). The whole tree is read from /proc first, so none escapes by being
    reparented; nothing where there is no /proc."""
    children: dict[int, list[int]] = {}
    for pid, (_state, ppid, _session) in process_table().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [os.getpid()]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(found)


def reclaim_signals() -> None:
    """Put the active guard's handlers back (``ray.init`` replaces the driver's SIGTERM
    handler with its own); nothing when no guard is active."""
    if _active is not None and threading.current_thread() is threading.main_thread():
        _active.install()


@contextmanager
def stop_cleanly(checkpointing: Any = None) -> Iterator[None]:
    """Run the block so that SIGINT / SIGTERM stop it cleanly (module docstring).
    `checkpointing` is the run's ``checkpointing`` config section (``enabled``,
    ``checkpoint_dir``), or None where nothing resumes."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    guard = _Guard()
    _active = guard
    guard.install()
    try:
        yield
    except KeyboardInterrupt:
        # Ray's blocking calls run the handler themselves and raise a KeyboardInterrupt of
        # their own in place of `Stopped`, so the guard's record says which signal it was.
        if guard.first is None:
            raise  # raised by code, not by a signal
        signum = guard.first[0]
        _shutdown_ray()
        print(stop_message(signum, checkpointing), file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        _active = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_message(signum: int, checkpointing: Any = None) -> str:
    """``stopped by SIGINT; ...`` with where a rerun of the same command resumes."""
    head = f"stopped by {signal.Signals(signum).name}"
    if checkpointing is None:
        return head
    if not checkpointing.enabled:
        return f"{head}; checkpointing.enabled=false, so a rerun starts from the beginning"
    from tempering.utils.checkpoint import CheckpointManager

    folder = Path(checkpointing.checkpoint_dir)
    found = CheckpointManager(folder, save_period=1).complete_checkpoints()
    if not found:
        return (
            f"{head}; no complete checkpoint in {folder} yet, so the same command, run "
            "again, starts from the beginning"
        )
    step, latest = found[-1]
    return f"{head}; the same command, run again, resumes from {latest} (step {step})"


def _shutdown_ray() -> None:
    """Shut Ray down now, while the guard still absorbs a repeated signal (its own atexit
    hook would run after the guard is gone)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
