"""What staleness costs in learning: the main job's held-out accuracy, synchronous against
asynchronous GRPO at the same number of steps, over several seeds.

    uv run bench/bench_async_accuracy.py [--seeds 42 1 2] [--steps 600]

Each seed runs the default job (examples/configs/grpo_math_tiny.yaml) twice, interleaved:
synchronous (colocated generation, the CPU default) and asynchronous
(``grpo.async_grpo.enabled=true`` on split generation workers, one step off-policy). No
wall-time cap and no checkpoints, so both get exactly ``--steps`` steps. Prints each run's
held-out greedy accuracy at step 0 and at the end (the summary line of the job), the gains,
and the difference of the mean gains. A benchmark prints figures; it never passes or fails.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "sync": (),
    "async": ("grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false"),
}
SUMMARY = re.compile(r"held-out greedy accuracy ([\d.]+)% -> ([\d.]+)%")


def run(shape: str, seed: int, steps: int, out: Path) -> tuple[float, float, float]:
    """One run of the main job: (start accuracy %, end accuracy %, wall seconds)."""
    cmd = [
        sys.executable, str(REPO / "examples/run_grpo_math.py"), *SHAPES[shape],
        f"grpo.seed={seed}", f"grpo.max_num_steps={steps}", "grpo.max_wall_time_s=null",
        "checkpointing.enabled=false", "logger.tensorboard_enabled=false",
        f"logger.log_dir={out}/{shape}-{seed}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - t0
    found = SUMMARY.search(proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{shape} seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return float(found.group(1)), float(found.group(2)), took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args()
    gains: dict[str, list[float]] = {s: [] for s in SHAPES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for shape in SHAPES:
                start, end, took = run(shape, seed, args.steps, Path(tmp))
                gains[shape].append(end - start)
                print(f"{shape:5s} seed {seed:3d}: {start:.1f}% -> {end:.1f}% "
                      f"({end - start:+.1f} points) in {took:.0f} s", flush=True)  # fmt: skip
    for shape, g in gains.items():
        print(f"{shape:5s} gain: mean {statistics.mean(g):+.1f} points "
              f"(min {min(g):+.1f}, max {max(g):+.1f}) over {len(g)} seeds")  # fmt: skip
    diff = statistics.mean(gains["async"]) - statistics.mean(gains["sync"])
    print(f"async - sync mean gain: {diff:+.1f} points at {args.steps} steps")


if __name__ == "__main__":
    main()
