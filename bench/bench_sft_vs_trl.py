"""SFT seconds per optimizer step: tempering vs TRL's `SFTTrainer` on the same tokens.

    uv run --frozen python bench/bench_sft_vs_trl.py [--scale tiny|smollm2] [--rows N]
        [--steps N] [--warmup N] [--threads N] [--runs 3]

Scales (each flag overrides its scale's value):
- tiny: tiny-arith on the arithmetic SFT rows of examples/configs/sft.yaml (one problem per
  row, loss on the answer), 128 rows per step, max length 32, lr 1e-3, 2 threads, 30 steps
  (5 left out);
- smollm2: SmolLM2-135M-Instruct on GSM8K worked solutions in the model's chat template (loss
  on the assistant turn), 8 rows per step, max length 512 (1 of the first 48 rows is cut to
  it), lr 1e-5, 2 threads, 6 steps (2 left out).

Same tokens on both sides: the rows are tokenized once by tempering (`tokenize_message_logs`,
assistant-only loss mask) and TRL gets them pre-tokenized (``input_ids`` and ``labels`` with
-100 outside the loss), so neither side's tokenizer or template makes a difference. Same batch
(no gradient accumulation; TRL's sampler made sequential, so step k trains the same rows on
both sides), no packing on either side (TRL's ``packing=False``, tempering's
``sequence_packing`` off: a step's rows are the same batch on both sides), fp32 on CPU, AdamW
at the same constant learning rate, gradient clipping at 1.0, gradient checkpointing off.
Each side's defaults otherwise: TRL pads each batch to its longest row (``padding_free=False``;
``--trl-padding-free`` sets it), tempering picks each micro-batch's layout by its cost model
(padded rows, shared prefixes, or padding-free: `policy.padding_free`).

- tempering: the real controller path, a `Policy` over one FSDP2 worker in a Ray actor, the
  batches from SFT's own prefetching loader (taking the batch is inside the timed step);
- TRL 1.16: ``venvs/bench/bin/python`` in a subprocess (TRL is not a dependency of
  tempering), ``use_cpu=True, bf16=False``; seconds per step by a `TrainerCallback` from one
  `on_step_end` to the next (its batch's fetch and collation count, as on tempering's side;
  until 2026-11-28 it timed `on_step_begin` to `on_step_end`, which left them out).

Each side runs ``--runs`` times, interleaved (these machines are noisy); prints the median of
the per-run medians with their spread, and the speed-up per run. `placement.py` samples where
the host put the two cores meanwhile: each run's share of split-L3 samples, the speed-ups
grouped by tempering's placement, and the speed-up over the steps both sides ran on the same
placement. A benchmark reports, it never passes or fails.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench_dpo_vs_trl import spread
from peers import run_trl, scaled_args, scaled_parser  # bench/peers.py (this folder is on sys.path)
from placement import PlacementProbe, placement_note, print_by_placement, print_matched
from result_files import record  # bench/result_files.py: the docs' Benchmarks page reads its files

SCALES = {
    "tiny": dict(model="tiny-arith", rows=128, max_len=32, lr=1e-3, threads=2, steps=30, warmup=5),
    "smollm2": dict(
        model="smollm2-135m-instruct", rows=8, max_len=512, lr=1e-5, threads=2, steps=6, warmup=2
    ),
}

TRL_SCRIPT = textwrap.dedent(
    """
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):  # the rows in tempering's order, so both sides get the same batches
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    cfg = SFTConfig(
        output_dir=args["out"], per_device_train_batch_size=args["rows"],
        max_steps=args["steps"], learning_rate=args["lr"],
        # TRL refuses max_length with padding_free (it would not enforce it); the rows come
        # cut to max_len already
        max_length=None if args["padding_free"] else args["max_len"],
        packing=False, padding_free=args["padding_free"], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=10**6,
        dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, weight_decay=0.0, seed=0, shuffle_dataset=False,
    )
    trainer = InOrder(model=model, args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[timer])
    trainer.train()
    print("RESULT " + json.dumps(
        {"step_times": timer.times, "fetch_times": timer.fetch, "ends": timer.ends}
    ))
    """
)


def workload(scale: str, model: str, n_rows: int, max_len: int) -> tuple[list[dict], int]:
    """``n_rows`` tokenized SFT rows (input_ids, token_mask) and the pad id."""
    from tempering.data.collate import pad_token_id_of
    from tempering.data.processing import tokenize_message_logs
    from tempering.models.hf import load_tokenizer

    tokenizer = load_tokenizer(model)
    if scale == "tiny":
        from tempering.data.arithmetic import arithmetic_message_log
        from tempering.models.tiny_arith import make_problems

        logs = [
            arithmetic_message_log(p["prompt"], p["answer"])
            for p in make_problems(n_rows, seed=0, split="train")
        ]
    else:
        from tempering.data.gsm8k import gsm8k_sft_message_logs

        logs = gsm8k_sft_message_logs("train").examples[:n_rows]
        if len(logs) < n_rows:
            raise SystemExit(f"GSM8K has {len(logs)} training rows; --rows x --steps asks {n_rows}")
    examples, _ = tokenize_message_logs(logs, tokenizer, max_len)
    return examples, pad_token_id_of(tokenizer)


def bench_tempering(
    model: str, rows: list[dict], pad: int, args
) -> tuple[list[float], list[float], float]:
    """Seconds per step, each step's end (``time.monotonic``) and real (unpadded) tokens per
    step."""
    from tempering.data.collate import collate_sft
    from tempering.data.dataloader import StatefulDataLoader
    from tempering.distributed.virtual_cluster import cluster_from_config, init_ray
    from tempering.losses import NLLLoss
    from tempering.models.policy.lm_policy import build_policy

    init_ray(num_cpus=4, temp_dir=tempfile.mkdtemp(prefix="ray_bench_", dir="/tmp"))
    cluster = cluster_from_config(1, 0, name="bench_sft")
    policy = build_policy(
        cluster, model, train_global_batch_size=args.rows, train_micro_batch_size=args.rows,
        learning_rate=args.lr, lr_schedule="constant", warmup_steps=0, max_grad_norm=1.0,
        num_threads=args.threads, seed=0,
    )  # fmt: skip
    loader = StatefulDataLoader(  # as sft.setup builds it, in the rows' order
        rows, args.rows, shuffle=False, collate_fn=lambda ex: collate_sft(ex, pad), prefetch=True
    )
    loss_fn = NLLLoss()
    times, ends, tokens = [], [], 0
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = loader.next_batch()
            policy.train(batch, loss_fn)
            times.append(time.perf_counter() - t0)
            ends.append(time.monotonic())
            tokens += int(batch["input_lengths"].sum())
    finally:
        policy.shutdown()
        cluster.shutdown()
    return times, ends, tokens / args.steps


def _labels(row: dict) -> list[int]:
    """The row's tokens where the loss counts, -100 elsewhere (TRL's pre-tokenized labels)."""
    return [t if m else -100 for t, m in zip(row["input_ids"], row["token_mask"], strict=True)]


def bench_trl(model: str, rows: list[dict], args) -> dict:
    """TRL's ``step_times`` (end to end) and ``fetch_times`` (its batch, between steps)."""
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        data = Path(tmp) / "rows.json"
        data.write_text(
            json.dumps([{"input_ids": r["input_ids"], "labels": _labels(r)} for r in rows])
        )
        spec = {
            "model": model, "data": str(data), "out": str(Path(tmp) / "out"), "rows": args.rows,
            "steps": args.steps, "lr": args.lr, "max_len": args.max_len, "threads": args.threads,
            "padding_free": args.trl_padding_free,
        }  # fmt: skip
        return run_trl(TRL_SCRIPT, spec)


