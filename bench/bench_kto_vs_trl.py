"""KTO seconds per optimizer step: tempering vs TRL's `KTOTrainer` on the same workload.

    uv run --frozen python bench/bench_kto_vs_trl.py [--scale tiny|smollm2] [--rows N]
        [--steps N] [--warmup N] [--threads N] [--runs 3]

Scales (each flag overrides its scale's value): DPO's benchmark pairs (`bench_dpo_vs_trl.py`)
unpaired as both trainers' users would (each pair a desirable and an undesirable row, in
order), so `--rows` labelled rows a step:
- tiny: tiny-arith, arithmetic rows as plain text, 32 rows a step, max length 32, lr 2e-5
  (kto.yaml's), 1 thread, 30 steps (5 left out);
- smollm2: SmolLM2-135M-Instruct, GSM8K rows in the model's chat template on both sides, 8 rows
  a step, max length 256, lr 1e-6, 2 threads, 8 steps (2 left out).

Same model folder, same rows in the same order, same batch, max length, fp32 on CPU, AdamW at
the same learning rate, beta 0.1, weights 1, gradient checkpointing off, the reference's
log-probs and the KL rows (each row's prompt with another row's response) computed every step
in both (TRL: `precompute_ref_log_probs=False`, the default; its KL rows score without
gradients, ours ride in the training forward: `tempering/algorithms/kto.py`).

- tempering: the real controller path (`kto.kto_step`), a `Policy` over one FSDP2 worker in a
  Ray actor, rows from KTO's own loader (tokenizing the next step's rows in a background
  thread; taking the batch counts in the timed step);
- TRL 1.16: in ``venvs/bench`` (`peers.run_trl`), ``use_cpu=True, bf16=False``; a step timed
  from one ``on_step_end`` to the next (its batch fetch counts, as ours does).

Each side runs ``--runs`` times, interleaved; prints the median of the per-run medians with
their spread, and the speed-up per run. A benchmark reports, it never passes or fails.
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

from bench_dpo_vs_trl import spread, workload  # this folder is on sys.path
from peers import run_trl, scaled_args, scaled_parser
from result_files import record  # bench/result_files.py: the docs' Benchmarks page reads its files

BETA = 0.1
SCALES = {
    "tiny": dict(model="tiny-arith", rows=32, max_len=32, lr=2e-5, threads=1, steps=30, warmup=5),
    "smollm2": dict(
        model="smollm2-135m-instruct", rows=8, max_len=256, lr=1e-6, threads=2, steps=8, warmup=2
    ),
}

TRL_SCRIPT = textwrap.dedent(
    """
    from trl import KTOConfig, KTOTrainer

    if not args["chat"]:
        tok.chat_template = None  # plain prompt + completion text, as tempering tokenizes it
    cfg = KTOConfig(
        output_dir=args["out"], per_device_train_batch_size=args["rows"],
        max_steps=args["steps"], learning_rate=args["lr"], beta=args["beta"],
        desirable_weight=1.0, undesirable_weight=1.0, max_length=args["max_len"],
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, report_to=[],
        save_strategy="no", logging_steps=10**6, dataloader_num_workers=0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        disable_dropout=True, seed=0,
    )
    trainer = KTOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[timer])
    trainer.train()
    print("RESULT " + json.dumps({"step_times": timer.times, "fetch_times": timer.fetch}))
    """
)


def labelled_rows(scale: str, n_rows: int) -> list:
    from tempering.data.unpaired import unpair

    return unpair(workload(scale, (n_rows + 1) // 2))[:n_rows]


def bench_tempering(model: str, rows: list, args: argparse.Namespace) -> tuple[list, float]:
    """Seconds per step and tokens per step (rows and KL rows, after truncation)."""
    from tempering.algorithms.kto import kto_batch, kto_step
    from tempering.algorithms.preference import preference_loader
    from tempering.distributed.virtual_cluster import cluster_from_config, init_ray
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.lm_policy import build_policy
    from tempering.preference_losses import KTOLoss

    init_ray(num_cpus=4, temp_dir=tempfile.mkdtemp(prefix="ray_bench_", dir="/tmp"))
    cluster = cluster_from_config(1, 0, name="bench_kto")
    batch_rows = 2 * args.rows  # each row with its KL row
    policy = build_policy(
        cluster,
        model,
        train_global_batch_size=batch_rows,
        train_micro_batch_size=batch_rows,
        learning_rate=args.lr,
        init_reference_model=True,
        num_threads=args.threads,
        seed=0,
    )
    loader = preference_loader(
        rows, batch_rows, load_tokenizer(model), args.max_len, shuffle=False, collate=kto_batch
    )  # as kto.setup builds it
    loss_fn = KTOLoss(BETA)
    times, tokens = [], 0
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = loader.next_batch()
            kto_step(policy, batch, loss_fn)
            tokens += int(batch["input_lengths"].sum())
            times.append(time.perf_counter() - t0)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return times, tokens / args.steps


def bench_trl(model: str, rows: list, args: argparse.Namespace) -> tuple[list, list]:
    """TRL's step times (end to end) and its batch fetches between steps."""
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        data = Path(tmp) / "rows.json"

        def text(messages: list) -> str | list:
            return messages if args.chat else messages[0]["content"]

        data.write_text(json.dumps([
            {"prompt": text(r.prompt), "completion": text(r.completion), "label": r.desirable}
            for r in rows
        ]))  # fmt: skip
        spec = {"model": model, "data": str(data), "out": str(Path(tmp) / "out"),
                "rows": args.rows, "steps": args.steps, "lr": args.lr, "beta": BETA,
                "max_len": args.max_len, "threads": args.threads, "chat": args.chat}  # fmt: skip
        result = run_trl(TRL_SCRIPT, spec)
    return result["step_times"], result["fetch_times"]


