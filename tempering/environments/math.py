"""Math answer verification environment (math-verify), safe against runaway verification.

`MathEnvironment` scores the last assistant message of each conversation against
``metadata[i]["ground_truth"]`` with the ``math-verify`` library: ``\\boxed{1/2}``, ``0.5`` and
``\\frac{1}{2}`` are all the same answer. math-verify enforces its own time limits with
``signal.alarm``, which does not work in threaded/async Ray actors, so we call it with
``parsing_timeout=None`` / ``timeout_seconds=None`` and enforce the per-sample limit
ourselves: a `VerifierPool` of ``num_workers`` worker processes, each sample sent to one
worker with a deadline. A worker that misses the deadline is killed and replaced; the sample
scores 0 and is counted (``env/math_timeouts``). Unparseable answers score 0 and are counted
(``env/math_parse_failures``), as are verifier exceptions (``env/math_errors``). Nothing here
crashes the training step. An answer must be a value: a computation on numerals left undone
(``4 - 5 + 3``, which math-verify evaluates) is not one (`math_verify_score`).

The workers are confined (`sandbox.py`: limits, no network, an empty environment, no file
reads outside Python's own folders) and untrusted: a worker's reply crosses back as a JSON
object in a size-limited frame, read without blocking and checked field by field
(`_parse_reply`), never unpickled. A malformed reply scores its sample as an error, counted in
``env/math_protocol_errors``, and the worker is replaced; what the sandbox refused is counted
in ``env/math_sandbox_refusals`` (a worker that had something refused is replaced too).

Workers are started with the ``forkserver`` method: safe inside threaded Ray actors, and a
replacement worker forks from a server that has math-verify (sympy) imported already, so it
is ready in milliseconds instead of the seconds a fresh interpreter needs. This module does
not import torch at import time, to keep those worker processes lean.

The class is plain (unit-testable without Ray); the controller runs it as an actor with
`make_math_environment_actor` (``ray.remote(num_cpus=0)``: it only waits on its workers).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import multiprocessing as mp
import re
import resource
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from math_verify import parse, verify

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    last_assistant_content,
    samples,
)
from tempering.environments.sandbox import (
    FrameReader,
    ProtocolViolation,
    confine,
    read_frame,
    send_frame,
    write_frame,
)
from tempering.environments.sandbox import refusals as sandbox_refusals

__all__ = [
    "MathEnvironment",
    "VerifierPool",
    "VerifyOutcome",
    "make_math_environment_actor",
    "math_verify_score",
]

log = logging.getLogger(__name__)

# verify_fn(response, ground_truth) -> (reward, extracted answer or None when unparseable)
VerifyFn = Callable[[str, str], tuple[float, str | None]]


def math_verify_score(response: str, ground_truth: str) -> tuple[float, str | None]:
    """Score `response` against `ground_truth` with math-verify.

    The ground truth is parsed as ``\\boxed{ground_truth}``; the response is parsed with
    math-verify's default extraction (``\\boxed{}`` preferred, then LaTeX/expressions).
    Returns ``(1.0 or 0.0, extracted answer)``, or ``(0.0, None)`` when the response has no
    parseable answer. No internal timeouts: run it under `VerifierPool` for a time limit.

    An answer is a value, not a computation on numerals left undone: math-verify evaluates
    what it extracts, and from "the final answer is 4 - 5 + 3 - 4 + 9 = 4" it takes the
    problem restated (``4 - 5 + 3 - 4 + 9``, 7) -- SmolLM2 trained on reasoning-gym's chain
    sums learned within 16 GRPO steps to restate each problem so and scored 100% held out
    while every stated result was wrong. Such an extraction counts by what the response says
    it equals (``= 4``: scored as 4), and with no value stated the response has no answer
    (unparseable). A single fraction (``3/4``) and anything with a symbol stay answers.
    """
    gold = parse("\\boxed{" + str(ground_truth) + "}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}.")
    pred = parse(response, parsing_timeout=None)
    for _ in range(4):  # "= 2 + 3 = 5" chains: follow each stated value
        if not pred or not _unevaluated(str(pred[-1])):
            break
        pred = _stated_value(response, str(pred[-1]))
    if not pred or _unevaluated(str(pred[-1])):
        return 0.0, None
    correct = verify(gold, pred, timeout_seconds=None)
    return (1.0 if correct else 0.0), str(pred[-1])  # parse() gives [sympy value, its text]


# a computation on numerals left undone: two or more numbers joined by operators ("4 - 5 + 3",
# "2*3", "(7)+(-2)", "6 \\times 7"), except one fraction of two integers ("3/4", an answer)
_NUMBER = r"\(?[-+]?\d+(?:[.,]\d+)*\)?"
_OPERATOR = r"(?:[-+*/^×÷·]|\\times|\\cdot|\\div)"
_COMPUTATION = re.compile(rf"[-+]?{_NUMBER}(?:{_OPERATOR}{_NUMBER})+")
_FRACTION = re.compile(r"[-+]?\d+/\d+")


def _unevaluated(text: str) -> bool:
    compact = re.sub(r"\s+", "", text).rstrip(".,;:!")  # "= 4 - 5 + 3." ends a sentence
    return bool(_COMPUTATION.fullmatch(compact)) and not _FRACTION.fullmatch(compact)


def _stated_value(response: str, expression: str) -> list:
    """math-verify's parse of what ``response`` says ``expression`` equals (the rest of the line
    after its last ``expression =``), [] where it says nothing."""
    at = response.rfind(expression)
    if at < 0:
        return []
    stated = re.match(r"\s*=\s*([^\n]+)", response[at + len(expression) :])
    return parse(stated.group(1), parsing_timeout=None) if stated else []


class VerifyOutcome(NamedTuple):
    status: str  # "ok" | "parse_failure" | "timeout" | "error"
    reward: float
    answer: str | None


# The wire protocol between the pool and its confined workers: JSON objects in length-
# prefixed frames (`sandbox.send_frame` / `FrameReader`), never pickles. Parent -> worker:
# {"id": n, "response": str, "ground_truth": str}. Worker -> parent: first
# {"ready": true, "network_namespace": bool}, then one reply per request:
# {"id": n, "status": "ok"|"parse_failure"|"error", "reward": float, "answer": str|null,
#  "retire": bool, "refused": int}. `_parse_reply` checks every field; anything else is a
# protocol violation: the sample scores as an error and the worker is replaced.
MAX_REPLY_BYTES = 1 << 16
MAX_ANSWER_CHARS = 4096  # an extracted answer is for logs; longer ones are cut, and say so
MAX_ERROR_CHARS = 1000
_REPLY_KEYS = frozenset({"id", "status", "reward", "answer", "retire", "refused"})


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=True, allow_nan=False).encode("ascii")


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"


def _json_object(frame: bytes, keys: frozenset[str]) -> dict[str, Any]:
    """The frame as a JSON object with exactly ``keys``; ProtocolViolation otherwise."""
    try:
        message = json.loads(frame, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # not UTF-8 / not JSON / nested too deep
        raise ProtocolViolation(f"not a JSON message ({type(exc).__name__})") from None
    if type(message) is not dict or message.keys() != keys:
        found = sorted(message) if type(message) is dict else type(message).__name__
        raise ProtocolViolation(f"expected a JSON object with keys {sorted(keys)}, got {found}")
    return message


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def _parse_ready(frame: bytes) -> bool:
    """The worker's first message; returns whether it runs in its own network namespace."""
    message = _json_object(frame, frozenset({"ready", "network_namespace"}))
    if message["ready"] is not True or type(message["network_namespace"]) is not bool:
        raise ProtocolViolation(f"malformed ready message {frame[:200]!r}")
    return message["network_namespace"]


