"""The GPU path as one prepared check: tempering's own training, generation, refit, planner and
GRPO code driven in this one process (no Ray), each section passed or failed.

    python tools/gpu_check.py --device cpu --quick --out /tmp/gpu_check.json   # CPU dry run
    tools/gpu_check.sh   # on a machine with a GPU: the wheels to carry and the command to run

Sections, in order, for tiny-arith and random-initialised Llama-3/Qwen3-shaped models built on
the device (--quick: the same families at a tiny shape):
  train_step   one bf16 step of `FSDP2PolicyWorker` (world size 1): loss and gradient norm
               against an fp32 CPU computation, within `train.LOSS_RTOL` / `GRAD_NORM_RTOL`;
  throughput   training tokens/s and MFU (bench's 6 x matmul params x tokens, against the
               device's bf16 matmul rate measured here);
  generation   the worker's torch engine at the GRPO shape: decode tokens/s;
  logprobs     train/token_mult_prob_error of the generated tokens (sampler vs trainer);
  refit        trainer state -> engine, seconds per GB, weights checked after;
  planner      the placement planner's memory estimate against the measured peak;
  grpo         a short GRPO loop on tiny-arith: held-out reward before -> after.
Writes the results as JSON (atomically) and prints a table; exits 1 if any check failed.
docs/scaling/gpu-check.md says more.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# in the order they run (the planner reads the peak memory of the training steps)
SECTIONS = ("train_step", "throughput", "planner", "generation", "logprobs", "refit", "grpo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps (CPU dry run)")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="results JSON")
    return p.parse_args(argv)


def select_device(name: str) -> Any:
    """The torch device; --device cpu hides any GPU (the policy worker takes CUDA whenever
    torch sees it), --device cuda refuses a machine whose torch sees none."""
    if name == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        sys.exit(f"gpu_check: --device cuda but torch {torch.__version__} ({build}) sees no GPU; "
                 "run on a GPU machine or pass --device cpu")  # fmt: skip
    return torch.device(name)


def run_model(name: str, folder: Path, device: Any, quick: bool) -> dict[str, Any]:
    """Every per-model section for `name`; a section that raises is recorded as failed with
    its error, and the rest of this model's sections are skipped (named as such)."""
    import torch
    from gpucheck import generation, models, train

    load = models.QUICK if quick else models.FULL
    out: dict[str, Any] = {}
    worker = None
    current = "train_step"
    try:
        path, vocab = models.build_model(name, folder, device)
        parity_batch = models.random_batch(load.parity_rows, load.parity_len, vocab, seed=0)
        train_batch = models.random_batch(load.train_rows, load.train_len, vocab, seed=1)
        ref = train.fp32_reference(path, parity_batch)
        baseline = 0
        if device.type == "cuda":  # the peak of this model's steps alone
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        worker = train.build_worker(path, device.type)
        out["train_step"] = {"params": ref["params"], **train.parity(worker, parity_batch, ref)}
        current = "throughput"
        peak = train.peak_bf16_flops(device, quick)
        out["throughput"] = train.throughput(worker, train_batch, load.timed_steps, ref, peak)
        current = "planner"
        out["planner"] = train.planner(path, train_batch, device, baseline)
        current = "generation"
        shape = generation.grpo_shape(quick)
        out["generation"], generated = generation.decode(worker, vocab, shape, device)
        current = "logprobs"
        out["logprobs"] = generation.logprob_mismatch(worker, generated)
        current = "refit"
        out["refit"] = generation.refit(worker, repeats=1 if quick else 3)
    except Exception as err:  # recorded, printed, and the check fails
        traceback.print_exc()
        out[current] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
        for later in SECTIONS[SECTIONS.index(current) + 1 : -1]:
            out.setdefault(later, {"passed": False, "error": f"not run: {current} failed"})
    finally:
        if worker is not None:
            worker.shutdown()
        del worker  # its model, optimizer and engine freed before the next model's peak
        gc.collect()
    return out


