"""Generation throughput: the vLLM worker vs the torch-native engine, same model, same prompts.

Builds a tiny random Llama (hidden 128, 2 heads of head_dim 64, 2 layers; vLLM's CPU attention
has no head size 16) unless --model is given, then samples --batch prompts x --new-tokens
tokens with each engine and prints generated tokens/s and the vLLM/torch ratio. The torch
engine runs in this process (the main venv); vLLM runs in a child process in the vLLM extra's
own venv (built on first use by tempering.distributed.actor_environments), exactly where a
worker group would run it. Each engine gets one untimed warm-up call (vLLM compiles its
log-prob ranking op on the first request), then the median of --repeats timed calls.

The memory-bandwidth floor (torch engine): a decode step must read every weight once (in the
sampling dtype) and each live row's KV cache, so no decode step can be faster than those bytes
over the machine's streaming read bandwidth, measured in the same process (a sum over a 1 GiB
buffer, the engine's thread count). Hooks on the model count each decode forward's live rows
and cache length; the decode phase is timed from the end of the prefill forward to the end of
the call (sampling included). Printed: decode ms per step against the floor's, and the ratio.

What bounds a step is measured in the same process too: the model's linear layers alone (every
one back to back, as the engine runs them -- packed for oneDNN where it packs them -- on the
decode steps' mean live rows), their FLOPs against this machine's matmul peak in the sampling
dtype (a 1024^3 matmul), and what is left of a step for attention, small ops and sampling.

    uv run --frozen python bench/bench_generation.py                  # 128 x 16, fp32
    uv run --frozen python bench/bench_generation.py --batch 32 --dtype bfloat16
    uv run --frozen python bench/bench_generation.py --model smollm2-135m-instruct \
        --batch 16 --group 4 --new-tokens 128 --prompt-len 200    # the SmolLM2 GRPO step's shape
    uv run --frozen python bench/bench_generation.py --model tiny-arith --batch 256 \
        --group 8 --new-tokens 16 --prompt-len 24 --engines torch  # the main job's shape, floor only

A benchmark prints ratios; it never passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FQN = "tempering.models.generation.vllm_worker.VllmGenerationWorker"


def make_prompts(
    vocab: int, batch: int, max_len: int, seed: int = 0, group: int = 1
) -> dict[str, torch.Tensor]:
    """Right-padded random prompts of lengths in [max_len // 2, max_len] (no special tokens),
    each repeated ``group`` times in a row (a GRPO group; ``batch`` counts the rows)."""
    if batch % group:
        raise SystemExit(f"--batch {batch} is not a multiple of --group {group}")
    data = _random_prompts(vocab, batch // group, max_len, seed)
    return {k: v.repeat_interleave(group, dim=0) for k, v in data.items()}


def _random_prompts(vocab: int, batch: int, max_len: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (batch,), generator=gen)
    input_ids = torch.full((batch, max_len), 2, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        input_ids[b, :n] = torch.randint(3, vocab, (n,), generator=gen)
    return {"input_ids": input_ids, "input_lengths": lengths}


def time_engine(engine, data, repeats: int) -> dict[str, float]:
    """One untimed warm-up call, then the median tokens/s over `repeats` calls."""
    engine.generate(data)
    rates, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(data)
        elapsed = time.perf_counter() - start
        n = int(out["generation_lengths"].sum())
        rates.append(n / elapsed)
        tokens.append(n)
    return {"tokens_per_s": statistics.median(rates), "generated_tokens": statistics.median(tokens)}


def matmul_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 7) -> float:
    """This machine's matmul rate in FLOP/s at torch's current thread count: the median of
    ``repeats`` n x n x n products in ``dtype`` (the compute roof a decode step's linears sit
    under)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def time_linears(model: torch.nn.Module, rows: int, repeats: int = 5) -> dict[str, float]:
    """The model's linear layers alone at a decode step's shape: every `nn.Linear` and
    `PackedLinear` in module order, each on ``rows`` rows, back to back (so their weights
    stream from memory as in a step; layers of one input width share one input tensor, so
    fused siblings run as one product, as in the engine); the median seconds of ``repeats``
    passes, and the FLOPs of one pass."""
    from tempering.models.generation.cpu_inference import PackedLinear

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    dtype = linears[0].weight.dtype
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in linears}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass is a warm-up
            start = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features])
            times.append(time.perf_counter() - start)
    flops = sum(2 * rows * m.in_features * m.out_features for m in linears)
    return {"seconds": statistics.median(times[1:]), "flops": flops, "layers": len(linears)}


