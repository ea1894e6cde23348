"""How close is tempering to what this machine can do? Its step against a plain-torch floor.

For each algorithm (SFT, DPO, GRPO) and scale (tiny-arith; SmolLM2-135M), in one run:

  (a) the machine's sustained fp32 matmul rate (torch.mm, the same threads as the workers);
  (b) the floor: the same step's math in this one process, plain torch -- an HF model, a
      masked NLL / DPO / policy-gradient loss, backward, gradient clipping, AdamW (fused),
      HF `generate` for GRPO's sampling -- no Ray, no FSDP2, no data plumbing, batches built
      beforehand;
  (c) tempering's step: the real code path (a one-worker FSDP2 policy in a Ray actor; for
      GRPO `grpo.grpo_step` of the example config: rollouts, rewards, reference log-probs,
      train, refit).

It prints, as medians of --repeats timed steps after --warmup untimed ones (with min-max),
the floor's and tempering's seconds per step, the overhead (tempering / floor) and the training phase's
model FLOP utilisation (6 x matmul parameters x trained tokens / train seconds / matmul rate).
GRPO's sampled lengths differ between the two sides, so its floor is scaled to tempering's
token counts (floor seconds per generated token x tempering's generated tokens, and the same
for trained tokens). For SFT and DPO the floor's steps are timed half before and half after
tempering's (the floor's model stays loaded), so a drift of this machine's speed during the
run (±15% within minutes here) weighs on both sides alike.

    uv run --frozen python bench/bench_floor.py                        # tiny, all three
    uv run --frozen python bench/bench_floor.py --scale smollm2 --algos sft dpo grpo

A benchmark prints figures; it never passes or fails.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tempering import OPENMP_USER_SET  # noqa: E402  (no torch yet)
from tempering.utils.threads import GOVERNED_SPINCOUNT  # noqa: E402

# The floor is plain torch as a user runs it: libgomp's own OpenMP spin (which tempering's CPU
# policy workers run too), not the short one importing tempering gives this process. Set
# before torch loads; a value of yours is kept.
if "GOMP_SPINCOUNT" not in OPENMP_USER_SET:
    os.environ["GOMP_SPINCOUNT"] = GOVERNED_SPINCOUNT

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
THREADS = 2
SCALES = {  # per scale: model, SFT rows x max length, DPO pairs, GRPO config and overrides
    "tiny": {
        "model": "tiny-arith",
        "sft": (64, 32),
        "dpo": (32, 32),
        "grpo_config": "grpo_math_tiny.yaml",
        "grpo": [
            "grpo.num_prompts_per_step=16",
            "grpo.num_generations_per_prompt=8",
            "policy.train_global_batch_size=128",
            "policy.train_micro_batch_size=128",
        ],
        "lr": 1e-3,
        "repeats": 30,  # 60-ms steps: a median of 5 moved 1.2x -> 2.5x between runs
    },
    "smollm2": {
        "model": "smollm2-135m-instruct",
        "sft": (8, 256),
        "dpo": (4, 256),
        "grpo_config": "grpo_math_smollm2.yaml",
        "grpo": [],  # its own workload: 4 prompts x 4 samples, up to 128 tokens, KL on
        "lr": 1e-6,
        "repeats": 5,
    },
}


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def matmul_flops(n: int = 1024, reps: int = 20) -> float:
    """Sustained fp32 FLOP/s of an n x n matmul with THREADS threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but the input embedding (the lm_head counts,
    tied or not)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb) + emb.numel()


# ----------------------------------------------------------------------------- floors
def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, mask=None):
    """[B, S-1] log-probs of each next token (right-padded rows, or the given mask)."""
    if mask is None:
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:, None])[..., 0]