def run_grpo(device: Any, quick: bool) -> dict[str, Any]:
    from gpucheck import grpo, models, train

    load = models.QUICK if quick else models.FULL
    worker = None
    try:
        cfg = grpo.grpo_config(load.grpo_prompts, load.grpo_steps)
        grpo.seed_everything(cfg.grpo.seed)
        kwargs = grpo.worker_kwargs(cfg)
        worker = train.build_worker(cfg.policy.model_name, device.type, **kwargs)
        return grpo.run_grpo(worker, cfg, load.held_out, quick)
    except Exception as err:
        traceback.print_exc()
        return {"passed": False, "error": f"{type(err).__name__}: {err}"}
    finally:
        if worker is not None:
            worker.shutdown()


def collect(device: Any, quick: bool) -> dict[str, Any]:
    """All sections, by section then model."""
    import torch
    from gpucheck import generation, models, train

    sections: dict[str, Any] = {s: {"models": {}} for s in SECTIONS[:-1]}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in models.model_names(quick):
            print(f"gpu_check: {name} ...", flush=True)
            for section, result in run_model(name, Path(tmp), device, quick).items():
                sections[section]["models"][name] = result
    for body in sections.values():
        body["passed"] = bool(body["models"]) and all(r["passed"] for r in body["models"].values())
    print("gpu_check: grpo ...", flush=True)
    sections["grpo"] = run_grpo(device, quick)
    sections["train_step"]["tolerance"] = {"loss_rtol": train.LOSS_RTOL,
                                           "grad_norm_rtol": train.GRAD_NORM_RTOL}  # fmt: skip
    sections["logprobs"]["max_allowed"] = generation.TOKEN_MULT_PROB_ERROR_MAX
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    sections["multi_gpu"] = {
        "visible_gpus": count,
        "passed": None,  # not a check: shown in the table, never counted as passed
        "note": "world size 1 only: this check does not yet spawn one rank per GPU"
        + (f" ({count} visible, {count - 1} not exercised)" if count > 1 else ""),
    }
    sections["no_ray"] = {"passed": "ray" not in sys.modules,
                          "note": "the device image has no Ray: nothing here may import it"}  # fmt: skip
    return sections


# the figure each section's table row shows: (key, format)
HEADLINES = {
    "train_step": (("loss_rel_err", "loss err {:.2e}"), ("grad_norm_rel_err", "gnorm err {:.2e}")),
    "throughput": (("tokens_per_s", "{:,.0f} tok/s"), ("mfu", "MFU {:.1%}")),
    "planner": (("estimate_gib", "est {:.3f} GiB"), ("ratio", "ratio {:.2f}")),
    "generation": (("decode_tokens_per_s", "{:,.0f} tok/s"),),
    "logprobs": (("token_mult_prob_error", "mult err {:.4f}"),),
    "refit": (("s_per_gb", "{:.3f} s/GB"),),
}


def table(sections: dict[str, Any]) -> str:
    """One line per section and model: PASS/FAIL and its headline figures."""
    rows = []
    for section, body in sections.items():
        for name, result in body.get("models", {"-": body}).items():
            mark = {True: "PASS", False: "FAIL", None: "n/a "}[result["passed"]]
            figures = [fmt.format(result[key]) for key, fmt in HEADLINES.get(section, ())
                       if isinstance(result.get(key), (int, float))]  # fmt: skip
            if section == "grpo" and "held_out_reward_before" in result:
                figures.append(
                    "held-out reward {:.3f} -> {:.3f}".format(
                        result["held_out_reward_before"], result["held_out_reward_after"]
                    )
                )
            detail = result.get("error") or result.get("note") or ""
            rows.append(f"{mark}  {section:<11} {name:<17} {'  '.join(figures)}  {detail}")
    return "\n".join(rows)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a temporary file beside `path`, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = select_device(args.device)
    sys.path.insert(0, str(REPO))  # tempering from this checkout
    import torch

    sections = collect(device, args.quick)
    failed = [s for s, body in sections.items() if body["passed"] is False]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "quick": args.quick,
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - start,
        "failed": failed,
        "passed": not failed,
        "sections": sections,
    }
    write_json(args.out, report)
    print(table(sections))
    print(f"gpu_check: {'PASSED' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"in {report['wall_s']:.0f} s; results in {args.out}")  # fmt: skip
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