def _parse_reply(frame: bytes, request_id: int) -> tuple[VerifyOutcome, bool, int]:
    """One reply, checked field by field: (outcome, retire, sandbox refusals)."""
    m = _json_object(frame, _REPLY_KEYS)
    status, reward, answer = m["status"], m["reward"], m["answer"]
    problems = []
    if type(m["id"]) is not int or m["id"] != request_id:
        problems.append(f"id {m['id']!r} is not the request's {request_id}")
    if type(reward) is not float or not math.isfinite(reward):
        problems.append(f"reward {reward!r} is not a finite float")
    expected_answer = {"ok": str, "parse_failure": type(None), "error": str}.get(status)
    if expected_answer is None:
        problems.append(f"status {status!r} is not ok, parse_failure or error")
    elif type(answer) is not expected_answer:
        problems.append(f"answer {str(answer)[:100]!r} does not go with status {status!r}")
    elif status != "ok" and reward != 0.0:
        problems.append(f"reward {reward!r} with status {status!r} (expected 0.0)")
    if type(m["retire"]) is not bool:
        problems.append(f"retire {m['retire']!r} is not a bool")
    if type(m["refused"]) is not int or m["refused"] < 0:
        problems.append(f"refused {m['refused']!r} is not a count")
    if problems:
        raise ProtocolViolation("; ".join(problems))
    return VerifyOutcome(status, reward, answer), m["retire"], m["refused"]


