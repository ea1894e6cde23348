"""Confinement for processes that handle model-written text as code, and their channel.

math-verify turns a model's answer into a sympy expression, and sympy's parser evaluates
Python built from that text: a model that writes ``__import__('os').system(...)`` inside
``\\boxed{}`` reaches ``eval``. Such work runs in worker processes (`math.VerifierPool`) that
call :func:`confine` first. The rule for the parent: **nothing a confined process sends is
trusted**. It talks to its worker through :func:`send_frame` / :class:`FrameReader` (length-
prefixed bytes with a size limit and a deadline, never a pickle) and parses each message as
plain data with strict checks (`math._parse_reply`).

What :func:`confine` does, for good (an audit hook cannot be removed, PEP 578):

- caps the address space (``RLIMIT_AS``) and lifetime CPU time (``RLIMIT_CPU``; the pool
  also kills a worker that overruns one sample's wall-clock limit);
- empties the environment (``os.environ`` and the C ``environ``: no API keys, no
  ``HF_TOKEN``), replaces ``sys.argv`` with ``[""]`` and the multiprocessing auth key with
  random bytes (the parent's command line and key stay out of reach);
- takes the network away: a new, empty network namespace when the kernel allows it
  (``unshare(CLONE_NEWNET)``, or with a user namespace), and in every case the audit hook;
- adds an audit hook that refuses: sockets, subprocesses, ``exec``/``fork``/``kill``, all of
  ``ctypes`` (native calls, raw memory), changing resource limits, file writes, removals,
  renames and permission changes, ``putenv``, ``chdir``, ``gc.get_objects``/
  ``get_referrers``/``get_referents``, ``sys._current_frames``, and every ``open``,
  ``os.listdir``, ``os.scandir`` and native-extension import outside the read-only
  allow-list: Python's standard library and site-packages, paths resolved as the kernel would
  (relative to the working directory, symlinks and ``..`` followed). ``/etc``,
  ``/proc/self/environ``, the user's home and project, ``/tmp``: refused, reading included.
  Directories may be listed but not opened (no directory descriptors, so no ``dir_fd``
  tricks), descriptors are never accepted as paths. Modules the verifier needs from
  elsewhere must be imported before :func:`confine` (the pool's worker has its verify
  function's module imported by then).

The hook is a closure over C functions and immutable values: code in the worker can rebind
any module global or builtin (``sandbox._REFUSED_EVENTS``, ``os.path.realpath``,
``isinstance``) without changing what it refuses. Each refusal raises `SandboxViolation` (a
``PermissionError``) and is counted (:func:`refusals`); the pool replaces a worker whose
sample made the sandbox refuse anything.

What is NOT confined (and why the parent treats every reply as hostile bytes):

- ``sys._getframe`` and frame attributes stay allowed: logging (math-verify logs on its
  failure paths), ``typing`` and ``collections.namedtuple`` need them. They reach only this
  process's own objects, and the worker's channel is writable anyway (a descriptor number is
  easy to guess; writes to open descriptors are not audited), so the parent's parser is the
  boundary, not the hook. Likewise stdout/stderr stay open: a worker can write to the logs.
- ``os.stat`` and friends are not audited: a worker can learn whether a path exists, its size
  and times, never its contents.
- Signals through ``os.pidfd_open`` + ``signal.pidfd_send_signal`` are not audited: a worker
  could signal processes of its own user, the parent included (a seccomp filter would close
  this; the parent's death is an environment-actor failure, not a leak).
- The hook binds Python code only; native code already loaded is bound by the kernel limits
  and the network namespace, not by the file rules.
- A worker serves many samples: code that ran in it could change how it scores later ones
  (monkey-patching needs no refused event). It is replaced after any refusal; a quiet
  attacker that touches nothing refused is not detected.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import resource
import select
import struct
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from stat import S_ISDIR, S_ISLNK

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

# Audit events (https://docs.python.org/3.11/library/audit_events.html) refused after confine().
_REFUSED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                     "ctypes.", "resource.setrlimit", "resource.prlimit")  # fmt: skip
_REFUSED_EVENTS = frozenset({
    "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "shutil.rmtree",
    "os.remove", "os.rename", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
    "os.truncate", "os.putenv", "os.chdir", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "sys._current_frames"})  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_refused: list[int] = [0]  # how many operations the hook refused (observability only)


class SandboxViolation(PermissionError):
    """Code in a confined process tried something the sandbox refuses."""


@dataclass(frozen=True)
class Confinement:
    memory_bytes: int | None
    cpu_seconds: int | None
    network_namespace: bool  # the kernel took the network away (else: the audit hook only)
    readable: tuple[str, ...]  # the only folders it may read (standard library, site-packages)


def confine(memory_bytes: int | None, cpu_seconds: int | None) -> Confinement:
    """Limit this process for good (see the module docstring). Call it once, after importing
    everything the confined work needs."""
    global _refused
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if cpu_seconds is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        limit = int(used.ru_utime + used.ru_stime) + cpu_seconds
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))  # SIGXCPU, then SIGKILL
    os.environ.clear()  # unsetenv for each: the C environ too (os.environb shares the data)
    sys.argv = [""]
    multiprocessing.current_process().authkey = os.urandom(32)
    netns = _new_network_namespace()
    roots = readable_roots()
    hook, _refused = _make_hook(roots)
    sys.addaudithook(hook)
    return Confinement(memory_bytes, cpu_seconds, netns, roots)


def readable_roots() -> tuple[str, ...]:
    """The standard library and site-packages folders (the read allow-list), as configured
    and with symlinks resolved."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    return tuple(
        sorted({os.path.normpath(p) for p in found} | {os.path.realpath(p) for p in found})
    )


