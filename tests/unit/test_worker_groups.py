"""Worker groups on the shared Ray: rank env, dispatch (single, sharded, one rank), result
order, gloo all-reduce between two workers, timeouts and shutdown."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

pytestmark = pytest.mark.timeout(180)
ECHO = "tests.workers.EchoWorker"


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=1, name="wg-test")
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def echo_group(cluster):
    # Half a bundle each, so the all-reduce group below fits beside it (colocation).
    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder(ECHO, tag="t1"),
        "echo",
        num_cpus_per_worker=0.5,
        env_vars={"TEMPERING_TEST_FLAG": "on"},
    )
    yield group
    group.shutdown()


def test_driver_never_imports_the_worker_class(echo_group):
    assert "tests.workers" not in sys.modules


def test_workers_get_rank_and_rendezvous_env(echo_group):
    infos = echo_group.get_all_worker_results(echo_group.run_all_workers_single_data("whoami"))
    assert [i["rank"] for i in infos] == ["0", "1"]
    assert [i["local_rank"] for i in infos] == ["0", "1"]
    assert {i["world_size"] for i in infos} == {"2"}
    assert len({(i["master_addr"], i["master_port"]) for i in infos}) == 1
    assert int(infos[0]["master_port"]) > 0
    assert {i["tag"] for i in infos} == {"t1"}  # constructor kwargs reached the worker
    assert infos[0]["pid"] != infos[1]["pid"]
    assert echo_group.dp_size == 2
    flags = echo_group.run_all_workers_single_data("getenv", "TEMPERING_TEST_FLAG")
    assert echo_group.get_all_worker_results(flags) == ["on", "on"]
    # OpenMP threads spin briefly, then sleep (bench/bench_busy.py: 17x -> 1.23x on a busy box)
    spin = echo_group.run_all_workers_single_data("getenv", "GOMP_SPINCOUNT")
    assert echo_group.get_all_worker_results(spin) == ["2000", "2000"]


def test_single_data_results_in_rank_order(echo_group):
    futures = echo_group.run_all_workers_single_data("echo", 7, key="v")
    results = echo_group.get_all_worker_results(futures, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["args"] == (7,) and r["kwargs"] == {"key": "v"} for r in results)
    # Plain arguments travel as one tuple (`call`); an ObjectRef among them makes the group use
    # `execute`, where Ray resolves it: the worker sees the value, not the ref.
    ref = ray.put([1, 2])
    futures = echo_group.run_all_workers_single_data("echo", ref, key=ray.put("w"))
    results = echo_group.get_all_worker_results(futures, timeout_s=60)
    assert all(r["args"] == ([1, 2],) and r["kwargs"] == {"key": "w"} for r in results)
    # Results follow the order of the futures given, whichever finishes first.
    futures = echo_group.run_all_workers_single_data("echo")
    assert [r["rank"] for r in echo_group.get_all_worker_results(futures[::-1])] == [1, 0]


def test_sharded_data_goes_to_dp_ranks_with_replicated_kwargs(echo_group):
    data = BatchedDataDict(ids=torch.arange(8))
    results = echo_group.get_all_worker_results(
        echo_group.run_all_workers_sharded_data("shard_summary", data, scale=10)
    )
    assert [r["ids"] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["sum"] for r in results] == [60, 220]
    # With a global batch size, each rank gets its part of every global batch.
    results = echo_group.get_all_worker_results(
        echo_group.run_all_workers_sharded_data("shard_summary", data, batch_size=4)
    )
    assert [r["ids"] for r in results] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_run_single_worker(echo_group):
    (result,) = echo_group.get_all_worker_results([echo_group.run_single_worker(1, "echo", "x")])
    assert result == {"rank": 1, "args": ("x",), "kwargs": {}}
    with pytest.raises(IndexError, match="ranks 0..1, not 2"):
        echo_group.run_single_worker(2, "echo")


def test_gloo_all_reduce_across_two_workers_then_shutdown(cluster, echo_group):
    import ray

    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder("tests.workers.AllReduceWorker"),
        "allreduce",
        num_cpus_per_worker=0.5,
    )
    try:
        results = group.get_all_worker_results(
            group.run_all_workers_single_data("all_reduce", [1.0, 2.0]), timeout_s=120
        )
        opened = group.get_all_worker_results(
            group.run_all_workers_single_data("listeners_opened"), timeout_s=60
        )
    finally:
        worker = group.workers[0]
        group.shutdown()
    # rank r contributes (r + 1) * [1, 2]: 1*[1,2] + 2*[1,2] = [3, 6] on every rank.
    assert results == [[3.0, 6.0], [3.0, 6.0]]
    # One node: the group met through a private file store, and gloo listens on loopback only
    # (a TCP store or an all-interfaces pair listener would show up here).
    assert all(opened) and all(a.startswith("127.") for addrs in opened for a in addrs), opened
    assert group.workers == []
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.describe.remote(), timeout=60)


def test_wait_timeout_names_ranks_and_method(echo_group):
    futures = echo_group.run_all_workers_single_data("sleep", 3.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish \['sleep'\]"):
        echo_group.get_all_worker_results(futures, timeout_s=0.5)
    assert time.monotonic() - start < 2.5
    assert echo_group.get_all_worker_results(futures, timeout_s=60) == [None, None]


def test_execute_resolves_dotted_names_to_components(monkeypatch):
    """``"refit.bucket"`` runs ``worker.refit.bucket`` (how the policy worker's components are
    called); a name that reaches nothing callable names the worker class and the name."""
    from types import SimpleNamespace

    from tempering.distributed.worker_groups import IsolatedWorkerInitializer

    monkeypatch.delenv("TEMPERING_STACK_DUMP_DIR", raising=False)
    parts = {"refit": SimpleNamespace(bucket=lambda n: 2 * n, size=3), "ok": lambda: "plain"}
    actor = IsolatedWorkerInitializer("types.SimpleNamespace", (), parts)
    assert actor.execute("refit.bucket", 4) == 8
    assert actor.execute("ok") == "plain"
    for name in ("refit.missing", "missing.bucket", "refit.size", "missing"):
        with pytest.raises(AttributeError, match=f"types.SimpleNamespace has no method '{name}'"):
            actor.execute(name)


def test_importing_tempering_sets_the_openmp_spin_and_keeps_the_users():
    """Before torch loads its OpenMP runtime (which reads the variable once)."""
    import os
    import subprocess

    code = "import tempering, torch, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "2000", out.stderr[-2000:]
    env["GOMP_SPINCOUNT"] = "300000"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "300000", out.stderr[-2000:]
