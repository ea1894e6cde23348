"""The main job on a shared machine: its step time with one busy-loop process beside it,
against the same machine idle.

    uv run bench/bench_busy.py [--steps 30] [--runs 3] [--set KEY=VALUE ...] [--env NAME=VALUE ...]
        [--variant LABEL:NAME=VALUE,NAME=VALUE ...]

A user's laptop always runs something else. Each run starts the default GRPO job
(``examples/run_grpo_math.py``, no validation, no checkpoints, ``--steps`` steps) twice, once on
the idle machine and once beside ``python3 -c "while True: pass"`` (one of the machine's cores
taken), alternating which goes first. Per job, the median of the steps after the first
``WARMUP`` (step, generation and train phases, from its metrics.jsonl); then the median of the
runs with their spread (min-max), and the busy/idle factor. ``--set`` passes config overrides
and ``--env`` environment variables to both jobs. ``--variant`` (repeatable) adds environment
variables of its own to a variant of the setup; the variants' jobs are interleaved within each
run (idle and busy of each, the order rotating), so they meet the same minutes of this noisy
machine. Where the policy workers report it, the median of ``resources/policy/threads`` (the
torch threads the worker computed with, ``tempering/utils/threads.py``) is printed too. A
benchmark prints figures; it never passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3
PHASES = ("timing/step_s", "timing/generation_s", "timing/train_s")
THREADS = "resources/policy/threads"


def run_job(steps: int, busy: bool, overrides: list[str], env: dict[str, str]) -> dict:
    """One main job; the median of each phase over its steps after the warm-up."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable, "examples/run_grpo_math.py", f"grpo.max_num_steps={steps}",
                "grpo.val_period=0", "grpo.val_at_start=false", "checkpointing.enabled=false",
                "grpo.max_wall_time_s=null", f"logger.log_dir={tmp}/logs", *overrides,
            ]  # fmt: skip
            proc = subprocess.run(
                cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True
            )
            if proc.returncode != 0:
                sys.exit(f"the job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            rows = [
                json.loads(x) for x in Path(tmp, "logs", "metrics.jsonl").read_text().splitlines()
            ]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    steps_rows = [r for r in rows if "timing/step_s" in r and r["step"] > WARMUP]
    out = {k: statistics.median(r[k] for r in steps_rows) for k in PHASES}
    threads = [r[THREADS] for r in rows if THREADS in r and r["step"] > WARMUP]
    if threads:
        out[THREADS] = statistics.median(threads)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def parse_variants(items: list[str]) -> dict[str, dict[str, str]]:
    """``LABEL:NAME=VALUE,NAME=VALUE`` -> {label: env}; none given: one variant, ``base``."""
    variants: dict[str, dict[str, str]] = {}
    for item in items:
        label, _, pairs = item.partition(":")
        env = dict(p.split("=", 1) for p in pairs.split(",") if p)
        if not label or any(not k for k in env):
            sys.exit(f"--variant {item!r}: expected LABEL:NAME=VALUE[,NAME=VALUE]")
        variants[label] = env
    return variants or {"base": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the jobs")
    parser.add_argument("--variant", action="append", default=[], help="LABEL:NAME=VALUE,...")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    variants = parse_variants(args.variant)
    jobs = [(label, busy) for label in variants for busy in (False, True)]
    results: dict[tuple[str, bool], list[dict]] = {job: [] for job in jobs}
    for run in range(args.runs):
        shift = run % len(jobs)
        for label, busy in jobs[shift:] + jobs[:shift]:
            result = run_job(args.steps, busy, args.set, {**env, **variants[label]})
            results[(label, busy)].append(result)
            print(f"run {run + 1}, {label}, {'busy' if busy else 'idle'}: {result}", flush=True)

    print(
        f"\nthe main job, {args.steps} steps (median of steps {WARMUP + 1}+), {args.runs} runs, "
        f"overrides {args.set or 'none'}, env {env or 'none'}; seconds, median (min-max):"
    )
    for label, extra in variants.items():
        print(f"{label} {extra or ''}")
        idle_runs, busy_runs = results[(label, False)], results[(label, True)]
        for key in PHASES:
            idle = [r[key] for r in idle_runs]
            busy = [r[key] for r in busy_runs]
            factors = [b / i for b, i in zip(busy, idle, strict=True)]
            print(f"  {key:22s} idle {spread(idle)}  busy {spread(busy)}  factor {spread(factors)}")
        if all(THREADS in r for r in idle_runs + busy_runs):
            print(f"  {THREADS:22s} idle {spread([r[THREADS] for r in idle_runs])}  "
                  f"busy {spread([r[THREADS] for r in busy_runs])}")  # fmt: skip


if __name__ == "__main__":
    main()
