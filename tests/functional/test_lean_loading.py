"""Memory-lean loading (slow tier): SmolLM2-135M into 2 FSDP2 ranks. With lean loading only
rank 0 reads the checkpoint; rank 1 builds the model on the meta device and receives its
shard, one tensor at a time. The peak memory that loading adds to rank 1 must be well below
one full copy of the model (what it costs when every rank reads the whole model, measured in
the same test and printed), and the loaded weights must equal the file's exactly."""

from __future__ import annotations

import pytest
import torch

from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from tempering.models.policy.lm_policy import POLICY_WORKER_FQN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _load_on_two_ranks(path: str, lean: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.5, name=f"lean-{lean}")
    builder = RayWorkerBuilder(
        POLICY_WORKER_FQN, path, lean_loading=lean, init_optimizer=False, num_threads=1
    )
    group = RayWorkerGroup(cluster, builder, f"load-{'lean' if lean else 'eager'}")
    try:
        peaks = group.get_all_worker_results(group.run_all_workers_single_data("load_peak_gb"))
        weights = group.get_all_worker_results(
            group.run_all_workers_single_data("refit.state_dict")
        )[0]
    finally:
        group.shutdown()
        cluster.shutdown()
    return peaks, weights


def test_only_rank_0_reads_the_weights_and_they_equal_the_files(ray_session):
    from transformers import AutoModelForCausalLM

    from tempering.models.registry import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    eager_peaks, _ = _load_on_two_ranks(path, lean=False)
    lean_peaks, weights = _load_on_two_ranks(path, lean=True)
    file = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    unique = {t.data_ptr(): t for t in file.values()}.values()  # lm_head is tied to embed_tokens
    model_gb = sum(t.numel() * 4 for t in unique) / 2**30
    largest_gb = max(t.numel() * 4 for t in file.values()) / 2**30
    print(f"\nSmolLM2-135M fp32 = {model_gb:.3f} GiB (largest tensor {largest_gb:.3f}); peak "
          f"memory loading added per rank (GiB): every rank reads "
          f"{[round(p, 3) for p in eager_peaks]}, lean {[round(p, 3) for p in lean_peaks]}")  # fmt: skip
    # eager: each rank held the whole model; lean: rank 1 held its half plus one full tensor
    assert eager_peaks[1] > 0.9 * model_gb, (eager_peaks, model_gb)
    assert lean_peaks[1] < 0.5 * model_gb + largest_gb + 0.1, (lean_peaks, model_gb)
    assert lean_peaks[1] < 0.8 * eager_peaks[1], (lean_peaks, eager_peaks)
    assert set(weights) == set(file)
    for name, tensor in file.items():
        assert torch.equal(weights[name], tensor), name