def refusals() -> int:
    """How many operations the sandbox has refused in this process so far."""
    return _refused[0]


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


def _make_resolver() -> Callable[[object], str | None]:
    """``resolve(path)``: the path made absolute, with ``..`` and symlinks followed as the
    kernel would; None for anything but a plain str or bytes path. Bound like the hook."""
    lstat, readlink, getcwd, is_link = os.lstat, os.readlink, os.getcwd, S_ISLNK
    item, type_, str_, bytes_, oserror = tuple.__getitem__, type, str, bytes, OSError
    encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()

    def resolve(path: object) -> str | None:
        if type_(path) is bytes_:
            path = path.decode(encoding, errors)
        if type_(path) is not str_ or "\0" in path:
            return None  # a descriptor, or anything but a plain str or bytes
        try:
            pending = (path if path.startswith("/") else getcwd() + "/" + path).split("/")[::-1]
            resolved, links = "", 0
            while pending:
                part = pending.pop()
                if part in ("", "."):
                    continue
                if part == "..":
                    resolved = resolved[: resolved.rfind("/")] if resolved else ""
                    continue
                candidate = resolved + "/" + part
                try:
                    mode = item(lstat(candidate), 0)
                except oserror:  # missing: the open fails there anyway
                    mode = 0
                if not is_link(mode):
                    resolved = candidate
                    continue
                links += 1
                if links > 40:  # a symlink loop
                    return None
                target = readlink(candidate)
                resolved = "" if target.startswith("/") else resolved
                pending.extend(target.split("/")[::-1])
        except oserror:
            return None
        return resolved or "/"

    return resolve


