"""LoRA against full fine-tuning: step time and peak memory of SFT, GRPO and DPO steps.

    uv run --locked python bench/bench_lora.py [--model smollm2-135m-instruct] [--runs 3]

Each configuration starts its own policy worker (one Ray actor, all cores, fp32). Peak RSS is
the worker's resident-memory high-water mark over the timed steps (``VmHWM``, reset after the
warm-up step: loading SmolLM2 from its GGUF file peaks higher than training and would hide
the difference); the process's lifetime peak is printed beside it. Runs interleave: run 1
measures full then LoRA, run 2 LoRA then full, ... Printed: medians over the runs with their
range (these machines are noisy), and LoRA / full ratios. Never pass/fail.

- **SFT step**: `Policy.train` with `NLLLoss` on GSM8K worked solutions in chat form (the
  workload of `bench_sft.py`), batch 8 in micro-batches of 4.
- **GRPO step, training side**: what a GRPO step asks of the policy -- the behaviour
  log-probs, the reference log-probs (KL penalty 0.01, as in ``grpo_math_smollm2.yaml``),
  `Policy.train` with `ClippedPGLoss`, and the refit's full state dict -- on 16 GSM8K rows
  (4 prompts x 4 samples). Generation itself is the same for both: the engine samples from
  merged weights of the same size. Full fine-tuning keeps a reference copy; LoRA's
  reference is its base with the adapters off.
- **DPO step**: `Policy.train(with_reference=True)` with `DPOLoss` on 4 GSM8K pairs (the
  correct solution against another problem's), full fine-tuning with its reference copy.
- **Checkpoint size**: one step checkpoint of each (LoRA: adapters and their AdamW state).

LoRA: rank 16, alpha 32, every linear layer of the decoder (``--dim``).

``--plain-loop`` (SFT) adds a peer for the time ratio: the same rows through a plain
``transformers`` + ``peft`` loop in this process (no tempering, no Ray; log-softmax, gather,
AdamW; fp32, all cores), full and LoRA interleaved with the rest, so the ratio tempering gets
can be read against what the same products give without it. Time only (its memory is the
driver's). ``--activation-checkpointing`` recomputes each decoder layer on both sides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sft import gsm8k_batches  # noqa: E402

from tempering.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from tempering.distributed.virtual_cluster import RayVirtualCluster, init_ray  # noqa: E402
from tempering.losses import ClippedPGLoss, NLLLoss  # noqa: E402
from tempering.models.policy.lm_policy import build_policy  # noqa: E402
from tempering.models.registry import resolve_model_path  # noqa: E402
from tempering.preference_losses import DPOLoss  # noqa: E402

ALGORITHMS = ("sft", "grpo", "dpo")


def grpo_batch(rows: BatchedDataDict) -> BatchedDataDict:
    """GSM8K rows with a GRPO step's extra fields: advantages and generation log-probs."""
    g = torch.Generator().manual_seed(0)
    batch = BatchedDataDict(dict(rows.items()))
    batch["advantages"] = torch.randn(rows.size, generator=g)
    batch["generation_logprobs"] = torch.zeros_like(rows["token_mask"])
    return batch


def run_one(
    model: str, algorithm: str, lora: dict | None, data: list[BatchedDataDict], checkpointing: bool
) -> dict:
    """One fresh worker: per-step seconds after a warm-up step, peak RSS, checkpoint bytes."""
    cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name="bench-lora")
    policy = build_policy(
        cluster, resolve_model_path(model), train_global_batch_size=data[0].size,
        train_micro_batch_size=4, logprob_micro_batch_size=8, learning_rate=1e-5,
        num_threads=os.cpu_count() or 2, init_reference_model=algorithm != "sft",
        lora=lora, activation_checkpointing=checkpointing, name_prefix="bench-lora",
    )  # fmt: skip
    times = []
    try:
        for i, batch in enumerate(data):
            if i == 1:  # the training peak: from here, not loading's (VmHWM, reset)
                policy.worker_group.resource_usage(reset_peak=True)
            start = time.perf_counter()
            _step(policy, algorithm, batch)
            if i:
                times.append(time.perf_counter() - start)
        usage = policy.worker_group.resource_usage()[0]
        peak, lifetime = usage["rss_hwm_gb"], usage["peak_rss_gb"]
        with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
            policy.save_checkpoint(tmp)
            size = sum(f.stat().st_size for f in Path(tmp).iterdir())
    finally:
        policy.shutdown()
        cluster.shutdown()
    return {"step_s": statistics.median(times), "peak_rss_gb": peak, "ckpt_mb": size / 2**20,
            "lifetime_peak_gb": lifetime}  # fmt: skip