def main() -> None:
    parser = scaled_parser(__doc__, SCALES, "--rows", "rows per step")
    parser.add_argument(
        "--trl-padding-free", action="store_true",
        help="TRL's padding_free=True (its rows flattened into one; on sdpa transformers masks "
        "them apart densely): the peer's own way past the padding tempering skips",
    )  # fmt: skip
    args = scaled_args(parser, SCALES)

    from tempering.models.registry import resolve_model_path

    model = resolve_model_path(args.model)
    rows, pad = workload(args.scale, model, args.rows * args.steps, args.max_len)
    ours, theirs, split = [], [], []
    matched: tuple[list, list] = ([], [])  # every timed step: (placement, seconds, 1)
    with PlacementProbe() as probe:
        for run in range(args.runs):
            times, ends, tokens = bench_tempering(model, rows, pad, args)
            ours.append(statistics.median(times[args.warmup :]))
            trl = bench_trl(model, rows, args)
            theirs.append(statistics.median(trl["step_times"][args.warmup :]))
            fetch = statistics.median(trl["fetch_times"][args.warmup :])
            first = max(args.warmup - 1, 0)  # the timed steps' window (from the warm-up's end)
            split.append([probe.split_share(e[first], e[-1]) for e in (ends, trl["ends"])])
            for side, (secs, at) in zip(
                matched, ((times, ends), (trl["step_times"], trl["ends"])), strict=True
            ):
                side.extend(probe.placed_steps(at[args.warmup :], secs[args.warmup :]))
            print(
                f"run {run + 1}: tempering {ours[-1]:.4f} s/step, TRL {theirs[-1]:.4f} s/step"
                f" (of which its batch fetch {fetch * 1e3:.1f} ms) ({tokens:.0f} real "
                f"tokens/step); cores on two L3s: {placement_note(split[-1])}",
                flush=True,
            )  # fmt: skip
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    print(
        f"workload: {model}, {args.rows} rows/step, max_len {args.max_len}, no packing (TRL"
        f" padding_free={args.trl_padding_free}), fp32 CPU,"
        f" {args.threads} thread(s); per run the median of {args.steps - args.warmup} steps after"
        f" {args.warmup}; below the median of {args.runs} runs (min-max)"
    )
    print(f"tempering SFT (Ray + FSDP2 worker): {spread(ours)} s/step")
    print(f"TRL 1.16 SFTTrainer:                {spread(theirs)} s/step")
    print(f"speed-up (TRL s/step / tempering):  {spread(ratios, 2)}x")
    record(
        "sft_vs_trl",
        "SFT against TRL 1.16 SFTTrainer",
        args.scale,
        "s/step",
        ours,
        theirs,
        "TRL 1.16",
    )
    print_by_placement(ratios, [share for share, _ in split])
    print_matched(*matched)


if __name__ == "__main__":
    sys.exit(main())