def read_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """Streaming read bandwidth of this machine in bytes/s: the median of ``repeats`` sums over
    a buffer far larger than the caches, on torch's current thread count."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * buf.element_size() / statistics.median(times)


class DecodeMeter:
    """Counts the bytes each decode forward of a torch engine must read, and times its decode
    phase (see the module docstring). Wraps ``engine.generate``; hooks ``engine.model``."""

    def __init__(self, engine) -> None:
        model = engine.model
        cfg = model.config
        params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
        embed = model.get_input_embeddings().weight
        tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        # The input embedding is read a row per token, not whole (unless it is the lm_head too).
        self.weight_bytes = sum(p.numel() * p.element_size() for p in params) - (
            0 if tied else embed.numel() * embed.element_size()
        )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_bytes_per_token = (
            2 * cfg.num_hidden_layers * kv_heads * head_dim * embed.element_size()
        )
        self.calls: list[dict[str, float]] = []
        model.register_forward_hook(self._after_forward, with_kwargs=True)
        generate = engine.generate

        def timed_generate(*args, **kwargs):
            self.calls.append({"steps": 0, "rows": 0, "bytes": 0.0, "prefill_end": None})
            out = generate(*args, **kwargs)
            self.calls[-1]["end"] = time.perf_counter()
            return out

        engine.generate = timed_generate

    def _after_forward(self, module, args, kwargs, output) -> None:
        call = self.calls[-1]
        if call["prefill_end"] is None:  # the call's first forward is its prefill
            call["prefill_end"] = time.perf_counter()
            return
        cached = int(kwargs["attention_mask"].sum())  # live rows' real tokens, the new one too
        call["steps"] += 1
        call["rows"] += kwargs["attention_mask"].shape[0]
        call["bytes"] += self.weight_bytes + cached * self.kv_bytes_per_token
        call["kv_bytes"] = call.get("kv_bytes", 0.0) + cached * self.kv_bytes_per_token

    def summary(self, bandwidth: float) -> dict[str, float]:
        """Decode s/step (median over calls), the floor's s/step, and their ratio."""
        timed = [c for c in self.calls[1:] if c["steps"]]  # the first call is the warm-up
        per_step = statistics.median((c["end"] - c["prefill_end"]) / c["steps"] for c in timed)
        floor = statistics.median(c["bytes"] / c["steps"] / bandwidth for c in timed)
        return {
            "decode_ms_per_step": 1e3 * per_step,
            "floor_ms_per_step": 1e3 * floor,
            "floor_ratio": per_step / floor,
            "bandwidth_gb_s": bandwidth / 1e9,
            "weight_mb": self.weight_bytes / 1e6,
            "kv_mb": statistics.median(c["kv_bytes"] / c["steps"] for c in timed) / 1e6,
            "mean_rows": sum(c["rows"] for c in timed) / sum(c["steps"] for c in timed),
        }


def bounds(model: torch.nn.Module, decode: dict[str, float]) -> dict[str, float]:
    """What bounds a decode step (see the module docstring), from ``decode`` (a
    `DecodeMeter.summary`): the linears alone at the steps' mean live rows and the matmul peak
    in the model's dtype, measured now."""
    rows = max(1, round(decode["mean_rows"]))
    linears = time_linears(model, rows)
    peak = matmul_peak(next(model.parameters()).dtype)
    return {
        "linear_rows": rows,
        "linear_layers": linears["layers"],
        "linears_ms": 1e3 * linears["seconds"],
        "linears_floor_ratio": 1e3 * linears["seconds"] / decode["floor_ms_per_step"],
        "linear_gflop_s": linears["flops"] / linears["seconds"] / 1e9,
        "peak_gflop_s": peak / 1e9,
        "compute_floor_ms": 1e3 * linears["flops"] / peak,
        "rest_ms": decode["decode_ms_per_step"] - 1e3 * linears["seconds"],
    }