def plain_loop(
    model: str, lora: dict | None, data: list[BatchedDataDict], checkpointing: bool
) -> dict:
    """Median seconds per SFT step of a plain transformers (+ peft) loop on the same rows
    (micro-batches of 4, each cut to its longest row), after a warm-up step."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    from tempering.models.hf import load_causal_lm

    torch.set_num_threads(os.cpu_count() or 2)
    net = load_causal_lm(resolve_model_path(model)).train()
    if checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        config = LoraConfig(r=lora["dim"], lora_alpha=lora["alpha"], target_modules="all-linear")
        LoraModel(net, config, "default")
        for name, param in net.named_parameters():
            param.requires_grad_("lora_" in name)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for batch in data:
        start = time.perf_counter()
        for rows in (slice(0, 4), slice(4, 8)):
            lengths = batch["input_lengths"][rows]
            ids = batch["input_ids"][rows, : int(lengths.max())]
            mask = batch["token_mask"][rows, 1 : ids.shape[1]]
            attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
            logits = net(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp * mask).sum() / mask.sum() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    del net, optimizer
    return {"step_s": statistics.median(times[1:])}


def _step(policy: Any, algorithm: str, batch: BatchedDataDict) -> None:
    if algorithm == "sft":
        policy.train(batch, NLLLoss())
    elif algorithm == "grpo":
        batch["prev_logprobs"] = policy.get_logprobs(batch)["logprobs"]
        ref = policy.get_reference_policy_logprobs(batch)
        batch["reference_policy_logprobs"] = ref["reference_policy_logprobs"]
        policy.train(batch, ClippedPGLoss(reference_policy_kl_penalty=0.01))
        policy.refit.state_dict()
    else:
        policy.train(batch, DPOLoss(), with_reference=True)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs per configuration")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    parser.add_argument("--dim", type=int, default=16, help="LoRA rank")
    parser.add_argument("--max-seq-len", type=int, default=384)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument(
        "--plain-loop", action="store_true", help="SFT: time a plain transformers+peft loop too"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true",
        help="recompute each decoder layer in backward, on both sides",
    )  # fmt: skip
    args = parser.parse_args()
    if args.plain_loop and "sft" not in args.algorithms.split(","):
        parser.error("--plain-loop times SFT steps: add sft to --algorithms")

    lora = {"dim": args.dim, "alpha": 2.0 * args.dim}
    batches = {
        "sft": gsm8k_batches(args.model, 8, args.steps + 1, args.max_seq_len),
        "grpo": [
            grpo_batch(b) for b in gsm8k_batches(args.model, 16, args.steps + 1, args.max_seq_len)
        ],  # fmt: skip
        # pairs (chosen, rejected) = rows (2i, 2i+1): one problem's solution against another's
        "dpo": gsm8k_batches(args.model, 8, args.steps + 1, args.max_seq_len),
    }
    init_ray(num_cpus=8)
    results: dict[tuple[str, str], list[dict]] = {}
    for run in range(args.runs):
        order = [("full", None), ("lora", lora)]
        pair = order if run % 2 == 0 else order[::-1]  # alternating which goes first
        for algorithm in args.algorithms.split(","):
            for mode, spec in pair:
                r = run_one(
                    args.model, algorithm, spec, batches[algorithm], args.activation_checkpointing
                )  # fmt: skip
                results.setdefault((algorithm, mode), []).append(r)
                print(f"run {run + 1} {algorithm:<4} {mode:<4} step {r['step_s']:6.2f} s  peak "
                      f"RSS in training {r['peak_rss_gb']:.2f} GiB (process lifetime "
                      f"{r['lifetime_peak_gb']:.2f})  checkpoint {r['ckpt_mb']:.1f} MiB",
                      flush=True)  # fmt: skip
        if args.plain_loop:  # the same order as tempering's pair in this run
            for mode, spec in pair:
                r = plain_loop(args.model, spec, batches["sft"], args.activation_checkpointing)
                results.setdefault(("plain", mode), []).append(r)
                print(f"run {run + 1} plain sft {mode:<4} step {r['step_s']:6.2f} s", flush=True)

    print(f"\n{args.model}, LoRA rank {args.dim} vs full fine-tuning; medians of {args.runs} "
          "interleaved runs [min-max]")  # fmt: skip
    print(f"{'':<6}{'':<6}{'step s':>22}{'train peak RSS GiB':>24}{'checkpoint MiB':>24}")
    for algorithm in args.algorithms.split(","):
        for mode in ("full", "lora"):
            rs = results[algorithm, mode]
            print(f"{algorithm:<6}{mode:<6}{spread([r['step_s'] for r in rs]):>22}"
                  f"{spread([r['peak_rss_gb'] for r in rs]):>24}"
                  f"{spread([r['ckpt_mb'] for r in rs]):>24}")  # fmt: skip
        full = results[algorithm, "full"]
        lo = results[algorithm, "lora"]

        def ratio(key: str, full: list = full, lo: list = lo) -> float:
            return statistics.median(r[key] for r in full) / statistics.median(r[key] for r in lo)

        print(
            f"{algorithm:<6}full / lora: {ratio('step_s'):.2f}x faster, RSS lora/full "
            f"{1 / ratio('peak_rss_gb'):.2f}, checkpoint {ratio('ckpt_mb'):.0f}x smaller"
        )
    if args.plain_loop:
        full, lo = ([r["step_s"] for r in results["plain", m]] for m in ("full", "lora"))
        print(f"plain transformers+peft SFT loop: full {spread(full)} s, lora {spread(lo)} s, "
              f"{statistics.median(full) / statistics.median(lo):.2f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
