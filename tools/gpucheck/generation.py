"""The torch generation engine inside the policy worker (`ColocatedGenerationView`, the one
colocated GRPO uses): decode tokens/s at the GRPO shape, the sampler's log-probs against the
trainer's (``train/token_mult_prob_error`` as `losses.ClippedPGLoss` computes it in every
GRPO step), and refit (trainer state -> engine) in seconds per GB."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

# exp(|log p_trainer - log p_sampler|) averaged over generated tokens: 1.0 is exact agreement.
# Both sides are bf16 (the trainer's FSDP2 compute, the engine's copy); measured on CPU with
# the tiny shapes: ~1.003-1.01. A refit that left the engine on other weights reads far above.
TOKEN_MULT_PROB_ERROR_MAX = 1.05


def grpo_shape(quick: bool) -> dict[str, int]:
    """Rows, prompt length and new tokens of a step of examples/configs/grpo_math_tiny.yaml
    (its prompts x generations; --quick: 4 prompts)."""
    from tempering.config import GRPOMasterConfig, load_config
    from tempering.models.registry import REPO_ROOT as ROOT

    config = ROOT / "examples/configs/grpo_math_tiny.yaml"
    cfg, _ = load_config(config, [], schema=GRPOMasterConfig)
    prompts = 4 if quick else cfg.grpo.num_prompts_per_step
    new_tokens = cfg.policy.generation.max_new_tokens
    return {
        "rows": prompts * cfg.grpo.num_generations_per_prompt,
        "prompt_len": cfg.policy.max_total_sequence_length - new_tokens,
        "max_new_tokens": new_tokens,
    }


def prompts(rows: int, prompt_len: int, vocab: int, group: int, seed: int) -> Any:
    """Random prompts, each repeated `group` times (a GRPO group shares its prompt)."""
    from tempering.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows // group, prompt_len), generator=g)
    ids = ids.repeat_interleave(group, 0)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.full((rows,), prompt_len))


def decode(worker: Any, vocab: int, shape: dict[str, int], device: torch.device) -> tuple:
    """Build the worker's engine (bf16) and time one GRPO-shaped generate call (after a
    warm-up call); returns (the section's results, the generated batch)."""
    sampling = {"max_new_tokens": shape["max_new_tokens"], "temperature": 1.0, "seed": 0}
    worker.generation.init(sampling, dtype="bfloat16")
    data = prompts(shape["rows"], shape["prompt_len"], vocab, 8, seed=1)
    worker.generation.generate(data)  # warm-up (kernels, allocator)
    _sync(device)
    start = time.perf_counter()
    out = worker.generation.generate(data)
    _sync(device)
    seconds = time.perf_counter() - start
    generated = int(out["generation_lengths"].sum())
    return {
        **shape,
        "generated_tokens": generated,
        "generate_s": seconds,
        "decode_tokens_per_s": generated / seconds,
        "passed": generated > 0 and math.isfinite(seconds),
    }, out


def logprob_mismatch(worker: Any, out: Any) -> dict[str, Any]:
    """The trainer's log-probs of the generated tokens against the sampler's: the batch as a
    GRPO step hands it to `ClippedPGLoss` (zero advantages, eval mode: no update), whose
    ``token_mult_prob_error`` is the figure the loops log as train/token_mult_prob_error."""
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.losses import ClippedPGLoss

    ids, lengths = out["output_ids"], out["unpadded_sequence_lengths"]
    cols = torch.arange(ids.shape[1])[None, :]
    start = (lengths - out["generation_lengths"])[:, None]
    token_mask = ((cols >= start) & (cols < lengths[:, None])).float()  # generated tokens
    batch = BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask,
        sample_mask=torch.ones(ids.shape[0]), generation_logprobs=out["logprobs"],
        advantages=torch.zeros(ids.shape[0]),
    )  # fmt: skip
    metrics = worker.train(batch, ClippedPGLoss(), global_batch_size=batch.size, eval_mode=True)
    err = metrics["token_mult_prob_error"]
    return {
        "token_mult_prob_error": err,
        "gen_kl_error": metrics["gen_kl_error"],
        "max_allowed": TOKEN_MULT_PROB_ERROR_MAX,
        "passed": math.isfinite(err) and err <= TOKEN_MULT_PROB_ERROR_MAX,
    }


def refit(worker: Any, repeats: int) -> dict[str, Any]:
    """`generation.refit()` (the trainer's full weights into the engine's bf16 copy), timed;
    then every engine tensor must equal `refit.cast_for_sampling` of the trainer's fp32 one
    exactly (the cast's draw is fixed per tensor name): a stale or skipped tensor differs in
    the elements the training steps moved across a bf16 rounding threshold."""
    from tempering.models.generation.refit import cast_for_sampling

    device = worker.state.topo.device
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        worker.generation.refit()
        _sync(device)
        times.append(time.perf_counter() - start)
    trainer = worker.refit.state_dict()  # full fp32 tensors by HF name (CPU)
    engine = worker.generation._engine.model.state_dict()  # the engine's own copy
    names: dict[int, list[str]] = {}  # engine storage -> its names (tied weights share one)
    for name in trainer:
        names.setdefault(engine[name].data_ptr(), []).append(name)
    mismatched = []
    for group in names.values():
        got = engine[group[0]]
        # cast where refit casts (on the device: a CUDA generator draws other numbers than a
        # CPU one); a tied weight holds the cast under whichever of its names was loaded last
        casts = (cast_for_sampling(trainer[n].to(device), got.dtype, n) for n in group)
        if not any(torch.equal(got, expected) for expected in casts):
            mismatched.append(group[0])
    gb = sum(engine[group[0]].numel() * engine[group[0]].element_size()
             for group in names.values()) / 1e9  # fmt: skip
    seconds = statistics.median(times)
    return {
        "gb": gb,
        "refit_s": seconds,
        "s_per_gb": seconds / gb,
        "tensors": len(names),
        "tensors_not_as_refit_casts": len(mismatched),
        "first_mismatched": mismatched[:3],
        "passed": not mismatched and math.isfinite(seconds),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
