"""The virtual cluster: bundles and placement groups on the shared Ray, the too-small error,
teardown, and a two-node cluster simulated on this machine (run in a subprocess with its own
Ray: this file run as a script, see ``_two_node_main``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tempering.distributed.virtual_cluster import (
    ClusterTooSmallError,
    RayVirtualCluster,
    cluster_from_config,
)

pytestmark = pytest.mark.timeout(240)


def test_two_bundle_cluster_reserves_and_frees(ray_session):
    import ray

    before = ray.available_resources().get("CPU", 0)
    cluster = cluster_from_config(1, 0, workers_per_node=2, cpus_per_worker=1, name="vc-test")
    try:
        assert cluster.world_size() == 2 and cluster.node_count() == 1
        assert cluster.bundle == {"CPU": 1}
        locations = cluster.bundle_locations()
        assert [(b.node_index, b.bundle_index) for b in locations] == [(0, 0), (0, 1)]
        assert {b.node_id for b in locations} == {ray.get_runtime_context().get_node_id()}
        (pg,) = cluster.get_placement_groups()
        assert ray.util.placement_group_table(pg)["strategy"] == "STRICT_PACK"
        assert ray.available_resources().get("CPU", 0) == before - 2
        addr, port = cluster.get_master_address_and_port()
        assert addr == ray.util.get_node_ip_address() and 0 < port < 65536
    finally:
        cluster.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert cluster.get_placement_groups() == []
    # Freed: a cluster needing every CPU of the session now becomes ready.
    whole = RayVirtualCluster([1], num_cpus_per_bundle=before, name="whole", ready_timeout_s=30)
    whole.shutdown()


def test_too_small_cluster_names_missing_resources(ray_session):
    with pytest.raises(ClusterTooSmallError, match=r"CPU: need 100, cluster has 8"):
        RayVirtualCluster([100], num_cpus_per_bundle=1, name="too-big")
    with pytest.raises(ClusterTooSmallError, match=r"GPU: need 4, cluster has 0") as info:
        cluster_from_config(2, 2, name="no-gpus")
    assert "cluster.gpus_per_node" in str(info.value)


def test_bundles_that_do_not_fit_one_node_time_out_with_a_clear_error(ray_session):
    import ray

    # 2 bundles of 3 CPUs fit the 8-CPU cluster on paper, but a 3-CPU blocker leaves 5 free:
    # the placement group never becomes ready, and the wait must end in a clear error.
    blocker = RayVirtualCluster([1], num_cpus_per_bundle=3, name="blocker")
    try:
        with pytest.raises(ClusterTooSmallError, match=r"not ready after 2 s") as info:
            RayVirtualCluster([2], num_cpus_per_bundle=3, name="starved", ready_timeout_s=2)
        assert "available per node" in str(info.value)
    finally:
        blocker.shutdown()
    # The failed cluster removed its placement group.
    names = [
        pg["name"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"
    ]
    assert "starved-node0" not in names


def test_bad_bundle_list_is_rejected(ray_session):
    with pytest.raises(ValueError, match="at least one bundle"):
        RayVirtualCluster([2, 0])


@pytest.mark.slow  # two Ray nodes start in a subprocess: 40-90 s on a 2-core machine
def test_two_simulated_nodes_get_one_worker_each(tmp_path):
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster), each with 1 CPU: a [1, 1]
    cluster must place one worker per node; the workers run in the isolation-probe venv,
    built on both nodes (a task pinned to the second node) under one file lock."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["TEMPERING_VENVS_DIR"] = os.environ.get("TEMPERING_VENVS_DIR") or str(tmp_path / "venvs")
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["alive_nodes"]) == 2
    infos = result["workers"]
    assert [i["rank"] for i in infos] == ["0", "1"]
    assert [i["local_rank"] for i in infos] == ["0", "0"]
    assert sorted(i["node_rank"] for i in infos) == ["0", "1"]
    assert len({i["node_id"] for i in infos}) == 2, "both workers landed on one node"
    assert set(result["alive_nodes"]) == {i["node_id"] for i in infos}
    venvs = Path(env["TEMPERING_VENVS_DIR"]).resolve()
    assert all(Path(i["python"]).is_relative_to(venvs) for i in infos)


def _retry_start(start, attempts: int = 3):
    """Ray nodes sometimes time out starting on an overloaded machine; retry like init_ray."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as exc:
            if attempt == attempts or "timed out during startup" not in str(exc):
                raise
            print(f"node start attempt {attempt} failed: {exc}", file=sys.stderr)


def _two_node_main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from tempering.distributed.actor_environments import PY_EXECUTABLES
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    # A short private temp root (socket paths are length-limited; Ray writes its address
    # file under $RAY_TMPDIR/ray), so this Ray never meets the session's or anyone else's.
    temp_root = tempfile.mkdtemp(prefix="ray2n_", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_root
    os.makedirs(os.path.join(temp_root, "ray"))
    head_args = {"num_cpus": 1, "include_dashboard": False, "temp_dir": f"{temp_root}/ray"}
    cluster = _retry_start(lambda: Cluster(initialize_head=True, head_node_args=head_args))
    _retry_start(lambda: cluster.add_node(num_cpus=1))
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        virtual = RayVirtualCluster([1, 1], num_cpus_per_bundle=1, name="two-node")
        group = RayWorkerGroup(
            virtual,
            RayWorkerBuilder(
                "tests.workers.EchoWorker",
                py_executable=PY_EXECUTABLES.ISOLATION_PROBE,
            ),
            "two-node",
        )
        workers = group.get_all_worker_results(
            group.run_all_workers_single_data("whoami"), timeout_s=60
        )
        group.shutdown()
        virtual.shutdown()
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        print(json.dumps({"workers": workers, "alive_nodes": alive}))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_root, ignore_errors=True)


if __name__ == "__main__":
    _two_node_main()
