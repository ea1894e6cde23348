"""A run asking for GPUs that torch cannot use stops, naming why, instead of training on the
CPU at a fraction of the speed (it used to, silently: Ray declares the GPUs it is told of, and
a worker that saw no CUDA fell back to gloo on CPU). Here torch really sees no GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tempering.algorithms import common
from tempering.config.schemas import ClusterConfig


def test_a_local_run_asking_for_more_gpus_than_torch_sees_stops_before_ray(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    asked = torch.cuda.device_count() + 1
    with pytest.raises(common.GPUsMissingError) as err:
        common.start_ray(ClusterConfig(gpus_per_node=asked))
    msg = str(err.value)
    assert msg.startswith(f"cluster.gpus_per_node={asked} but torch sees ")
    assert "or set cluster.gpus_per_node=0 to train on CPUs" in msg
    if torch.version.cuda is None:
        assert "is a CPU-only build; install the CUDA build" in msg
    assert not ray.is_initialized() or ray.cluster_resources().get("GPU", 0) == 0


WORKER = textwrap.dedent(
    """
    import ray
    from tempering.models.policy.model_setup import check_assigned_gpus

    @ray.remote(num_gpus=1, num_cpus=0)
    def check():
        try:
            check_assigned_gpus()
            return "passed"
        except RuntimeError as err:
            return str(err)

    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False)  # a GPU declared, not there
    print(ray.get(check.remote()))
    standin = check.options(runtime_env={"env_vars": {"TEMPERING_STANDIN_GPUS": "1"}})
    print(ray.get(standin.remote()))
    ray.shutdown()
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine whose torch sees no GPU")
def test_a_worker_given_a_gpu_it_cannot_see_refuses_unless_gpus_are_stand_ins(tmp_path):
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    refused, standin = done.stdout.strip().splitlines()[-2:]
    assert "given GPU(s) [0] (cluster.gpus_per_node > 0), but torch " in refused, refused
    assert refused.endswith("or set cluster.gpus_per_node=0 to train on CPUs")
    assert standin == "passed"