def _make_hook(roots: tuple[str, ...]) -> tuple[Callable[[str, tuple], None], list[int]]:
    """The audit hook and its refusal counter. Code under the hook can rebind any global or
    builtin and patch mutable types (``os.stat_result``), so the hook uses none: each name it
    calls is bound here to a C function, an immutable built-in type's method or value."""
    refused_events, refused_prefixes, write_flags = _REFUSED_EVENTS, _REFUSED_PREFIXES, _WRITE_FLAGS
    root_set, under_root = frozenset(roots), tuple(r.rstrip("/") + "/" for r in roots)
    resolve, stat_, is_dir, item = _make_resolver(), os.stat, S_ISDIR, tuple.__getitem__
    type_, str_, int_, oserror, violation = type, str, int, OSError, SandboxViolation
    count = [0]

    def readable(path: object, directory: bool) -> bool:
        """Under the allow-list; a file (no directory descriptors) unless ``directory``."""
        real = resolve(path)
        if real is None or not (real in root_set or real.startswith(under_root)):
            return False
        try:
            return directory or not is_dir(item(stat_(real), 0))
        except oserror:
            return True  # missing: the open fails with FileNotFoundError

    def reason(event: str, args: tuple) -> str | None:
        if event in refused_events or event.startswith(refused_prefixes):
            return event
        if event == "open":
            path, mode, flags = args
            text = mode if type_(mode) is str_ else ""
            writes = "w" in text or "a" in text or "x" in text or "+" in text
            if writes or type_(flags) is not int_ or flags & write_flags:
                return f"open({path!r}) for writing"
            if not readable(path, False):
                return f"open({path!r}) outside the standard library and site-packages"
        elif event in ("os.listdir", "os.scandir"):
            if not readable("." if args[0] is None else args[0], True):
                return f"{event}({args[0]!r}) outside the standard library and site-packages"
        elif event == "import" and args[1] is not None and not readable(args[1], False):
            return f"importing {args[0]!r} from {args[1]!r}"
        return None

    def hook(event: str, args: tuple) -> None:
        why = reason(event, args)
        if why is not None:
            count[0] += 1
            raise violation(f"sandbox: {why} is not allowed while checking model output")

    return hook, count


# --- The channel: length-prefixed frames over a socket or pipe descriptor ------------------
# A frame is a 4-byte big-endian signed length, then that many bytes. The confined side uses
# the blocking `write_frame` / `read_frame`; the parent uses `send_frame` (a deadline) and
# `FrameReader` (non-blocking, a size limit), so a worker that sends too much, too little or
# nothing at all cannot make the parent allocate, block or wait past its deadline.

_HEADER = struct.Struct("!i")


class ProtocolViolation(ValueError):
    """A confined process sent something that is not a well-formed message."""


def write_frame(fd: int, payload: bytes) -> None:
    """Write one frame to a blocking descriptor (the confined side)."""
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def read_frame(fd: int) -> bytes | None:
    """Read one frame from a blocking descriptor (the confined side); None at end of file."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    payload = _read_exactly(fd, size) if size > 0 else b""
    if payload is None:
        raise EOFError("the channel closed inside a frame")
    return payload


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_frame(fd: int, payload: bytes, deadline: float) -> None:
    """Write one frame to a non-blocking descriptor before ``deadline`` (``time.monotonic``);
    TimeoutError if the reader does not take it in time, OSError if it is gone."""
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while data:
        try:
            data = data[os.write(fd, data) :]
            continue
        except BlockingIOError:
            pass
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0:
            raise TimeoutError(f"the reader did not take {len(payload)} bytes in time")
        poller.poll(left_ms)


class FrameReader:
    """Reads frames from a non-blocking descriptor without ever blocking (the parent side).

    `read` takes what has arrived and returns the complete frames; a partial frame waits in
    the buffer (the caller's deadline decides how long). A declared length over
    ``max_bytes`` (or negative) raises `ProtocolViolation` before anything is allocated.
    """

    def __init__(self, fd: int, max_bytes: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    def read(self) -> list[bytes]:
        """The frames completed by what is readable now. EOFError when the writer is gone."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            raise EOFError("the channel closed")
        self._buffer += chunk
        frames = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if not 0 <= size <= self.max_bytes:
                raise ProtocolViolation(
                    f"a message of {size} bytes was announced (the limit is {self.max_bytes})"
                )
            if len(self._buffer) < _HEADER.size + size:
                break
            frames.append(bytes(self._buffer[_HEADER.size : _HEADER.size + size]))
            del self._buffer[: _HEADER.size + size]
        return frames
