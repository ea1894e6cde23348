"""The rollout collector of asynchronous GRPO: a thread of the controller that generates the
batches of coming steps on the generation workers while the policy workers train.

Schedule (``max_age`` = ``grpo.async_grpo.max_trajectory_age_steps``): the batch for step
``t`` is generated with weight version ``max(0, t - 1 - max_age)`` -- exactly that version,
never a later one -- so the trainer's policy at step ``t`` (version ``t - 1``) is at most
``max_age`` versions ahead of every sample it trains on, and a run's samples do not depend on
thread timing:

- the collector starts batch ``t`` once the generator holds version ``t - 1 - max_age``
  (it pauses when that far ahead of the trainer);
- the refit to version ``u`` waits until every batch ``t <= u + max_age`` is in the buffer
  (drain-then-refit: no batch mixes weight versions).

With in-flight weight updates (``in_flight_weight_updates``) the trainer does not wait for the
drain: the refit to version ``u`` reaches the generation workers while they generate, and the
batch in progress goes on with version ``u`` from the next decode step. Its tokens record
their versions, each group is tagged with its oldest, and ages stay within ``max_age``; a
run's samples then depend on timing.

With ``max_age = 1`` the batch of step ``t + 1`` is generated while step ``t`` trains: one
step off-policy, the overlap NeMo RL and verl call one-step-off. ``max_age = 0`` is the
synchronous schedule (no overlap).

Why a thread in the controller and not a Ray actor: the controller already holds everything a
rollout needs (the chat service, the environments' handles, the data loader, the HTTP
server); generation itself runs in the generation workers' processes, so the overlap with the
policy workers is real, and the thread only waits on them. Groups never cross the object
store twice, and the collector's stack is in this process when it stalls.

Failure is named, never a hang: a batch that raises is retried (``max_failures`` in the run),
a dead worker ends it at once; the trainer's waits (for a batch, or for the drain before a
refit) end after ``stall_timeout_s`` with :class:`CollectorStalledError` carrying the
collector thread's stack, and a collector that died re-raises its error in the trainer as
:class:`CollectorDiedError`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tempering.experience.replay_buffer import oldest_token_version

log = logging.getLogger(__name__)

__all__ = ["CollectorDiedError", "CollectorStalledError", "RolloutCollector"]


class CollectorDiedError(RuntimeError):
    """The collector thread ended with an error; the run cannot get new batches."""


class CollectorStalledError(TimeoutError):
    """The trainer waited longer than its deadline for the collector."""


def _version_for(step: int, max_age: int) -> int:
    """The weight version the batch of ``step`` is generated with."""
    return max(0, step - 1 - max_age)


def _tag(group: Any, started_with: int) -> tuple[int, Any]:
    """A group's weight version for the buffer: the version its batch started with, or --
    with in-flight weight updates, whose tokens carry their versions -- the oldest version
    that generated one of its tokens (a refit may land before its first token)."""
    versions = group.get("generation_weight_versions")
    if versions is None:
        return started_with, None
    return oldest_token_version(versions, started_with), versions


class RolloutCollector:
    """Generates step after step into ``buffer`` on a daemon thread (see the module docstring).

    ``produce(step)`` returns the flat batch of ``step`` (``group_size`` consecutive rows per
    prompt); ``buffer`` is a `ReplayBuffer`. ``next_step`` is the first step whose batch is
    not in the buffer yet, ``weight_version`` the generator's version now, ``last_step`` the
    run's last (nothing is generated beyond it)."""

    def __init__(
        self,
        produce: Callable[[int], Any],
        buffer: Any,
        *,
        group_size: int,
        max_age: int,
        next_step: int,
        weight_version: int,
        last_step: int | None = None,
        max_failures: int = 0,
        failures: int = 0,
        stall_timeout_s: float = 600.0,
        phases: Any = None,
    ) -> None:
        self.produce = produce
        self.buffer = buffer
        self.group_size = group_size
        self.max_age = max_age
        self.next_step = next_step
        self.weight_version = weight_version
        self.last_step = last_step
        self.max_failures = max_failures
        self.stall_timeout_s = stall_timeout_s
        self.phases = phases
        self.failures = failures  # retried batches so far in the run (a resumed run's too)
        self._cv = threading.Condition()
        self._busy = False  # a batch is being generated
        self._paused = 0  # quiesce() holders
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-collector", daemon=True)

    # ---------------------------------------------------------------- the thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the thread to end after its current batch; wait up to ``timeout_s``."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _may_generate(self) -> bool:
        return (
            self._paused == 0
            and (self.last_step is None or self.next_step <= self.last_step)
            and self.weight_version >= _version_for(self.next_step, self.max_age)
            and self.buffer.has_room()
        )

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self._may_generate())
                    if self._stop:
                        return
                    self._busy = True
                    step, version = self.next_step, self.weight_version
                groups = None
                try:
                    batch = self._produce_with_retries(step)
                    groups = [batch.select_indices(range(i, i + self.group_size))
                              for i in range(0, batch.size, self.group_size)]  # fmt: skip
                finally:
                    # One locked block: whoever sees the collector idle (a checkpoint under
                    # quiesce, the drain before a refit) sees the step's groups in the buffer
                    # and next_step past it, never one without the other.
                    with self._cv:
                        if groups is not None:
                            for group in groups:
                                self.buffer.push(group, *_tag(group, version))
                            self.next_step = step + 1
                        self._busy = False
                        self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 -- handed to the trainer, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _produce_with_retries(self, step: int) -> Any:
        from tempering.distributed.worker_groups import WorkerDiedError

        while True:
            try:
                if self.phases is None:
                    return self.produce(step)
                with self.phases.phase("collector", "generation", step):
                    return self.produce(step)
            except WorkerDiedError:
                raise  # a dead generation worker does not come back by retrying
            except Exception as e:
                self.failures += 1
                if self.failures > self.max_failures:
                    raise
                log.warning(
                    "collector: generating the batch of step %d failed (%s: %s); retrying "
                    "(%d of grpo.async_grpo.max_generation_failures=%d used)",
                    step, type(e).__name__, e, self.failures, self.max_failures,
                )  # fmt: skip

    # ---------------------------------------------------------------- the trainer's side
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the lock) until ``ready()``; a dead or stalled collector raises."""
        deadline = time.monotonic() + self.stall_timeout_s
        while not ready():
            if self._error is not None:
                self._raise_error(f"while the trainer waited for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectorStalledError(
                    f"the trainer waited {self.stall_timeout_s:.0f} s "
                    f"(grpo.async_grpo.starvation_timeout_s) for {what}; the collector is at "
                    f"step {self.next_step} with weight version {self.weight_version}, "
                    f"{'generating' if self._busy else 'idle'}. Its stack:\n{self.stack()}"
                )
            self._cv.wait(timeout=min(left, 5.0))

    def take(self, step: int, num_groups: int) -> tuple[list[Any], dict[str, float]]:
        """The ``num_groups`` groups step ``step`` trains on (waits for them), and the
        ``train/*`` metrics of what was taken: trajectory ages, buffer size, stale drops."""
        trainer_version = step - 1
        with self._cv:
            self._wait(
                lambda: self.buffer.ready(num_groups, trainer_version, self.max_age),
                f"the batch of step {step}",
            )
            taken = self.buffer.take(num_groups, trainer_version, self.max_age)
            self._cv.notify_all()  # room in the buffer
            metrics = {**self.buffer.metrics(), "train/generation_failures": float(self.failures)}
            return [t.group for t in taken], metrics

    def wait_for_drain(self, version: int) -> None:
        """Before the refit to ``version``: every batch generated with an older version is in
        the buffer, and nothing is being generated."""
        last = version + self.max_age  # the last step generated with version - 1 or older
        if self.last_step is not None:
            last = min(last, self.last_step)
        with self._cv:
            self._wait(
                lambda: self.next_step > last and not self._busy,
                f"the collector to finish the batches up to step {last} before the refit to "
                f"weight version {version}",
            )

    def weights_loaded(self, version: int) -> None:
        """The generator now holds ``version``: the collector may go on."""
        with self._cv:
            self.weight_version = version
            self._cv.notify_all()

    @contextmanager
    def quiesce(self) -> Iterator[None]:
        """Hold the collector between batches (for a checkpoint of the buffer)."""
        with self._cv:
            self._paused += 1
            try:
                self._wait(lambda: not self._busy, "the collector's batch before a checkpoint")
            except BaseException:
                self._paused -= 1
                raise
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()

    def raise_if_dead(self) -> None:
        with self._cv:
            if self._error is not None:
                self._raise_error("")

    def _raise_error(self, when: str) -> None:
        """A dead generation worker is re-raised as itself (the `WorkerDiedError` naming it,
        which `fault_tolerance.max_restarts` restarts from); anything else as
        `CollectorDiedError`."""
        from tempering.distributed.worker_groups import WorkerDiedError

        if isinstance(self._error, WorkerDiedError):
            raise self._error
        raise CollectorDiedError(
            f"the rollout collector died{' ' + when if when else ''}: "
            f"{type(self._error).__name__}: {self._error}"
        ) from self._error

    def stack(self) -> str:
        """The collector thread's current Python stack (for stall reports)."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "  (the collector thread is not running)"
        return "".join(traceback.format_stack(frame))

    def state_dict(self) -> dict[str, Any]:
        """Where the collector is; call under `quiesce` together with the buffer's."""
        return {"next_step": self.next_step, "failures": self.failures}
