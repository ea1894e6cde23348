"""The GPU configs' plans, started on a Ray that declares GPUs it does not have (slow tier).

A CPU-only Ray cluster (``ray.cluster_utils.Cluster`` in a subprocess, nodes declaring 8 GPUs
each) stands in for GPU nodes: Ray's placement groups and GPU accounting are the real ones,
and each actor is told which GPU indices it holds. For `grpo_math_1B.yaml` (1 GPU) and
`grpo_math_8B.yaml` on 2 nodes of 4 GPUs (the 8B plan's shape -- 8 policy workers, vLLM
engines of TP 4 -- over two nodes; 2 x 8 and 1 x 8 were dropped to keep the suite's time: 16
workers cost 2 cores minutes), the test builds the plan, the policy's
virtual cluster and its worker group (the real FSDP2 policy worker, on the tiny model: torch
sees no CUDA, so the workers compute on CPU with gloo, as TEMPERING_STANDIN_GPUS=1 allows)
and the colocated vLLM engines'
placement with `start_colocated_engines`, the function the run uses. The engine is a probe
(tests/workers.py) -- a real vLLM cannot start without a GPU -- that
reports where Ray put it. Checked: bundles per node, which policy worker got which GPU index
(each its own), each engine in the first bundle of its TP group (sharing that worker's GPU)
and seeing exactly its group's GPUs, every TP group inside one node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = {  # name -> (config, overrides, nodes)
    "1B-1gpu": ("grpo_math_1B.yaml", [], 1),
    "8B-2nodes-x-4gpus": (
        "grpo_math_8B.yaml",
        ["cluster.num_nodes=2", "cluster.gpus_per_node=4"],
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_plans_place_workers_and_colocated_engines(case, tmp_path):
    config, overrides, nodes = CASES[case]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, __file__, config, str(nodes), *overrides],
        env=env, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plan, policy, engines = r["plan"], r["policy"], r["engines"]

    # bundles per node, one policy worker per GPU, each with its own GPU index on its node
    assert r["bundles_per_node"] == plan["policy_bundles"] == [plan["gpus_per_node"]] * nodes
    assert len({w["node_id"] for w in policy}) == nodes
    for node in {w["node_id"] for w in policy}:
        ids = sorted(int(w["gpu_ids"][0]) for w in policy if w["node_id"] == node)
        assert ids == list(range(plan["gpus_per_node"])), (node, ids)
    # engines: first bundle of their TP group, sharing its GPU; CUDA_VISIBLE_DEVICES = the
    # group's GPUs, all on the engine's node
    tp = plan["generation_tp"]
    assert len(engines) == len(policy) // tp
    for e, probe in enumerate(engines):
        group = policy[e * tp : (e + 1) * tp]
        assert {w["node_id"] for w in group} == {probe["node_id"]}  # TP inside a node
        assert probe["bundle"] == group[0]["bundle"] is not None  # colocated: one bundle, one GPU
        assert probe["cuda_visible_devices"].split(",") == [w["gpu_ids"][0] for w in group]


def _main(config: str, nodes: int, overrides: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from tempering.algorithms.common import build_cluster, build_policy_from_config
    from tempering.config.loader import load_config
    from tempering.config.schemas import GRPOMasterConfig
    from tempering.distributed.actor_environments import PY_EXECUTABLES
    from tempering.distributed.placement import make_plan
    from tempering.distributed.worker_groups import RayWorkerBuilder
    from tempering.models.generation.builders import COLOCATED_GPU_SHARE, start_colocated_engines
    from tempering.models.shapes import model_shape

    cfg, _ = load_config(REPO / "examples" / "configs" / config, overrides, schema=GRPOMasterConfig)
    plan = make_plan(cfg, model_shape(cfg.policy.model_name))  # the real model's plan ...
    gpus = cfg.cluster.gpus_per_node
    # ... started with the tiny model, few threads, and a batch the tiny run can hold
    small = cfg.policy.model_copy(update={"model_name": "tiny-arith", "num_threads": 1})

    temp_root = tempfile.mkdtemp(prefix="raygpu_", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_root
    os.environ["TEMPERING_STANDIN_GPUS"] = "1"  # the workers' GPUs are declared, not there
    os.makedirs(os.path.join(temp_root, "ray"))
    head = {"num_cpus": gpus + 2, "num_gpus": gpus, "include_dashboard": False,
            "temp_dir": f"{temp_root}/ray"}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=gpus + 2, num_gpus=gpus)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        virtual = build_cluster(plan.policy, cfg.cluster, "policy")
        policy = build_policy_from_config(
            small, virtual, total_steps=1, gpu_share=COLOCATED_GPU_SHARE
        )
        # a test-only worker: this subprocess has no conftest registry entry, so name its python
        probe = RayWorkerBuilder(
            "tests.workers.PlacementProbeWorker", py_executable=PY_EXECUTABLES.SYSTEM
        )
        engines = start_colocated_engines(policy, plan.generation, probe)
        placements = engines.get_all_worker_results(
            engines.run_all_workers_single_data("placement")
        )
        result = {
            "plan": {
                "policy_bundles": plan.policy.bundles_per_node,
                "gpus_per_node": gpus,
                "generation_tp": plan.generation.tp,
            },  # fmt: skip
            "bundles_per_node": virtual.bundle_ct_per_node_list,
            "policy": [
                {k: w[k] for k in ("node_id", "gpu_ids", "bundle")}
                for w in policy.worker_group.worker_info
            ],  # fmt: skip
            "engines": placements,
        }
        engines.shutdown()
        policy.shutdown()
        virtual.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
