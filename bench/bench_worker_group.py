"""Worker-group costs: start time per environment kind, and no-op round trips vs. group size.

    uv run --frozen python bench/bench_worker_group.py [--calls 30] [--repeats 3]

Prints two small tables (ratios, not pass/fail):
1. start of a 1-worker group: cold venv (rebuilt now, in a temp venvs dir, from a warm uv
   cache), warm venv (reused), and SYSTEM (the driver's interpreter, no venv); medians,
   ratios against SYSTEM;
2. median round trip of ``run_all_workers_single_data("noop")`` + gather for N = 1, 2, 4
   workers; ratios against N = 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from tempering.distributed.actor_environments import PY_EXECUTABLES, register_actor_environment
from tempering.distributed.virtual_cluster import RayVirtualCluster, init_ray
from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

ECHO = "tests.workers.EchoWorker"  # a test-only worker, registered here by name
register_actor_environment(ECHO, PY_EXECUTABLES.SYSTEM)


def time_group_start(cluster: RayVirtualCluster, executable: str) -> float:
    """Seconds from RayWorkerGroup(...) to every worker answering."""
    start = time.perf_counter()
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO, py_executable=executable), "bench")
    elapsed = time.perf_counter() - start
    group.shutdown()
    return elapsed


def time_round_trips(cluster: RayVirtualCluster, calls: int) -> float:
    """Median seconds of one no-op call to every worker of a group on ``cluster``."""
    group = RayWorkerGroup(cluster, RayWorkerBuilder(ECHO), "bench-rt")
    try:
        group.get_all_worker_results(group.run_all_workers_single_data("noop"))  # warm up
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            group.get_all_worker_results(group.run_all_workers_single_data("noop"))
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    finally:
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="round trips per group size")
    parser.add_argument("--repeats", type=int, default=3, help="group starts per kind")
    args = parser.parse_args()
    os.environ["TEMPERING_VENVS_DIR"] = tempfile.mkdtemp(prefix="bench_venvs_")
    t0 = time.perf_counter()
    init_ray(num_cpus=8)
    print(f"init_ray: {time.perf_counter() - t0:.1f} s")

    cluster = RayVirtualCluster([1], name="bench-start")
    samples: dict[str, list[float]] = {
        "cold venv (ISOLATION_PROBE)": [],
        "warm venv (ISOLATION_PROBE)": [],
        "SYSTEM": [],
    }
    for _ in range(args.repeats):  # interleaved, so machine load hits all three alike
        os.environ["NRL_FORCE_REBUILD_VENVS"] = "true"
        samples["cold venv (ISOLATION_PROBE)"].append(
            time_group_start(cluster, PY_EXECUTABLES.ISOLATION_PROBE)
        )
        os.environ["NRL_FORCE_REBUILD_VENVS"] = "false"
        samples["warm venv (ISOLATION_PROBE)"].append(
            time_group_start(cluster, PY_EXECUTABLES.ISOLATION_PROBE)
        )
        samples["SYSTEM"].append(time_group_start(cluster, PY_EXECUTABLES.SYSTEM))
    cluster.shutdown()
    starts = {name: statistics.median(values) for name, values in samples.items()}
    base = starts["SYSTEM"]
    print(f"\n1-worker group start (median of {args.repeats})   seconds   x SYSTEM")
    for name, seconds in starts.items():
        print(f"  {name:<28}{seconds:8.2f}   {seconds / base:8.2f}")

    trips = {}
    for n in (1, 2, 4):
        cluster = RayVirtualCluster([n], name=f"bench-rt{n}")
        trips[n] = time_round_trips(cluster, args.calls)
        cluster.shutdown()
    print(f"\nno-op round trip (median of {args.calls})   ms   x N=1")
    for n, seconds in trips.items():
        print(f"  N = {n:<30}{seconds * 1e3:6.2f}   {seconds / trips[1]:5.2f}")


if __name__ == "__main__":
    main()
