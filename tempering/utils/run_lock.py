"""One run at a time in a folder: a second command pointed at a running run's folders is refused.

Two runs writing one ``checkpointing.checkpoint_dir`` overwrite each other's ``step_<N>``
folders, and two sharing a ``logger.log_dir`` interleave their ``metrics.jsonl``; a resume
then mixes both runs (the same command started twice in two terminals, or a scheduler
requeueing a job whose first copy still runs). :func:`lock_run_dirs` holds an exclusive
``flock`` on ``<folder>/.tempering.lock`` in each of the run's folders for as long as the
entry point runs. The kernel drops it when the process ends, however it ends (``kill -9``
included), so a lock never outlives its run and a rerun after a crash is never blocked. The
file says who holds it (pid, host, start) for the refusal's message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tempering.errors import UserInputError

LOCK_FILE = ".tempering.lock"


class RunDirInUseError(RuntimeError, UserInputError):
    """A run's folder is in use by another live run."""


@contextmanager
def lock_run_dirs(cfg: Any) -> Iterator[None]:
    """Hold the lock of the run's log folder and (when checkpointing) checkpoint folder."""
    folders = {"logger.log_dir": cfg.logger.log_dir}
    if cfg.checkpointing.enabled:
        folders["checkpointing.checkpoint_dir"] = cfg.checkpointing.checkpoint_dir
    held: dict[Path, int] = {}
    try:
        for key, folder in folders.items():
            path = Path(folder).resolve()
            if path not in held:
                held[path] = _lock(key, path)
        yield
    finally:
        for fd in held.values():
            os.close(fd)  # releases the lock


def _lock(key: str, folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirInUseError(
            f"{key}={str(folder)!r} is in use by another run ({holder}): two runs in one "
            f"folder overwrite each other's checkpoints and metrics. Wait for that run or stop "
            f"it (Ctrl-C; it saves nothing more), or give this one its own {key}"
        ) from None
    # No command line: an override may carry a key, and credentials stay out of run folders.
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%F %T")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        info = json.loads(os.pread(fd, 65536, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock file does not say which"
