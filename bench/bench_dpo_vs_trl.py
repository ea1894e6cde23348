"""DPO seconds per optimizer step: tempering vs TRL's `DPOTrainer` on the same workload.

    uv run --frozen python bench/bench_dpo_vs_trl.py [--scale tiny|smollm2] [--pairs N]
        [--steps N] [--warmup N] [--threads N] [--runs 3]

Scales (each flag overrides its scale's value):
- tiny: tiny-arith, synthetic arithmetic pairs (correct vs corrupted answer) as plain text,
  32 pairs per step, max length 32, lr 5e-4, 1 thread, 30 steps (5 left out);
- smollm2: SmolLM2-135M-Instruct, GSM8K pairs (worked answer vs the same answer corrupted) in
  the model's chat template on both sides, 4 pairs per step, max length 256 (longer rows are
  cut at the end on both sides: TRL's only `truncation_mode`, keep_start), lr 1e-6, 2 threads,
  8 steps (2 left out).

Same model folder, same pairs, same batch (`--pairs` pairs = 2x rows, chosen and rejected in
one forward in both), same max length, fp32 on CPU, AdamW at the same learning rate, beta 0.1,
gradient checkpointing off, reference log-probs computed every step in both (TRL:
`precompute_ref_log_probs=False`, the default).

- tempering: the real controller path, a `Policy` over one FSDP2 worker in a Ray actor
  (one train call per step: the worker computes the reference log-probs per micro-batch, and
  a pair's shared prompt runs once (`policy.shared_prefix`, on by default); the pairs come
  from DPO's own data loader, which tokenizes the next step's pairs in a background thread
  while the worker trains, and taking the batch from it is inside the timed step);
- TRL 1.16: run with ``venvs/bench/bin/python`` in a subprocess (TRL is not a
  dependency of tempering), ``use_cpu=True, bf16=False``; seconds per step measured by a
  `TrainerCallback` from one `on_step_end` to the next (fetching and collating the batch
  counts, as on tempering's side; until 2026-11-28 it timed `on_step_begin` to `on_step_end`,
  which left TRL's batch out).

Each side runs ``--runs`` times, interleaved (these machines are noisy); prints the median of
the per-run medians with their spread, and the speed-up per run. A benchmark reports, it never
passes or fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from peers import run_trl, scaled_args, scaled_parser  # bench/peers.py (this folder is on sys.path)
from result_files import record  # bench/result_files.py: the docs' Benchmarks page reads its files

REPO = Path(__file__).resolve().parents[1]
BETA = 0.1
SCALES = {
    "tiny": dict(model="tiny-arith", pairs=32, max_len=32, lr=5e-4, threads=1, steps=30, warmup=5),
    "smollm2": dict(
        model="smollm2-135m-instruct", pairs=4, max_len=256, lr=1e-6, threads=2, steps=8, warmup=2
    ),
}

TRL_SCRIPT = textwrap.dedent(
    """
    from trl import DPOConfig, DPOTrainer

    if not args["chat"]:
        tok.chat_template = None  # plain prompt + completion text, as tempering tokenizes it
    cfg = DPOConfig(
        output_dir=args["out"], per_device_train_batch_size=args["pairs"],
        max_steps=args["steps"], learning_rate=args["lr"], beta=args["beta"],
        max_length=args["max_len"], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=10**6,
        dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, weight_decay=0.0, disable_dropout=True, seed=0,
    )
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[timer])
    trainer.train()
    cap = lambda n: min(n, args["max_len"])  # noqa: E731 (keep_start truncation)
    tokens = sum(
        cap(len(r["prompt_ids"]) + len(r["chosen_ids"]))
        + cap(len(r["prompt_ids"]) + len(r["rejected_ids"]))
        for r in trainer.train_dataset
    )
    result = {"step_times": timer.times, "fetch_times": timer.fetch,
              "tokens_per_step": tokens / args["steps"]}
    print("RESULT " + json.dumps(result))
    """
)


def workload(scale: str, n_pairs: int) -> list:
    from tempering.data.preference_datasets import (
        arithmetic_preference_pairs,
        gsm8k_preference_pairs,
    )

    if scale == "tiny":
        return arithmetic_preference_pairs(n_pairs, seed=0).examples
    pairs = gsm8k_preference_pairs("train").examples
    if len(pairs) < n_pairs:
        raise SystemExit(f"GSM8K has {len(pairs)} training pairs; --pairs x --steps asks {n_pairs}")
    return pairs[:n_pairs]


def bench_tempering(model: str, pairs: list, args: argparse.Namespace) -> tuple[list, float]:
    """Seconds per step and tokens per step (chosen + rejected rows, after truncation)."""
    from tempering.algorithms.dpo import dpo_step
    from tempering.algorithms.preference import preference_loader
    from tempering.distributed.virtual_cluster import cluster_from_config, init_ray
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.lm_policy import build_policy
    from tempering.preference_losses import DPOLoss

    init_ray(num_cpus=4, temp_dir=tempfile.mkdtemp(prefix="ray_bench_", dir="/tmp"))
    cluster = cluster_from_config(1, 0, name="bench_dpo")
    rows = 2 * args.pairs
    policy = build_policy(
        cluster,
        model,
        train_global_batch_size=rows,
        train_micro_batch_size=rows,
        learning_rate=args.lr,
        init_reference_model=True,
        num_threads=args.threads,
        seed=0,
    )
    tokenizer = load_tokenizer(model)
    # as dpo.setup builds it, in the pairs' order
    loader = preference_loader(pairs, 2 * args.pairs, tokenizer, args.max_len, shuffle=False)
    loss_fn = DPOLoss(BETA)
    times, tokens = [], 0
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = loader.next_batch()
            dpo_step(policy, batch, loss_fn)
            tokens += int(batch["input_lengths"].sum())
            times.append(time.perf_counter() - t0)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return times, tokens / args.steps


def bench_trl(model: str, pairs: list, args: argparse.Namespace) -> tuple[list, list, float]:
    """TRL's step times (end to end), its batch fetches between steps, tokens per step."""
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        data = Path(tmp) / "pairs.json"
        data.write_text(
            json.dumps(
                [
                    # messages where the model has a chat template (TRL applies it), else text
                    {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
                    if args.chat
                    else {
                        "prompt": p.prompt[0]["content"],
                        "chosen": p.chosen[0]["content"],
                        "rejected": p.rejected[0]["content"],
                    }
                    for p in pairs
                ]
            )
        )
        spec = {
            "model": model,
            "data": str(data),
            "out": str(Path(tmp) / "out"),
            "pairs": args.pairs,
            "steps": args.steps,
            "lr": args.lr,
            "beta": BETA,
            "max_len": args.max_len,
            "threads": args.threads,
            "chat": args.chat,
        }
        result = run_trl(TRL_SCRIPT, spec)
    return result["step_times"], result["fetch_times"], result["tokens_per_step"]


def main() -> None:
    parser = scaled_parser(__doc__, SCALES, "--pairs", "preference pairs per step")
    args = scaled_args(parser, SCALES)

    from tempering.models.registry import resolve_model_path

    model = resolve_model_path(args.model)
    # tiny-arith's template only joins the messages and ends the answer with EOS, which TRL
    # does for plain text; SmolLM2's is the real chat format, given to TRL as messages.
    args.chat = args.scale == "smollm2"
    pairs = workload(args.scale, args.pairs * args.steps)
    ours, theirs = [], []
    for run in range(args.runs):
        times, our_tokens = bench_tempering(model, pairs, args)
        ours.append(statistics.median(times[args.warmup :]))
        times, fetches, their_tokens = bench_trl(model, pairs, args)
        theirs.append(statistics.median(times[args.warmup :]))
        fetch = statistics.median(fetches[args.warmup :])
        print(
            f"run {run + 1}: tempering {ours[-1]:.4f} s/step ({our_tokens:.0f} tokens/step),"
            f" TRL {theirs[-1]:.4f} s/step (of which its batch fetch {fetch * 1e3:.1f} ms;"
            f" {their_tokens:.0f} tokens/step)"
        )
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    print(
        f"workload: {model}, {args.pairs} pairs ({2 * args.pairs} rows)/step,"
        f" max_len {args.max_len}, chat template {'on' if args.chat else 'off'},"
        f" fp32 CPU, {args.threads} thread(s); per run the median of {args.steps - args.warmup}"
        f" steps after {args.warmup}; below the median of {args.runs} runs (min-max)"
    )
    print(f"tempering DPO (Ray + FSDP2 worker): {spread(ours)} s/step")
    print(f"TRL 1.16 DPOTrainer:                {spread(theirs)} s/step")
    print(f"speed-up (TRL s/step / tempering):  {spread(ratios, 2)}x")
    record(
        "dpo_vs_trl",
        "DPO against TRL 1.16 DPOTrainer",
        args.scale,
        "s/step",
        ours,
        theirs,
        "TRL 1.16",
    )


def spread(values: list[float], digits: int = 4) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


if __name__ == "__main__":
    sys.exit(main())
