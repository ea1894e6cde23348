"""DPO seconds per optimizer step: tempering vs TRL's `DPOTrainer` on the same tiny workload.

    uv run --frozen python bench/bench_dpo_vs_trl.py [--model tiny-arith] [--pairs 32]
        [--steps 30] [--warmup 5] [--threads 1] [--runs 3]

Same model folder, same synthetic arithmetic pairs (correct vs corrupted answer), same batch
(`--pairs` pairs = 2x rows, chosen and rejected in one forward in both), same max length,
fp32 on CPU, AdamW at the same learning rate, beta 0.1, gradient checkpointing off, reference
log-probs computed every step in both (TRL: `precompute_ref_log_probs=False`, the default).

- tempering: the real controller path, a `Policy` over one FSDP2 worker in a Ray actor
  (one train call per step: the worker computes the reference log-probs per micro-batch, and
  a pair's shared prompt runs once (`policy.shared_prefix`, on by default); the controller
  tokenizes each step's pairs inside the timed step);
- TRL 1.16: run with ``venvs/bench/bin/python`` in a subprocess (TRL is not a
  dependency of tempering), ``use_cpu=True, bf16=False``; seconds per step measured by a
  `TrainerCallback` between `on_step_begin` and `on_step_end`.

Each side runs ``--runs`` times, interleaved (these machines are noisy); prints the median of
the per-run medians with their spread, and the speed-up per run. A benchmark reports, it never
passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from peers import ensure_bench_venv  # bench/peers.py (this folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 32
BETA = 0.1
LR = 5e-4

TRL_SCRIPT = textwrap.dedent(
    """
    import json, sys, time, torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    args = json.loads(sys.argv[1])
    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    rows = json.load(open(args["data"]))
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args["model"])
    tok.chat_template = None  # plain prompt + completion text, as tempering tokenizes it

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None
        def on_step_begin(self, a, s, c, **kw):
            self.t0 = time.perf_counter()
        def on_step_end(self, a, s, c, **kw):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
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
    print("RESULT " + json.dumps({"step_times": timer.times}))
    """
)


def workload(n_pairs: int) -> list:
    from tempering.data.preference_datasets import arithmetic_preference_pairs

    return arithmetic_preference_pairs(n_pairs, seed=0).examples


def bench_tempering(model: str, pairs: list, args: argparse.Namespace) -> list[float]:
    from tempering.algorithms.dpo import dpo_step, preference_batch
    from tempering.algorithms.loss_functions import DPOLoss
    from tempering.distributed.virtual_cluster import cluster_from_config, init_ray
    from tempering.models.hf import load_tokenizer
    from tempering.models.policy.lm_policy import build_policy

    init_ray(num_cpus=4, temp_dir=tempfile.mkdtemp(prefix="ray_bench_", dir="/tmp"))
    cluster = cluster_from_config(1, 0, name="bench_dpo")
    rows = 2 * args.pairs
    policy = build_policy(
        cluster,
        model,
        train_global_batch_size=rows,
        train_micro_batch_size=rows,
        learning_rate=LR,
        init_reference_model=True,
        num_threads=args.threads,
        seed=0,
    )
    tokenizer = load_tokenizer(model)
    loss_fn = DPOLoss(BETA)
    times = []
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            chunk = pairs[step * args.pairs : (step + 1) * args.pairs]
            dpo_step(policy, preference_batch(chunk, tokenizer, MAX_LEN), loss_fn)
            times.append(time.perf_counter() - t0)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return times


def bench_trl(model: str, pairs: list, args: argparse.Namespace) -> list[float]:
    trl_python = ensure_bench_venv()
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        data = Path(tmp) / "pairs.json"
        data.write_text(
            json.dumps(
                [
                    {
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
            "lr": LR,
            "beta": BETA,
            "max_len": MAX_LEN,
            "threads": args.threads,
        }
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        proc = subprocess.run(
            [str(trl_python), "-c", TRL_SCRIPT, json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])["step_times"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-arith")
    parser.add_argument("--pairs", type=int, default=32, help="preference pairs per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, interleaved")
    args = parser.parse_args()

    from tempering.models.registry import resolve_model_path

    model = resolve_model_path(args.model)
    pairs = workload(args.pairs * args.steps)
    ours, theirs = [], []
    for run in range(args.runs):
        ours.append(statistics.median(bench_tempering(model, pairs, args)[args.warmup :]))
        theirs.append(statistics.median(bench_trl(model, pairs, args)[args.warmup :]))
        print(f"run {run + 1}: tempering {ours[-1]:.4f} s/step, TRL {theirs[-1]:.4f} s/step")
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    print(
        f"workload: {model}, {args.pairs} pairs ({2 * args.pairs} rows)/step, max_len {MAX_LEN},"
        f" fp32 CPU, {args.threads} thread(s); per run the median of {args.steps - args.warmup}"
        f" steps after {args.warmup}; below the median of {args.runs} runs (min-max)"
    )
    print(f"tempering DPO (Ray + FSDP2 worker): {spread(ours)} s/step")
    print(f"TRL 1.16 DPOTrainer:                {spread(theirs)} s/step")
    print(f"speed-up (TRL s/step / tempering):  {spread(ratios, 2)}x")


def spread(values: list[float], digits: int = 4) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


if __name__ == "__main__":
    sys.exit(main())
