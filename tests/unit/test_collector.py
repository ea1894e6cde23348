"""The async GRPO rollout collector (tempering/experience/collector.py) against the real replay
buffer, with a scripted `produce` in place of rollouts (what is under test is the schedule and
the failure handling; the rollouts are GRPO's own, tested elsewhere). No sleeps: every wait is
on the collector's own condition, bounded by its stall deadline."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.worker_groups import WorkerDiedError
from tempering.experience.collector import (
    CollectorDiedError,
    CollectorStalledError,
    RolloutCollector,
)
from tempering.experience.replay_buffer import ReplayBuffer

G, P = 2, 3  # rows per group, groups per step


class Script:
    """produce(step): a batch whose rows carry the step and the generator's version then."""

    def __init__(self) -> None:
        self.collector: RolloutCollector | None = None
        self.calls: list[tuple[int, int]] = []  # (step, weight version while generating)
        self.fail: dict[int, BaseException] = {}  # step -> raised once
        self.gate: dict[int, threading.Event] = {}  # step -> wait for this before returning

    def __call__(self, step: int) -> BatchedDataDict:
        version = self.collector.weight_version
        self.calls.append((step, version))
        if step in self.gate:
            self.gate[step].wait(timeout=30)
        if step in self.fail:
            raise self.fail.pop(step)
        return BatchedDataDict(
            step=torch.full((G * P,), step), version=torch.full((G * P,), version)
        )


def make(max_age: int = 1, *, next_step: int = 1, version: int = 0, **kw) -> tuple:
    script = Script()
    buffer = ReplayBuffer(max_size=P * (max_age + 1))
    c = RolloutCollector(script, buffer, group_size=G, max_age=max_age, next_step=next_step,
                         weight_version=version, stall_timeout_s=kw.pop("stall", 20.0), **kw)  # fmt: skip
    script.collector = c
    return c, script


def train_steps(c: RolloutCollector, first: int, last: int) -> list[BatchedDataDict]:
    """What the trainer does per step: take, (train), drain, refit, go on."""
    batches = []
    for step in range(first, last + 1):
        groups, metrics = c.take(step, P)
        batches.append(BatchedDataDict.from_batches(groups))
        assert metrics["train/max_trajectory_age"] <= c.max_age
        c.wait_for_drain(step)
        c.weights_loaded(step)
    return batches


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_each_step_is_generated_with_exactly_its_scheduled_version(max_age):
    c, script = make(max_age, last_step=6)
    c.start()
    try:
        batches = train_steps(c, 1, 6)
    finally:
        c.stop()
    for step, batch in enumerate(batches, start=1):
        assert batch["step"].tolist() == [step] * (G * P)  # exact take, in order
        assert set(batch["version"].tolist()) == {max(0, step - 1 - max_age)}
    assert [s for s, _ in script.calls] == list(range(1, 7))  # nothing past last_step


def test_pauses_when_ahead_and_resumes_after_the_refit():
    c, script = make(max_age=1)
    c.start()
    try:
        c.take(1, P)  # batch 1 (version 0); the collector may make batch 2 with version 0
        with c._cv:  # batch 3 needs version 1: the collector must be waiting, not generating
            c._cv.wait_for(lambda: c.next_step == 3 and not c._busy, timeout=20)
        assert [s for s, _ in script.calls] == [1, 2]
        c.wait_for_drain(1)
        c.weights_loaded(1)
        groups, _ = c.take(2, P)
        assert {int(g["version"][0]) for g in groups} == {0}
        with c._cv:
            c._cv.wait_for(lambda: c.next_step == 4, timeout=20)
        assert script.calls[-1] == (3, 1)  # resumed with the new weights
    finally:
        c.stop()


def test_the_refit_waits_for_the_batch_being_generated():
    c, script = make(max_age=1)
    script.gate[2] = threading.Event()
    c.start()
    try:
        c.take(1, P)
        drained = threading.Event()
        t = threading.Thread(target=lambda: (c.wait_for_drain(1), drained.set()))
        t.start()
        assert not drained.wait(timeout=0.5)  # batch 2 (version 0) is still being generated
        script.gate[2].set()
        assert drained.wait(timeout=20)
        t.join()
    finally:
        c.stop()


def test_a_dead_collector_is_named_to_the_waiting_trainer():
    c, script = make()
    script.fail[1] = ValueError("tokenizer exploded")
    c.start()
    with pytest.raises(CollectorDiedError, match="tokenizer exploded") as info:
        c.take(1, P)
    assert "the batch of step 1" in str(info.value)
    c.stop()


