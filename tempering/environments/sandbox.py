"""Confinement for processes that handle model-written text as code.

math-verify turns a model's answer into a sympy expression, and sympy's parser evaluates
Python built from that text: a model that writes ``__import__('os').system(...)`` inside
``\\boxed{}`` reaches ``eval``. Such work runs in worker processes (`math.VerifierPool`) that
call :func:`confine` first, which:

- caps the process's address space (``RLIMIT_AS``) and its lifetime CPU time
  (``RLIMIT_CPU``; the pool also kills a worker that overruns one sample's wall-clock limit,
  and retires a worker before its CPU budget runs out);
- takes the network away: a new, empty network namespace (``unshare(CLONE_NEWNET)``, or with
  a user namespace where the process is not privileged) when the kernel allows it, and in
  every case a Python audit hook that refuses sockets, subprocesses, ``exec``/``fork``,
  loading native libraries, writing files and changing resource limits.

The audit hook cannot be removed once added (PEP 578) and stops what the evaluated text can
reach from Python; the kernel limits hold for native code too. What was applied is returned,
so the caller can report it.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from dataclasses import dataclass

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

# Audit events (https://docs.python.org/3/library/audit_events.html) refused after confine().
_REFUSED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                     "ctypes.dlopen", "ctypes.dlsym", "resource.setrlimit", "resource.prlimit")  # fmt: skip
_REFUSED_EVENTS = {"os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
                   "shutil.rmtree", "os.remove", "os.rename", "os.rmdir", "os.chmod", "os.chown",
                   "os.symlink", "os.link", "os.truncate", "os.putenv", "sys.addaudithook"}  # fmt: skip


class SandboxViolation(PermissionError):
    """Code in a confined process tried something the sandbox refuses."""


@dataclass(frozen=True)
class Confinement:
    memory_bytes: int | None
    cpu_seconds: int | None
    network_namespace: bool  # the kernel took the network away (else: the audit hook only)


def confine(memory_bytes: int | None, cpu_seconds: int | None) -> Confinement:
    """Limit this process for good (see the module docstring). Call it once, first thing."""
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if cpu_seconds is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        limit = int(used.ru_utime + used.ru_stime) + cpu_seconds
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))  # SIGXCPU, then SIGKILL
    netns = _new_network_namespace()
    sys.addaudithook(_refuse)
    return Confinement(memory_bytes, cpu_seconds, netns)


def _new_network_namespace() -> bool:
    """Move this process into a new network namespace (only a down loopback in it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return True
    return False


def _refuse(event: str, args: tuple) -> None:
    if event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES) or _writes(event, args):
        raise SandboxViolation(f"sandbox: {event} is not allowed while checking model output")


def _writes(event: str, args: tuple) -> bool:
    """``open`` for writing (reading files is allowed: imports, sympy's data)."""
    if event != "open" or len(args) < 2:
        return False
    mode, flags = args[1], args[2] if len(args) > 2 else 0
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
