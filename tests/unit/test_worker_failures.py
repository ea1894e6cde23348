"""Failures reach the controller quickly and by name: a raising worker, a worker failing in
``__init__``, a worker that dies (``os._exit``), also while its peer blocks in a collective,
and a hang that ends at its phase's deadline with every late worker's Python stacks."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from tempering.distributed import deadlines
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.distributed.worker_groups import (
    RayWorkerBuilder,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerError,
    _wait_for_dumps,
)

pytestmark = pytest.mark.timeout(120)
PKG = "tests.workers"


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=1, name="fail-test")
    yield cluster
    cluster.shutdown()


def test_raising_worker_reports_rank_node_and_traceback(cluster):
    group = RayWorkerGroup(cluster, RayWorkerBuilder(f"{PKG}.RaisingWorker"), "raiser")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            group.get_all_worker_results([group.run_single_worker(1, "boom", "kaput")])
        assert time.monotonic() - start < 30
        err = info.value
        assert not isinstance(err, WorkerDiedError)
        assert (err.rank, err.method, err.group) == (1, "boom", "raiser")
        assert err.node_ip == group.worker_info[1]["node_ip"]
        assert err.node_id == group.worker_info[1]["node_id"]
        text = str(err)
        assert "rank 1 on node" in text and "'boom'" in text
        # The worker's own traceback, down to the raising line.
        assert "ValueError: rank 1: kaput" in text
        assert "workers.py" in text and "in boom" in text
        # The group still works after a worker raised.
        assert group.get_all_worker_results(group.run_all_workers_single_data("ok")) == [0, 1]
    finally:
        group.shutdown()


def test_worker_failing_in_init_is_named(cluster):
    stores = set(Path(tempfile.gettempdir()).glob("tempering-bad-init-*"))
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="failed to start") as info:
        RayWorkerGroup(
            cluster, RayWorkerBuilder(f"{PKG}.RaisingWorker", fail_in_init=True), "bad-init"
        )
    assert time.monotonic() - start < 60
    assert info.value.method == "__init__"
    assert "told to fail in __init__" in str(info.value)
    # the group's rendezvous folder goes with it (tests had left one in /tmp per failed start)
    assert set(Path(tempfile.gettempdir()).glob("tempering-bad-init-*")) == stores


def test_dying_worker_is_reported_within_seconds(cluster):
    group = RayWorkerGroup(cluster, RayWorkerBuilder(f"{PKG}.DyingWorker"), "dier")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            group.get_all_worker_results(
                group.run_all_workers_single_data(
                    "die", only_rank=1, last_words="cannot allocate the 3rd bucket"
                ),
                timeout_s=60,
            )
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"death took {elapsed:.1f} s to surface"
        assert (info.value.rank, info.value.method) == (1, "die")
        assert "died during 'die'" in str(info.value)
        # what it wrote to stderr before dying travels with the error (Ray's log may be gone)
        assert "| cannot allocate the 3rd bucket" in str(info.value)
        # A peer blocked in a collective with the dead rank does not hang the controller:
        # rank 0 waits in a gloo rendezvous that can never complete; the gather still
        # surfaces rank 1's death (it is already dead) instead of waiting on rank 0.
        futures = [group.run_single_worker(0, "wait_for_peer"), group.run_single_worker(1, "die")]
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            group.get_all_worker_results(futures, timeout_s=60)
        assert info.value.rank == 1 and time.monotonic() - start < 30
    finally:
        group.shutdown(graceful_timeout_s=0)


def test_a_segfault_names_its_stack(cluster):
    group = RayWorkerGroup(cluster, RayWorkerBuilder(f"{PKG}.DyingWorker"), "segv")
    try:
        with pytest.raises(WorkerDiedError) as info:
            group.get_all_worker_results([group.run_single_worker(0, "segfault")], timeout_s=60)
        message = str(info.value)
        assert "Segmentation fault" in message and "in segfault" in message, message
    finally:
        group.shutdown(graceful_timeout_s=0)


def test_hang_ends_at_the_phase_deadline_with_stack_dumps(cluster, tmp_path, monkeypatch):
    # Rank 1 sleeps forever in Python; rank 0 waits for it inside a gloo barrier.
    monkeypatch.setenv(deadlines.STACK_DUMP_DIR_ENV, str(tmp_path))
    monkeypatch.setitem(deadlines._deadlines, "train", 4.0)
    group = RayWorkerGroup(cluster, RayWorkerBuilder(f"{PKG}.DyingWorker"), "hang")
    try:
        start = time.monotonic()
        with pytest.raises(deadlines.DeadlineExceeded) as info:
            group.get_all_worker_results(group.run_all_workers_single_data("train_hang"))
        took = time.monotonic() - start
        assert 4.0 <= took < 15, took
        err = info.value
        assert err.phase == "train" and err.ranks == [0, 1]
        text = str(err)
        assert "phase 'train'" in text and "ranks [0, 1]" in text and "deadlines.train_s" in text
        assert len(err.stack_files) == 2
        stacks = {int(p.split("-rank")[1].split("-")[0]): open(p).read() for p in err.stack_files}
        assert "_sleep_forever" in stacks[1] and "train_hang" in stacks[1]
        assert "wait_for_peer" in stacks[0]  # inside the collective
    finally:
        start = time.monotonic()
        group.shutdown(graceful_timeout_s=2)
        assert time.monotonic() - start < 20  # hung workers are killed, not waited on


def test_startup_hang_ends_at_its_deadline_with_stack_dumps(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(deadlines.STACK_DUMP_DIR_ENV, str(tmp_path))
    monkeypatch.setitem(deadlines._deadlines, "startup", 8.0)
    start = time.monotonic()
    with pytest.raises(deadlines.DeadlineExceeded) as info:
        RayWorkerGroup(cluster, RayWorkerBuilder(f"{PKG}.HangInInitWorker"), "stuck")
    assert time.monotonic() - start < 30
    err = info.value
    assert err.phase == "startup" and err.ranks == [0, 1]
    assert "deadlines.startup_s" in str(err) and len(err.stack_files) == 2
    assert all("_sleep_forever" in open(f).read() and "__init__" in open(f).read()
               for f in err.stack_files)  # fmt: skip


def test_phases_of_worker_methods():
    expected = {
        "train": "train", "get_logprobs": "logprobs", "get_reference_policy_logprobs": "logprobs",
        "generate": "generation", "update_weights": "refit", "whoami": "call",
        # the policy worker's components, by dotted name (IsolatedWorkerInitializer.execute)
        "generation.init": "generation", "generation.generate": "generation",
        "generation.refit": "refit", "generation.reseed": "call",
        "refit.state_dict": "refit", "refit.buckets": "refit", "refit.bucket": "refit",
        "checkpoint.save": "checkpoint", "checkpoint.load": "checkpoint",
        "checkpoint.export_hf": "checkpoint", "prepare_for_generation": "call",
    }  # fmt: skip
    assert {m: deadlines.phase_of(m) for m in expected} == expected


def test_a_dump_is_read_whole_after_a_pause_mid_write(tmp_path):
    # CI once read rank 0's dump after its first line: a worker descheduled mid-dump (the
    # handler writes in pieces). A file written in two parts 0.15 s apart is read after both.
    old, fresh = tmp_path / "old.txt", tmp_path / "fresh.txt"
    old.write_text("an earlier dump\n")

    def write_in_parts():
        for part in ("Thread 0x1 (most recent call first):\n", "  File x, line 3 in wait\n"):
            with open(fresh, "a") as f:
                f.write(part)
            time.sleep(0.15)

    writer = threading.Thread(target=write_in_parts)
    writer.start()
    assert _wait_for_dumps([fresh], [0], wait_s=10.0) == [fresh]
    assert fresh.read_text().endswith("in wait\n")  # read whole, before the 10 s ran out
    writer.join()
    # a file that did not grow since the signal holds no dump of it
    assert _wait_for_dumps([old, fresh], [old.stat().st_size, 0], wait_s=0.5) == [fresh]