def test_a_dead_generation_worker_is_reraised_as_itself():
    c, script = make(max_failures=5)  # retries do not apply to a dead worker
    err = WorkerDiedError("gen-torch rank 0 died", group="gen-torch", rank=0, node_ip="127.0.0.1",
                          node_id="n", method="generate", worker_traceback="")  # fmt: skip
    script.fail[1] = err
    c.start()
    with pytest.raises(WorkerDiedError) as info:
        c.take(1, P)
    assert info.value is err and len(script.calls) == 1
    c.stop()


def test_failed_batches_are_retried_up_to_the_budget():
    c, script = make(max_failures=1, last_step=2)
    script.fail[1] = RuntimeError("flaky")
    c.start()
    try:
        groups, metrics = c.take(1, P)
    finally:
        c.stop()
    assert [s for s, _ in script.calls][:2] == [1, 1]  # the same step again
    assert metrics["train/generation_failures"] == 1.0
    assert {int(g["step"][0]) for g in groups} == {1}


def test_starvation_past_the_deadline_names_the_collector_and_shows_its_stack():
    c, script = make(stall=1.0)
    script.gate[1] = threading.Event()  # generation of step 1 hangs
    c.start()
    try:
        with pytest.raises(CollectorStalledError) as info:
            c.take(1, P)
    finally:
        script.gate[1].set()
        c.stop()
    text = str(info.value)
    assert "starvation_timeout_s" in text and "generating" in text
    assert "in __call__" in text  # the collector thread's stack, down to the hung produce


def test_quiesce_holds_the_collector_between_batches():
    c, script = make(max_age=2)
    c.start()
    try:
        with c.quiesce():
            n = len(script.calls)
            assert not c._busy
            state = c.state_dict()
            assert len(script.calls) == n  # nothing started while held
        assert state["next_step"] == n + 1
    finally:
        c.stop()


def test_every_state_seen_under_quiesce_holds_whole_steps():
    """What a checkpoint saves: the groups pushed are exactly those of the steps before
    ``next_step``. A batch's groups and its step count land in one locked block; when they were
    two, a checkpoint between them saved a pushed step as still to generate, and the resumed
    run generated it twice. Threads switch every microsecond here to reach such windows."""
    steps = 300
    c, _ = make(max_age=1, last_step=steps)
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            train_steps(c, 1, steps)
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=trainer)
    c.start()
    worker.start()
    seen = 0
    try:
        while worker.is_alive():
            with c.quiesce():
                assert c.buffer.pushed == P * (c.state_dict()["next_step"] - 1)
                seen += 1
    finally:
        sys.setswitchinterval(interval)
        worker.join(60)
        c.stop()
    assert not errors, errors
    assert seen > steps  # the checks interleaved with the run


def test_in_flight_groups_are_tagged_with_their_oldest_token_version():
    """With in-flight weight updates a refit may land before a group's first token: the
    buffer tags each group with the oldest version among its tokens (-1: not generated), so
    its age bounds every token's; a group without generated tokens keeps the batch's."""
    versions = torch.tensor([[-1, 1, 2], [-1, 2, 2],  # group 0: tokens of versions 1 and 2
                             [-1, 2, 2], [-1, 2, -1],  # group 1: all of version 2
                             [-1, -1, -1], [-1, -1, -1]])  # group 2: nothing generated  # fmt: skip

    def produce(step: int) -> BatchedDataDict:
        return BatchedDataDict(generation_weight_versions=versions)

    buffer = ReplayBuffer(max_size=P)
    c = RolloutCollector(produce, buffer, group_size=G, max_age=1, next_step=1, weight_version=1,
                         last_step=1, stall_timeout_s=20.0)  # fmt: skip
    c.start()
    try:
        with c._cv:
            assert c._cv.wait_for(lambda: c.next_step == 2 and not c._busy, timeout=20)
            held = [(g.weight_version, g.token_versions) for g in buffer._groups]
    finally:
        c.stop()
    assert [v for v, _ in held] == [1, 2, 1]
    assert all(torch.equal(t, versions[2 * i : 2 * i + 2]) for i, (_, t) in enumerate(held))


def test_token_version_metrics_by_hand():
    from tempering.algorithms.async_grpo import token_version_metrics

    versions = torch.tensor([[-1, 3, 4, -1], [-1, 4, 4, 4], [-1, -1, -1, -1]])
    m = token_version_metrics(versions, trainer_version=4)
    assert m["train/mixed_version_samples"] == pytest.approx(1 / 3)  # row 0 of 3 rows
    assert m["train/avg_token_age"] == pytest.approx(1 / 5)  # ages 1, 0, 0, 0, 0
    assert m["train/max_token_age"] == 1.0