def _verify_one(verify_fn: VerifyFn, response: str, ground_truth: str) -> dict[str, Any]:
    """Run `verify_fn` on one sample; its outcome as reply fields (never raises)."""
    try:
        reward, answer = verify_fn(response, ground_truth)
        if answer is None:
            return {"status": "parse_failure", "reward": 0.0, "answer": None}
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"the verify function returned a non-finite reward {reward!r}")
        return {"status": "ok", "reward": reward, "answer": _shorten(str(answer), MAX_ANSWER_CHARS)}
    except Exception as exc:  # a bad sample must not kill the worker
        error = _shorten(f"{type(exc).__name__}: {exc}", MAX_ERROR_CHARS)
        return {"status": "error", "reward": 0.0, "answer": error}


def _worker_main(conn: Connection, verify_fn: VerifyFn, limits: tuple[int, int] | None) -> None:
    """Worker process loop: confine this process (``limits`` = (memory bytes, CPU seconds),
    see `sandbox.py`), then answer requests (see the wire protocol above). It retires (exits
    after its reply) when its CPU budget is nearly spent or the sandbox refused anything
    during the sample (code that tried once may have changed this process)."""
    fd = conn.fileno()  # `conn` stays referenced: it owns the descriptor
    netns = confine(*limits).network_namespace if limits else False
    write_frame(fd, _encode({"ready": True, "network_namespace": netns}))
    while True:
        try:
            frame = read_frame(fd)
        except OSError:  # reset: the pool closed the channel with our ready message unread
            return
        if frame is None:  # the pool closed the channel
            return
        request = json.loads(frame)
        before = sandbox_refusals()
        reply = _verify_one(verify_fn, request["response"], request["ground_truth"])
        refused = sandbox_refusals() - before
        used = resource.getrusage(resource.RUSAGE_SELF)
        retire = bool(limits) and (refused > 0 or used.ru_utime + used.ru_stime > 0.8 * limits[1])
        write_frame(
            fd, _encode({"id": request["id"], **reply, "retire": retire, "refused": refused})
        )
        if retire:
            return


class _Worker:
    def __init__(self, ctx: Any, verify_fn: VerifyFn, limits: tuple[int, int] | None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child, verify_fn, limits), daemon=True
        )
        self.process.start()
        child.close()
        self.reader = FrameReader(self.conn.fileno(), MAX_REPLY_BYTES)
        self.ready = False
        self.network_namespace = False
        self.started_at = time.monotonic()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class _Job(NamedTuple):
    index: int  # the item's place in `map`'s input
    deadline: float  # time.monotonic() by which the reply must have arrived
    request_id: int


