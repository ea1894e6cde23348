"""The main job on a shared machine: its step time with one busy-loop process beside it,
against the same machine idle.

    uv run bench/bench_busy.py [--steps 30] [--runs 3] [--set KEY=VALUE ...] [--env NAME=VALUE ...]

A user's laptop always runs something else. Each run starts the default GRPO job
(``examples/run_grpo_math.py``, no validation, no checkpoints, ``--steps`` steps) twice, once on
the idle machine and once beside ``python3 -c "while True: pass"`` (one of the machine's cores
taken), alternating which goes first. Per job, the median of the steps after the first
``WARMUP`` (step, generation and train phases, from its metrics.jsonl); then the median of the
runs with their spread (min-max), and the busy/idle factor. ``--set`` passes config overrides
and ``--env`` environment variables to both jobs (to compare a change: run once with, once
without). A benchmark prints figures; it never passes or fails.
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
    return {k: statistics.median(r[k] for r in steps_rows) for k in PHASES}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the jobs")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    results: dict[bool, list[dict]] = {False: [], True: []}
    for run in range(args.runs):
        for busy in (False, True) if run % 2 == 0 else (True, False):
            results[busy].append(run_job(args.steps, busy, args.set, env))
            print(f"run {run + 1}, {'busy' if busy else 'idle'}: {results[busy][-1]}", flush=True)

    print(
        f"\nthe main job, {args.steps} steps (median of steps {WARMUP + 1}+), {args.runs} runs, "
        f"overrides {args.set or 'none'}, env {env or 'none'}; seconds, median (min-max):"
    )
    for key in PHASES:
        idle = [r[key] for r in results[False]]
        busy = [r[key] for r in results[True]]
        factors = [b / i for b, i in zip(busy, idle, strict=True)]
        print(f"  {key:22s} idle {spread(idle)}  busy {spread(busy)}  factor {spread(factors)}")


if __name__ == "__main__":
    main()