def main() -> None:
    parser = scaled_parser(__doc__, SCALES, "--rows", "labelled rows per step")
    args = scaled_args(parser, SCALES)

    from tempering.models.registry import resolve_model_path

    model = resolve_model_path(args.model)
    args.chat = args.scale == "smollm2"  # as bench_dpo_vs_trl.py: messages where it has a template
    rows = labelled_rows(args.scale, args.rows * args.steps)
    ours, theirs = [], []
    for run in range(args.runs):
        times, our_tokens = bench_tempering(model, rows, args)
        ours.append(statistics.median(times[args.warmup :]))
        times, fetches = bench_trl(model, rows, args)
        theirs.append(statistics.median(times[args.warmup :]))
        fetch = statistics.median(fetches[args.warmup :])
        print(
            f"run {run + 1}: tempering {ours[-1]:.4f} s/step ({our_tokens:.0f} tokens/step with"
            f" the KL rows), TRL {theirs[-1]:.4f} s/step (of which its batch fetch"
            f" {fetch * 1e3:.1f} ms)"
        )
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    print(
        f"workload: {model}, {args.rows} labelled rows/step (+ their KL rows), max_len"
        f" {args.max_len}, chat template {'on' if args.chat else 'off'}, fp32 CPU,"
        f" {args.threads} thread(s); per run the median of {args.steps - args.warmup} steps after"
        f" {args.warmup}; below the median of {args.runs} runs (min-max)"
    )
    print(f"tempering KTO (Ray + FSDP2 worker): {spread(ours)} s/step")
    print(f"TRL 1.16 KTOTrainer:                {spread(theirs)} s/step")
    print(f"speed-up (TRL s/step / tempering):  {spread(ratios, 2)}x")
    record(
        "kto_vs_trl",
        "KTO against TRL 1.16 KTOTrainer",
        args.scale,
        "s/step",
        ours,
        theirs,
        "TRL 1.16",
    )


if __name__ == "__main__":
    sys.exit(main())