def floor_update(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def floor_model(path: str, lr: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # as tempering


# ----------------------------------------------------------------------------- SFT / DPO
def sft_batches(model: str, rows: int, max_len: int, count: int) -> list:
    from tempering.data.arithmetic import arithmetic_sft_message_logs
    from tempering.data.collate import collate_sft, pad_token_id_of
    from tempering.data.gsm8k import gsm8k_sft_message_logs
    from tempering.data.processing import tokenize_message_logs
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    logs = (
        arithmetic_sft_message_logs(rows * count).examples
        if model == "tiny-arith"
        else gsm8k_sft_message_logs("train").examples[: rows * count]
    )
    examples, _ = tokenize_message_logs(logs, tokenizer, max_len)
    pad = pad_token_id_of(tokenizer)
    return [collate_sft(examples[i : i + rows], pad) for i in range(0, rows * count, rows)]


def dpo_batches(model: str, pairs: int, max_len: int, count: int) -> list:
    from tempering.algorithms.preference import preference_batch
    from tempering.data.preference_datasets import (
        arithmetic_preference_pairs,
        gsm8k_preference_pairs,
    )
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(model))
    data = (
        arithmetic_preference_pairs(pairs * count).examples
        if model == "tiny-arith"
        else gsm8k_preference_pairs("train").examples[: pairs * count]
    )
    return [
        preference_batch(data[i : i + pairs], tokenizer, max_len)
        for i in range(0, pairs * count, pairs)
    ]


def masked_sum(logp: torch.Tensor, batch) -> torch.Tensor:
    return (logp * batch["token_mask"][:, 1:]).sum(-1)


def floor_sft(path: str, batches: list, lr: float):
    """The floor's SFT step (a closure over its own model and batches) and its parameters."""
    model, opt = floor_model(path, lr)
    it = itertools.cycle(batches)

    def step() -> None:
        b = next(it)
        logp = token_logprobs(model, b["input_ids"], b["input_lengths"])
        floor_update(model, opt, -masked_sum(logp, b).sum() / b["token_mask"][:, 1:].sum())

    return step, matmul_params(model)


def floor_dpo(path: str, batches: list, lr: float, beta: float = 0.1):
    """The floor's DPO step (policy and frozen reference) and its parameters."""
    model, opt = floor_model(path, lr)
    reference, _ = floor_model(path, lr)
    reference.requires_grad_(False)
    it = itertools.cycle(batches)

    def step() -> None:
        b = next(it)
        with torch.no_grad():
            ref = masked_sum(token_logprobs(reference, b["input_ids"], b["input_lengths"]), b)
        pol = masked_sum(token_logprobs(model, b["input_ids"], b["input_lengths"]), b)
        margin = (pol - ref).view(-1, 2)
        floor_update(model, opt, -F.logsigmoid(beta * (margin[:, 0] - margin[:, 1])).mean())

    return step, matmul_params(model)


def tempering_policy(path: str, rows: int, lr: float, reference: bool):
    from tempering.distributed.virtual_cluster import RayVirtualCluster
    from tempering.models.policy.lm_policy import build_policy

    cluster = RayVirtualCluster([1], num_cpus_per_bundle=1, name="bench-floor")
    policy = build_policy(
        cluster,
        path,
        train_global_batch_size=rows,
        train_micro_batch_size=rows,
        learning_rate=lr,
        init_reference_model=reference,
        num_threads=THREADS,
        seed=0,
    )
    return cluster, policy


def ours_sft(path: str, batches: list, lr: float, repeats: int, warmup: int) -> list[float]:
    from tempering.losses import NLLLoss

    cluster, policy = tempering_policy(path, batches[0].size, lr, reference=False)
    it = itertools.cycle(batches)
    try:
        return timed(lambda: policy.train(next(it), NLLLoss()), repeats, warmup)
    finally:
        policy.shutdown()
        cluster.shutdown()


def ours_dpo(path: str, batches: list, lr: float, repeats: int, warmup: int) -> list[float]:
    from tempering.algorithms.dpo import dpo_step
    from tempering.preference_losses import DPOLoss

    cluster, policy = tempering_policy(path, batches[0].size, lr, reference=True)
    it = itertools.cycle(batches)
    try:
        return timed(lambda: dpo_step(policy, next(it), DPOLoss(0.1)), repeats, warmup)
    finally:
        policy.shutdown()
        cluster.shutdown()


# ----------------------------------------------------------------------------- GRPO
def ours_grpo(scale: dict, repeats: int) -> tuple[dict, object]:
    """grpo_step of the example config; returns its timings and the run's set-up pieces the
    floor reuses (problems, prompt format, sampling)."""
    from tempering.algorithms import grpo
    from tempering.config import GRPOMasterConfig, load_config

    cfg, resolved = load_config(
        REPO / "examples/configs" / scale["grpo_config"],
        [
            *scale["grpo"],
            f"policy.num_threads={THREADS}",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
            "logger.log_dir=/tmp/tempering_bench_floor",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    records: list[dict] = []
    try:
        for _ in range(repeats + 1):
            m = grpo.grpo_step(run, grpo.make_loss(cfg))
            n = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
            m["gen_tokens"] = m["train/gen_length_mean"] * n
            m["trained_tokens"] = m["throughput/tokens_per_s"] * m["timing/step_s"]
            records.append(m)
        problems = run.train_problems[: cfg.grpo.num_prompts_per_step * (repeats + 1)]
    finally:
        run.close()
    return {"records": records[1:]}, (cfg, problems)


def floor_grpo(path: str, cfg, problems: list, repeats: int) -> dict:
    """Sample G completions per prompt with HF generate, group-normalised advantages from an
    exact-match reward, reference log-probs when the config has a KL term, one PG step."""
    from tempering.data.prompts import prompt_token_ids
    from tempering.models.hf import load_tokenizer

    tokenizer = load_tokenizer(path)
    model, opt = floor_model(path, cfg.policy.optimizer.kwargs.lr)
    kl = cfg.loss_fn.reference_policy_kl_penalty
    reference = floor_model(path, 0.0)[0].requires_grad_(False) if kl > 0 else None
    gen = cfg.policy.generation
    G, P = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records: list[dict] = []

    def step(chunk: list) -> dict:
        rec: dict = {}
        t0 = time.perf_counter()
        prompts = [
            prompt_token_ids(p.prompt, tokenizer, cfg.data.use_chat_template, p.system)
            for p in chunk
            for _ in range(G)
        ]
        width = max(map(len, prompts))  # left-padded for generate
        ids = torch.full((len(prompts), width), pad)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=gen.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=gen.max_new_tokens,
                pad_token_id=pad,
            )
        new = out[:, width:]
        done = (new == tokenizer.eos_token_id).cumsum(1)
        gen_mask = ((done == 0) | ((done == 1) & (new == tokenizer.eos_token_id))).float()
        rec["gen_s"] = time.perf_counter() - t0
        rec["gen_tokens"] = float(gen_mask.sum())
        texts = tokenizer.batch_decode(new * gen_mask.long(), skip_special_tokens=True)
        rewards = torch.tensor(
            [
                float(c.answer in t)
                for c, t in zip([c for c in chunk for _ in range(G)], texts, strict=True)
            ]
        ).view(P, G)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        adv = adv.flatten()
        full_mask = torch.cat([attn.float(), gen_mask], 1)
        seq, lengths, attention = out, None, full_mask.long()
        t1 = time.perf_counter()
        loss_mask = torch.cat([torch.zeros_like(attn.float()), gen_mask], 1)[:, 1:]
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = token_logprobs(reference, seq, lengths, attention)
        rec["ref_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        logp = token_logprobs(model, seq, lengths, attention)
        per_token = -adv[:, None] * torch.exp(logp - logp.detach())
        if ref is not None:
            per_token = per_token + kl * (torch.exp(ref - logp) - (ref - logp) - 1)
        floor_update(model, opt, (per_token * loss_mask).sum() / loss_mask.sum())
        rec["train_s"] = time.perf_counter() - t2
        rec["trained_tokens"] = float(full_mask.sum())
        rec["step_s"] = time.perf_counter() - t0
        return rec

    for r in range(repeats + 1):
        records.append(step(problems[r * P : (r + 1) * P]))
    return {"records": records[1:], "params": matmul_params(model)}


# ----------------------------------------------------------------------------- report
def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), nargs="+", default=["tiny"])
    parser.add_argument("--algos", nargs="+", default=["sft", "dpo", "grpo"])
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed steps (default: tiny 30, smollm2 5)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (SFT, DPO)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from tempering.distributed.virtual_cluster import init_ray
    from tempering.models.registry import resolve_model_path

    init_ray(num_cpus=4)
    rate = matmul_flops()
    print(f"fp32 matmul, {THREADS} threads: {rate / 1e9:.1f} GFLOP/s")
    for name in args.scale:
        scale = SCALES[name]
        repeats = args.repeats or scale["repeats"]
        path = str(resolve_model_path(scale["model"]))
        for algo in args.algos:
            if algo in ("sft", "dpo"):
                rows, max_len = scale[algo]
                make = sft_batches if algo == "sft" else dpo_batches
                batches = make(scale["model"], rows, max_len, repeats + args.warmup)
                floor_step, params = (floor_sft if algo == "sft" else floor_dpo)(
                    path, batches, scale["lr"]
                )
                before = repeats // 2  # the floor brackets tempering's steps
                floor = timed(floor_step, before, args.warmup) if before else []
                ours = (ours_sft if algo == "sft" else ours_dpo)(
                    path, batches, scale["lr"], repeats, args.warmup
                )
                floor += timed(floor_step, repeats - before, warmup=1)
                tokens = statistics.median(float(b["input_lengths"].sum()) for b in batches)
                passes = 6 if algo == "sft" else 8  # DPO adds the reference forward (2N)
                mfu = passes * params * tokens / statistics.median(ours) / rate
                print(
                    f"{name:8} {algo:5} floor {spread(floor)} s  tempering "
                    f"{spread(ours)} s  overhead "
                    f"{statistics.median(ours) / statistics.median(floor):.2f}x  "
                    f"MFU {100 * mfu:.1f}% ({tokens:.0f} tokens/step)"
                )
            else:
                ours, (cfg, problems) = ours_grpo(scale, repeats)
                floor = floor_grpo(path, cfg, problems, repeats)
                report_grpo(name, ours["records"], floor, rate)


def report_grpo(name: str, ours: list[dict], floor: dict, rate: float) -> None:
    med = statistics.median
    f = floor["records"]
    per_gen = med(r["gen_s"] / r["gen_tokens"] for r in f)
    per_train = med((r["train_s"] + r["ref_s"]) / r["trained_tokens"] for r in f)
    scaled = [r["gen_tokens"] * per_gen + r["trained_tokens"] * per_train for r in ours]
    steps = [r["timing/step_s"] for r in ours]
    overhead = med(s / fl for s, fl in zip(steps, scaled, strict=True))
    train_tokens = med(r["trained_tokens"] for r in ours)
    mfu = 6 * floor["params"] * train_tokens / med(r["timing/train_s"] for r in ours) / rate
    print(
        f"{name:8} grpo  floor {spread([r['step_s'] for r in f])} s  tempering "
        f"{spread(steps)} s  overhead {overhead:.2f}x (floor scaled to tempering's tokens)  "
        f"train MFU {100 * mfu:.1f}%"
    )
    print(
        f"{'':14} phases, tempering: "
        + "  ".join(
            f"{k.split('/')[1]} {med(r.get(k, 0.0) for r in ours):.3f}"
            for k in (
                "timing/generation_s",
                "timing/logprobs_s",
                "timing/train_s",
                "timing/refit_s",
            )  # fmt: skip
        )
        + f"  | floor: gen {med(r['gen_s'] for r in f):.3f} ref {med(r['ref_s'] for r in f):.3f}"
        f" train {med(r['train_s'] for r in f):.3f}; generated tokens/step tempering "
        f"{med(r['gen_tokens'] for r in ours):.0f}, floor {med(r['gen_tokens'] for r in f):.0f}"
    )


if __name__ == "__main__":
    main()
