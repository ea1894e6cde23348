"""The policy's training step through `FSDP2PolicyWorker` (the class the Ray actors wrap),
world size 1 in this process: bf16 parity against an fp32 CPU computation, throughput and MFU,
and the planner's memory estimate against the memory the step took."""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
# bf16 parity: bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4% per operation);
# the loss is a mean over many tokens, so its rounding averages out, while the gradient norm
# sums squares of bf16 backward products. Measured on CPU (tiny shapes): loss within 0.1%,
# gradient norm within 1%.
LOSS_RTOL = 0.01
GRAD_NORM_RTOL = 0.05


def worker_kwargs(device: str) -> dict[str, Any]:
    """The policy worker as the GPU configs ship it: bf16 compute, fp32 master state."""
    return {
        "precision": "bfloat16",
        "learning_rate": 1e-5,
        "max_grad_norm": 1.0,
        "seed": 0,
        "num_threads": 2 if device == "cpu" else None,
    }


def fp32_reference(path: str, batch: Any) -> dict[str, Any]:
    """Loss and gradient norm of one batch on the CPU in fp32, plain autograd (no worker, no
    FSDP2): the masked NLL `losses.NLLLoss` computes, written out independently."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "bench"))
    from bench_floor import matmul_params  # bench's FLOP count: 6 x matmul params x tokens

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, lens = batch["input_ids"], batch["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # scores tokens 1..S-1
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    loss = -(picked * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    grads = [p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None]
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(torch.stack(grads).sum().sqrt()),
        "matmul_params": int(matmul_params(model)),
        "params": sum(p.numel() for p in model.parameters()),
    }


def build_worker(path: str, device: str, **extra: Any) -> Any:
    from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker

    return FSDP2PolicyWorker(path, **{**worker_kwargs(device), **extra})


def parity(worker: Any, batch: Any, ref: dict[str, Any]) -> dict[str, Any]:
    """One training step of the bf16 worker on the reference's batch (its first step: the
    loss and gradient norm are of the same weights)."""
    from tempering.losses import NLLLoss

    got = worker.train(batch, NLLLoss(), global_batch_size=batch.size)
    loss_err = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    gn_err = abs(got["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])
    return {
        "loss": got["loss"],
        "loss_fp32_cpu": ref["loss"],
        "loss_rel_err": loss_err,
        "grad_norm": got["grad_norm"],
        "grad_norm_fp32_cpu": ref["grad_norm"],
        "grad_norm_rel_err": gn_err,
        "tolerance": {"loss_rtol": LOSS_RTOL, "grad_norm_rtol": GRAD_NORM_RTOL},
        "passed": loss_err <= LOSS_RTOL and gn_err <= GRAD_NORM_RTOL,
    }


def peak_bf16_flops(device: torch.device, quick: bool) -> float:
    """The device's bf16 matmul rate: one large square product, timed (the fastest of several
    after warm-ups: a peak, not an average), the peak MFU is measured against."""
    n, reps = (512, 5) if quick else ((8192, 10) if device.type == "cuda" else (2048, 3))
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def throughput(worker: Any, batch: Any, steps: int, ref: dict[str, Any], peak: float) -> dict:
    """Training tokens/s over `steps` timed steps (after the parity step as warm-up) and MFU
    = 6 x matmul parameters x tokens / seconds / the measured bf16 matmul peak (bench's
    count, `bench/bench_floor.py`)."""
    from tempering.losses import NLLLoss

    device = worker.state.topo.device
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        worker.train(batch, NLLLoss(), global_batch_size=batch.size)
        _sync(device)
        times.append(time.perf_counter() - start)
    tokens = int(batch["input_lengths"].sum())
    seconds = statistics.median(times)
    flops = 6 * ref["matmul_params"] * tokens
    mfu = flops / seconds / peak
    return {
        "tokens_per_step": tokens,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "model_tflops_per_s": flops / seconds / 1e12,
        "peak_bf16_tflops_per_s": peak / 1e12,
        "mfu": mfu,
        # MFU over 100% is a miscounted step or peak on a GPU; a CPU's bf16 rate at one square
        # shape is no peak (oneDNN picks other kernels per shape: 101-154% measured on the
        # dry run's tiny shapes), so there the figure only has to be a rate
        "passed": math.isfinite(mfu) and 0 < mfu and (mfu <= 1.0 or device.type == "cpu"),
    }


def planner(path: str, batch: Any, device: torch.device, baseline: int = 0) -> dict[str, Any]:
    """`placement.make_plan`'s memory estimate (via `shapes.plan_for`) of an SFT run with this
    model and micro-batch, against what the step took: on cuda `max_memory_allocated` (a ratio
    < 1 means the plan under-estimates: a failure), less the `baseline` bytes allocated before the
    worker was built; on cpu the process's peak RSS (VmHWM),
    which also holds the interpreter and libraries, so the ratio is informational there."""
    from tempering.config import SFTMasterConfig, load_config
    from tempering.models.shapes import plan_for

    rows, length = batch["input_ids"].shape
    cuda = device.type == "cuda"
    cfg, _ = load_config(REPO / "examples/configs/sft.yaml", [
        f"policy.model_name={path}", f"policy.train_global_batch_size={rows}",
        f"policy.train_micro_batch_size={rows}", f"policy.max_total_sequence_length={length}",
        "policy.precision=bfloat16", f"cluster.gpus_per_node={1 if cuda else 0}",
        f"sft.val_global_batch_size={rows}", f"sft.val_micro_batch_size={rows}",
    ], schema=SFTMasterConfig)  # fmt: skip
    plan = plan_for(cfg)
    estimate = plan.memory.train_gib
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - baseline
        measured, how = peak / 2**30, "torch.cuda.max_memory_allocated (less what was there before)"
    else:
        measured, how = _peak_rss_gib(), "peak RSS (VmHWM, whole process)"
    ratio = estimate / measured
    return {
        "estimate_gib": estimate,
        "estimate_parts_gib": plan.memory.parts,
        "measured_gib": measured,
        "measured_by": how,
        "ratio": ratio,
        "gated": cuda,
        "passed": ratio >= 1.0 if cuda else math.isfinite(ratio) and ratio > 0,
    }


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError("gpu_check: /proc/self/status has no VmHWM line (not Linux?)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
