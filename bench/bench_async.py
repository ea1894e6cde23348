"""Asynchronous GRPO against synchronous on this machine: seconds per step and generated
tokens per second, with each phase, so it shows where the time goes.

    uv run bench/bench_async.py [--scale tiny|smollm2] [--steps N] [--runs 3]

Four shapes run interleaved, ``--runs`` times each, on the scale's workload
(bench_grpo_vs_trl.py's SCALES; ``smollm2`` is grpo_math_smollm2.yaml, whose async twin is
grpo_math_smollm2_async.yaml): synchronous with colocated generation (the CPU default),
synchronous with split generation (the same workers as async, taking turns), asynchronous
(``grpo.async_grpo.enabled=true``, max_trajectory_age_steps=1), and asynchronous with in-flight
weight updates (the refit does not wait for the batch in progress). Per run, the median of the
steps after the first two (warm-up, and async's first batch has nothing to overlap with),
then the median of the runs with their spread (min-max). No validation, no checkpoints: the
steps alone.

The last lines compute, from the synchronous split run's measured phases, what the same
schedule yields where generation and training do not share processors (one GPU generating
beside one GPU training): sync = generation + train + refit, async = max(generation, train)
+ refit. Computed, not measured, and labelled so. A benchmark prints figures; it never
passes or fails.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_grpo_vs_trl import SCALES, load, spread

SPLIT = "policy.generation.colocated.enabled=false"
SHAPES = {
    "sync, colocated": (),
    "sync, split": (SPLIT,),
    "async, split": (SPLIT, "grpo.async_grpo.enabled=true"),
    "async, in-flight": (SPLIT, "grpo.async_grpo.enabled=true",
                         "grpo.async_grpo.in_flight_weight_updates=true"),
}  # fmt: skip
PHASES = ("timing/generation_s", "timing/train_s", "timing/refit_s",
          "timing/idle/buffer_starvation_s", "timing/idle/refit_bubble_s",
          "train/mixed_version_samples")  # fmt: skip
WARMUP = 2


def run_shape(scale: str, steps: int, overrides: tuple[str, ...]) -> dict[str, list[float]]:
    """``steps`` steps of one shape: wall seconds, generated tokens and phases per step."""
    from tempering.algorithms import async_grpo, grpo

    cfg, resolved = load(scale, (*overrides, "grpo.val_at_start=false", "grpo.val_period=0"))
    run = grpo.setup(cfg, resolved)
    stepper = async_grpo.AsyncSteps(run) if cfg.grpo.async_grpo.enabled else grpo.SyncSteps(run)
    n = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    out: dict[str, list[float]] = {"step_s": [], "gen_tokens": []}
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            m = stepper.step(step)
            out["step_s"].append(time.perf_counter() - t0)
            out["gen_tokens"].append(m["train/gen_length_mean"] * n)
            for k in PHASES:
                out.setdefault(k, []).append(m.get(k, 0.0))
    finally:
        stepper.close()
        run.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", choices=list(SCALES), default="tiny")
    p.add_argument("--steps", type=int, default=None, help="steps per run (2 are warm-up)")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    steps = a.steps or max(SCALES[a.scale]["steps"], 3) + WARMUP
    per: dict[str, list[dict[str, float]]] = {name: [] for name in SHAPES}
    for r in range(a.runs):
        for name, overrides in SHAPES.items():
            res = run_shape(a.scale, steps, overrides)
            kept = {k: v[WARMUP:] for k, v in res.items()}
            row = {k: statistics.median(v) for k, v in kept.items()}
            row["tok_per_s"] = statistics.median(
                t / s for t, s in zip(kept["gen_tokens"], kept["step_s"], strict=True)
            )
            per[name].append(row)
            print(f"run {r + 1}, {name}: {row['step_s']:.3f} s/step, "
                  f"{row['tok_per_s']:.0f} generated tokens/s", flush=True)  # fmt: skip

    print(f"\nGRPO step, {a.scale}: median of {a.runs} runs (min-max), each the median of "
          f"{steps - WARMUP} steps after {WARMUP} warm-up")  # fmt: skip
    cols = ("step_s", "tok_per_s", *PHASES)
    print(f"{'':16s}" + "".join(f"{c.split('/')[-1]:>27s}" for c in cols))
    for name, rows in per.items():
        cells = [spread([row[c] for row in rows], ".0f" if c == "tok_per_s" else ".3f")
                 for c in cols]  # fmt: skip
        print(f"{name:16s}" + "".join(f"{c:>27s}" for c in cells))
    for shape in ("async, split", "async, in-flight"):
        for base in ("sync, colocated", "sync, split"):
            ratios = [s["step_s"] / x["step_s"] for s, x in zip(per[base], per[shape], strict=True)]  # fmt: skip
            print(f"{shape} speed-up over {base}, s/step: {spread(ratios)}x (measured)")
    split = per["sync, split"]
    gen, train, refit = (statistics.median(r[k] for r in split) for k in PHASES[:3])
    sync_s, async_s = gen + train + refit, max(gen, train) + refit
    print(f"COMPUTED for one GPU generating beside one GPU training, from sync-split's phases "
          f"(generation {gen:.3f} s, train {train:.3f} s, refit {refit:.3f} s): sync "
          f"{sync_s:.3f} s/step, async {async_s:.3f} s/step, {sync_s / async_s:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