def run_engine(args: argparse.Namespace) -> dict[str, float]:
    """Build one engine on args.model and time it (runs in the engine's own venv)."""
    from tempering.distributed.batched_data_dict import BatchedDataDict

    sampling = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "seed": 0}
    start = time.perf_counter()
    if args.engine == "vllm":
        from tempering.models.generation.vllm_worker import VllmGenerationWorker

        engine = VllmGenerationWorker(
            args.model,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=args.prompt_len + args.new_tokens,
            kv_cache_memory_bytes=512 * 2**20,
            **sampling,
        )
        vocab = len(engine.llm.get_tokenizer())
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tempering.models.generation.cpu_inference import optimize_for_cpu_inference
        from tempering.models.generation.torch_engine import TorchGenerationEngine

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
        set_up = optimize_for_cpu_inference(model.eval())  # as the generation workers do
        engine = TorchGenerationEngine(model, tokenizer, **sampling)
        vocab = len(tokenizer)
        meter = DecodeMeter(engine)
    startup_s = time.perf_counter() - start
    data = BatchedDataDict(make_prompts(vocab, args.batch, args.prompt_len, group=args.group))
    result = time_engine(engine, data, args.repeats)
    result["startup_s"] = startup_s
    if args.engine == "torch":
        result.update(meter.summary(read_bandwidth()))
        result.update(bounds(engine.model, result))
        result["set_up"] = set_up
    if args.engine == "vllm":
        engine.shutdown()
    return result


def vllm_python() -> str:
    from tempering.distributed.actor_environments import get_actor_executable, resolve_python

    return resolve_python(FQN, get_actor_executable(FQN))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (tokens)")
    parser.add_argument("--group", type=int, default=1, help="rows per distinct prompt (GRPO)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model",
        help="HF model folder or a registry name such as tiny-arith (default: a tiny random Llama)",
    )
    parser.add_argument("--engines", default="torch,vllm", help="which engines to time")
    parser.add_argument("--engine", choices=["vllm", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.engine:  # child mode: time one engine, print one JSON line
        print("RESULT " + json.dumps(run_engine(args)), flush=True)
        os._exit(0)  # skip vLLM's slow interpreter teardown

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from tests.tiny_models import save_tokenized_llama  # the checkout is on sys.path

            args.model = str(Path(tmp) / "tiny-llama")
            save_tokenized_llama(Path(args.model))
        else:  # a registry name (what `policy.model_name` takes) or a folder
            from tempering.models.registry import resolve_model_path

            args.model = str(resolve_model_path(args.model))
        common = [
            "--model", args.model, "--batch", str(args.batch), "--new-tokens",
            str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--dtype", args.dtype,
            "--repeats", str(args.repeats), "--group", str(args.group),
        ]  # fmt: skip
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}
        env.pop("VIRTUAL_ENV", None)
        results = {}
        for engine in args.engines.split(","):
            python = sys.executable if engine == "torch" else vllm_python()
            proc = subprocess.run(
                [python, __file__, "--engine", engine, *common],
                env=env,
                capture_output=True,
                text=True,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{engine} engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            results[engine] = json.loads(lines[-1].removeprefix("RESULT "))

    print(
        f"generation, {args.batch} prompts (<= {args.prompt_len} tokens, {args.group} rows per "
        f"distinct prompt) x {args.new_tokens} "
        f"new tokens, {args.dtype}, CPU threads 2"
    )
    for engine, r in results.items():
        print(
            f"  {engine:5s}: {r['tokens_per_s']:9.1f} generated tokens/s "
            f"({r['generated_tokens']:.0f} tokens/call, engine start {r['startup_s']:.1f} s)"
        )
        if "floor_ratio" in r:
            print(
                f"         decode {r['decode_ms_per_step']:.2f} ms/step against the bandwidth "
                f"floor's {r['floor_ms_per_step']:.2f} ({r['weight_mb']:.1f} MB of weights + "
                f"{r['kv_mb']:.1f} MB of KV at {r['bandwidth_gb_s']:.1f} GB/s read): {r['floor_ratio']:.2f}x the floor"
            )
            print(
                f"         of which the {r['linear_layers']} linear layers alone (back to back at "
                f"{r['linear_rows']} rows, as the engine runs them): {r['linears_ms']:.2f} ms = "
                f"{r['linears_floor_ratio']:.2f}x the floor, at {r['linear_gflop_s']:.0f} GFLOP/s "
                f"of this machine's {r['peak_gflop_s']:.0f} ({args.dtype} matmul peak; their "
                f"FLOPs at that peak: {r['compute_floor_ms']:.2f} ms); the rest (attention, "
                f"small ops, sampling): {r['rest_ms']:.2f} ms"
            )
            print(f"         CPU inference set-up: {r['set_up']}")
    if {"vllm", "torch"} <= results.keys():
        ratio = results["vllm"]["tokens_per_s"] / results["torch"]["tokens_per_s"]
        print(f"  ratio vllm/torch: {ratio:.2f}x")


if __name__ == "__main__":
    main()