class VerifierPool:
    """``num_workers`` processes running `verify_fn`, each sample with a time limit.

    `map` sends samples to idle workers; a sample whose worker has not answered within
    ``timeout_s`` (counted from when the sample was sent to a ready worker) gets a
    ``"timeout"`` outcome and its worker is killed and replaced. `verify_fn` must be
    importable by reference (a module-level function); with ``forkserver`` its module is
    preloaded in the fork server along with this one (when this pool starts the server).

    Each worker is confined (`sandbox.confine`): at most ``memory_limit_mb`` of address
    space and ``cpu_limit_s`` of CPU over its life (it retires, and is replaced, after the
    sample that takes it past 80% of that), an empty environment, no network, no
    subprocesses, no file writes, no reads outside the standard library and site-packages.
    Replies are untrusted bytes: a reply that is not a well-formed JSON message for the
    sample asked (too long, not JSON, wrong fields or types, another sample's id, a message
    nobody asked for) scores that sample as an ``"error"``, is counted in
    `num_protocol_errors` and logged, and the worker is replaced. ``memory_limit_mb=None``
    runs unconfined (trusted verify functions only).
    """

    def __init__(
        self,
        verify_fn: VerifyFn,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        startup_timeout_s: float = 120.0,
        start_method: str = "forkserver",
        memory_limit_mb: int | None = 1024,
        cpu_limit_s: int = 300,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds.")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            preload = [__name__, getattr(verify_fn, "__module__", __name__)]
            self._ctx.set_forkserver_preload([m for m in dict.fromkeys(preload) if m != "__main__"])
        self._verify_fn = verify_fn
        self._limits = None if memory_limit_mb is None else (memory_limit_mb * 2**20, cpu_limit_s)
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.num_replaced = 0
        self.num_retired = 0
        self.num_protocol_errors = 0  # replies that broke the wire protocol
        self.num_refusals = 0  # operations the sandbox refused, as the workers report them
        self._request_ids = itertools.count(1)
        self._workers = [self._start() for _ in range(num_workers)]

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self._verify_fn, self._limits)

    @property
    def network_namespace(self) -> bool:
        """Whether every ready worker runs without a network at the kernel level."""
        ready = [w for w in self._workers if w.ready]
        return bool(ready) and all(w.network_namespace for w in ready)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._start()
        self.num_replaced += 1

    def _startup_error(self, what: str) -> RuntimeError:
        name = getattr(self._verify_fn, "__qualname__", repr(self._verify_fn))
        module = getattr(self._verify_fn, "__module__", "?")
        return RuntimeError(
            f"A math verifier worker process {what}. Check that the verify function "
            f"{module}.{name} is importable in a fresh interpreter (module-level, no lambdas)."
        )

    def map(self, items: list[tuple[str, str]]) -> list[VerifyOutcome]:
        """Verify ``(response, ground_truth)`` pairs; outcomes come back in input order."""
        results: list[VerifyOutcome | None] = [None] * len(items)
        pending = deque(enumerate(items))
        busy: dict[_Worker, _Job] = {}
        while pending or busy:
            self._dispatch(pending, busy, results)
            starting = [w for w in self._workers if not w.ready]
            if any(time.monotonic() > w.started_at + self.startup_timeout_s for w in starting):
                raise self._startup_error(f"did not start within {self.startup_timeout_s} s")
            deadlines = [job.deadline for job in busy.values()]
            deadlines += [w.started_at + self.startup_timeout_s for w in starting]
            wait_s = max(0.0, min(deadlines, default=0.0) - time.monotonic())
            watched = {w.conn: w for w in self._workers if w in busy or not w.ready}
            for conn in wait(list(watched), timeout=wait_s):
                if watched[conn] in self._workers:  # not replaced by an earlier reply
                    self._receive(watched[conn], busy, results)
            now = time.monotonic()
            for worker, job in list(busy.items()):
                if now >= job.deadline:
                    busy.pop(worker)
                    results[job.index] = VerifyOutcome("timeout", 0.0, None)
                    self._replace(worker)
        return [r for r in results if r is not None]

    def _dispatch(self, pending: deque, busy: dict[_Worker, _Job], results: list) -> None:
        """Send the next samples to the ready, idle workers."""
        for worker in list(self._workers):
            if not pending or not worker.ready or worker in busy:
                continue
            index, (response, ground_truth) = pending.popleft()
            job = _Job(index, time.monotonic() + self.timeout_s, next(self._request_ids))
            request = {"id": job.request_id, "response": response, "ground_truth": ground_truth}
            try:
                send_frame(worker.conn.fileno(), _encode(request), job.deadline)
            except TimeoutError:  # it stopped reading: as good as a sample that never ends
                results[index] = VerifyOutcome("timeout", 0.0, None)
                self._replace(worker)
                continue
            except OSError:
                results[index] = VerifyOutcome("error", 0.0, "verifier process died")
                self._replace(worker)
                continue
            busy[worker] = job

    def _receive(self, worker: _Worker, busy: dict[_Worker, _Job], results: list) -> None:
        """Take what ``worker`` sent: its ready message, or its reply to the sample it has."""
        try:
            frames = worker.reader.read()
        except (EOFError, OSError):  # the worker died
            if not worker.ready:
                raise self._startup_error(
                    f"exited during start-up (exit code {worker.process.exitcode})"
                ) from None
            if worker in busy:
                results[busy.pop(worker).index] = VerifyOutcome(
                    "error", 0.0, "verifier process died"
                )
            self._replace(worker)
            return
        except ProtocolViolation as exc:
            return self._violation(worker, busy, results, str(exc))
        for frame in frames:
            if not worker.ready:  # sent before any model text ran in it: a bug, not an attack
                try:
                    worker.network_namespace = _parse_ready(frame)
                except ProtocolViolation as exc:
                    raise self._startup_error(f"sent a malformed ready message ({exc})") from None
                worker.ready = True
                continue
            if worker not in busy:
                return self._violation(worker, busy, results, "a message nobody asked for")
            try:
                outcome, retire, refused = _parse_reply(frame, busy[worker].request_id)
            except ProtocolViolation as exc:
                return self._violation(worker, busy, results, str(exc))
            results[busy.pop(worker).index] = outcome
            self.num_refusals += refused
            if retire:  # its CPU budget is nearly spent, or the sandbox refused something
                self._replace(worker)
                self.num_retired += 1
                return

    def _violation(
        self, worker: _Worker, busy: dict[_Worker, _Job], results: list, reason: str
    ) -> None:
        """A worker broke the protocol: its sample is an error, the worker is replaced."""
        self.num_protocol_errors += 1
        job = busy.pop(worker, None)
        if job is not None:
            results[job.index] = VerifyOutcome(
                "error", 0.0, f"verifier protocol violation: {reason}"
            )
        log.warning(
            "math verifier worker (pid %s) broke the reply protocol: %s; it is replaced and "
            "its sample scores as a verifier error",
            worker.process.pid,
            reason,
        )
        self._replace(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.conn.close()  # the worker reads end-of-file and exits
        for worker in self._workers:
            worker.process.join(timeout=2)
            worker.kill()
        self._workers = []


class VerifierErrorRateExceeded(RuntimeError):
    """More of a step's answers made the verifier raise than ``env.math.max_error_rate``
    allows: a broken verifier would otherwise score every sample 0 while the run trains on."""


class MathEnvironment(EnvironmentInterface):
    """Single-turn math: reward 1 when the last assistant answer equals the ground truth.

    ``metadata[i]["ground_truth"]`` holds the reference answer (a string such as ``"1/2"``).
    Counters (``env/math_timeouts``, ``env/math_parse_failures``, ``env/math_errors``,
    ``env/math_samples``) accumulate over `step` calls and are reported and reset by
    `global_post_process_and_metrics`. More errors in one step than ``max_error_rate`` of its
    answers raise `VerifierErrorRateExceeded` (the run stops, naming the first failing answer).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        verify_fn: VerifyFn = math_verify_score,
        memory_limit_mb: int = 1024,
        cpu_limit_s: int = 300,
        max_error_rate: float = 0.05,
    ) -> None:
        self.max_error_rate = max_error_rate
        self._pool = VerifierPool(
            verify_fn,
            num_workers=num_workers,
            timeout_s=timeout_s,
            memory_limit_mb=memory_limit_mb,
            cpu_limit_s=cpu_limit_s,
        )
        self._counts = dict.fromkeys(("timeout", "parse_failure", "error", "ok"), 0)
        self._replaced_reported = 0
        self._protocol_errors_reported = 0
        self._refusals_reported = 0

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        items = []
        for i, log, meta in samples("MathEnvironment", message_logs, metadata):
            if not meta or "ground_truth" not in meta:
                raise KeyError(
                    f"Sample {i} has no metadata['ground_truth'] (metadata={meta!r}); the math "
                    f"dataset must put the reference answer there."
                )
            items.append((last_assistant_content(log), str(meta["ground_truth"])))
        import torch  # lazily: see the module docstring

        outcomes = self._pool.map(items)
        for outcome in outcomes:
            self._counts[outcome.status] += 1
        self._check_error_rate(items, outcomes)
        rewards = torch.tensor([o.reward for o in outcomes], dtype=torch.float32)
        observations = [
            {"role": "environment", "content": "correct" if o.reward > 0 else "incorrect"}
            for o in outcomes
        ]
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[None] * len(items),
            rewards=rewards,
            terminateds=torch.ones(len(items), dtype=torch.bool),
            answers=[o.answer if o.status == "ok" else None for o in outcomes],
        )

    def _check_error_rate(self, items: list[tuple[str, str]], outcomes: list[Any]) -> None:
        failed = [i for i, o in enumerate(outcomes) if o.status == "error"]
        if not items or len(failed) / len(items) <= self.max_error_rate:
            return
        first = failed[0]
        raise VerifierErrorRateExceeded(
            f"the math verifier failed on {len(failed)} of {len(items)} answers in one step "
            f"({len(failed) / len(items):.0%} > env.math.max_error_rate={self.max_error_rate}); "
            f"the first: answer {items[first][0][-200:]!r} (expected {items[first][1]!r}) -> "
            f"{outcomes[first].answer}. Check the verifier (env.reward_fn, math-verify's install) "
            "or raise env.math.max_error_rate if such answers are expected"
        )

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """Report (and reset) the verification counters; ``env/math_accuracy`` when the batch
        carries ``rewards``."""
        metrics = {
            "env/math_samples": float(sum(self._counts.values())),
            "env/math_timeouts": float(self._counts["timeout"]),
            "env/math_parse_failures": float(self._counts["parse_failure"]),
            "env/math_errors": float(self._counts["error"]),
            "env/math_workers_replaced": float(self._pool.num_replaced - self._replaced_reported),
            # replies that broke the wire protocol (each scored as an error, worker replaced)
            "env/math_protocol_errors": float(
                self._pool.num_protocol_errors - self._protocol_errors_reported
            ),
            # operations the sandbox refused (file reads, network, ...): attempts to escape
            "env/math_sandbox_refusals": float(self._pool.num_refusals - self._refusals_reported),
            # 1: the verifiers have no network at the kernel level (else only the audit hook)
            "env/math_sandbox_netns": float(self._pool.network_namespace),
        }
        self._replaced_reported = self._pool.num_replaced
        self._protocol_errors_reported = self._pool.num_protocol_errors
        self._refusals_reported = self._pool.num_refusals
        if "rewards" in batch:
            import torch

            metrics["env/math_accuracy"] = float(torch.as_tensor(batch["rewards"]).float().mean())
        self._counts = dict.fromkeys(self._counts, 0)
        return batch, metrics

    def shutdown(self) -> None:
        self._pool.close()


def make_math_environment_actor(**kwargs: Any) -> Any:
    """Start `MathEnvironment` as a Ray actor (``num_cpus=0``), as GRPO starts it; returns the
    actor handle."""
    import ray

    from tempering.environments.actors import actor_class

    return ray.remote(num_cpus=0)(actor_class(MathEnvironment)).remote(**kwargs)
