"""What a variant of the main job costs in learning: held-out accuracy against the default job
at the same number of steps, over several seeds.

    uv run bench/bench_accuracy.py --variants async          [--seeds 42 1 2] [--steps 600]
    uv run bench/bench_accuracy.py --variants bf16 bf16-raw  # sampling precision
    uv run bench/bench_accuracy.py --scale smollm2 --variants bf16   # [--steps 24]

Variants (each beside ``fp32``, the default job: examples/configs/grpo_math_tiny.yaml,
colocated torch engine sampling in float32):
- ``async``: ``grpo.async_grpo.enabled=true`` on split generation workers, one step off-policy;
- ``bf16``: the engine samples in bfloat16 (``policy.generation.precision``), the trainer stays
  float32, and the loss weights each token by pi_trainer / pi_sampler truncated at 2 (tis);
- ``bf16-raw``: bfloat16 sampling without the correction.

Each seed runs ``fp32`` and then every variant (interleaved, so the machine's drift weighs on
all). No wall-time cap and no checkpoints, so each gets exactly ``--steps`` steps. Every final
model is scored by ``tempering eval`` (float32 greedy torch engine, the 256 held-out problems),
the same judge for all -- the job's own validation samples with the run's engine, so a
bfloat16 run's would be a bfloat16 judge. Printed per run: the eval's accuracy of the final
model, the gain over the start model's (the same for all), the job's own last validation, the
sampler/trainer mismatch (``train/token_mult_prob_error``, last 100 steps) and generation speed
(generated tokens per second of ``timing/generation_s``); then per variant the mean gain and
its difference to fp32's, and the generation speed ratio. A benchmark prints figures; it never
passes or fails.

``--scale smollm2``: examples/configs/grpo_math_smollm2.yaml (SmolLM2-135M, 4 prompts x 4,
temperature 0.7) at lr 1e-5 on problems SmolLM2 can partly do: single-digit addition and
subtraction in the GSM8K prompt ("What is 7 - 9?"), 108 of the 162 pairs to train on and the
other 54 held out (`single_digit_problems`), scored by math-verify; its own GSM8K validation
starts at 0% on CPU, where no learning can be read. The judge is ``tempering eval --task
problems`` of each final model on the 54 (float32, greedy, the chat template, 128 tokens).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tempering.data.grpo_problems import SINGLE_DIGIT_HELD_OUT as HELD_OUT
from tempering.data.grpo_problems import single_digit_problems

REPO = Path(__file__).resolve().parents[1]
BF16 = "policy.generation.precision=bfloat16"
TIS = (
    "loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_type=tis",
    "loss_fn.truncated_importance_sampling_ratio=2.0",
)
VARIANTS = {
    "fp32": (),
    "async": ("grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"),
    "bf16": (BF16, *TIS),
    "bf16-raw": (BF16,),
}
# per scale: the job's arguments, steps, rows a step (prompts x samples) and what judges it
SCALES = {
    "tiny": {"args": (), "steps": 600, "rows": 32 * 8, "baseline": "tiny-arith"},
    "smollm2": {
        "args": (
            "--config", "examples/configs/grpo_math_smollm2.yaml", "data.dataset_name=problems",
            "data.reasoning_gym_tasks=[]", "policy.optimizer.kwargs.lr=1.0e-5",
            "grpo.val_period=8", f"grpo.max_val_samples={HELD_OUT}",
            f"grpo.val_batch_size={HELD_OUT}", f"data.num_val_samples={HELD_OUT}",
        ),
        "steps": 24, "rows": 4 * 4, "baseline": "smollm2-135m-instruct",
    },
}  # fmt: skip
SUMMARY = re.compile(r"held-out greedy accuracy ([\d.]+)% -> ([\d.]+)%")
EVAL = re.compile(r"model +\S+: accuracy ([\d.]+)%")
BASELINE = re.compile(r"baseline +\S+: accuracy ([\d.]+)%")


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def run(variant: str, seed: int, steps: int, out: Path, scale: str) -> dict[str, float]:
    """One run of the job at ``scale``, then `tempering eval` of its final model."""
    name, spec = f"{variant}-{seed}", SCALES[scale]
    data: list[str] = []
    judge = ["--task", "arithmetic"]
    if scale == "smollm2":
        train, val = single_digit_problems(out)
        data = [f"data.train_data_path={train}", f"data.val_data_path={val}"]
        judge = ["--task", "problems", "--data", str(val), "--samples", str(HELD_OUT),
                 "--chat-template", "--max-new-tokens", "128"]  # fmt: skip
    cmd = [
        sys.executable, str(REPO / "examples/run_grpo_math.py"), *spec["args"], *data,
        *VARIANTS[variant],
        f"grpo.seed={seed}", f"grpo.max_num_steps={steps}", "grpo.max_wall_time_s=null",
        "checkpointing.enabled=false", f"checkpointing.checkpoint_dir={out}/{name}",
        "logger.tensorboard_enabled=false", f"logger.log_dir={out}/{name}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - t0
    _check(proc, f"{name}")
    found = SUMMARY.search(proc.stdout)
    if not found:
        raise SystemExit(f"{name}: no summary line in its output:\n{proc.stdout[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/generation_s" in r]
    gen_s = sum(r["timing/generation_s"] for r in train)
    tokens = sum(r["train/gen_length_mean"] * spec["rows"] for r in train)
    mismatch = [r["train/token_mult_prob_error"] for r in train[-100:]]
    judged = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "eval", str(out / name / "final_hf"),
         "--baseline", spec["baseline"], *judge, "--report", str(out / f"{name}.json")],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    _check(judged, f"tempering eval of {name}")
    return {
        "eval": float(EVAL.search(judged.stdout).group(1)),
        "start": float(BASELINE.search(judged.stdout).group(1)),
        "own_val": float(found.group(2)),
        "wall_s": took,
        "gen_tok_s": tokens / gen_s,
        "mismatch": statistics.mean(mismatch),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", choices=sorted(set(VARIANTS) - {"fp32"}),
                   default=["async"])  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="default: 600 tiny, 24 smollm2")
    p.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    args = p.parse_args()
    steps = args.steps or SCALES[args.scale]["steps"]
    names = ["fp32", *args.variants]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for variant in names:
                r = run(variant, seed, steps, Path(tmp), args.scale)
                results[variant].append(r)
                print(f"{variant:8s} seed {seed:3d}: eval {r['start']:.1f}% -> {r['eval']:.1f}% "
                      f"({r['eval'] - r['start']:+.1f} points; own validation {r['own_val']:.1f}%) "
                      f"in {r['wall_s']:.0f} s; generation {r['gen_tok_s']:.0f} tok/s, "
                      f"token_mult_prob_error {r['mismatch']:.4f}", flush=True)  # fmt: skip
    base_gain = statistics.mean(r["eval"] - r["start"] for r in results["fp32"])
    base_speed = statistics.median(r["gen_tok_s"] for r in results["fp32"])
    for variant, runs in results.items():
        gains = [r["eval"] - r["start"] for r in runs]
        speeds = [r["gen_tok_s"] for r in runs]
        print(f"{variant:8s} gain: mean {statistics.mean(gains):+.1f} points (min {min(gains):+.1f}, "
              f"max {max(gains):+.1f}) over {len(gains)} seeds, "
              f"{statistics.mean(gains) - base_gain:+.1f} against fp32; generation "
              f"{statistics.median(speeds):.0f} tok/s ({min(speeds):.0f}-{max(speeds):.0f}), "
              f"{statistics.median(speeds) / base_speed:.2f}x fp32's")  # fmt: skip


if __name__ == "__main__":
    main()
