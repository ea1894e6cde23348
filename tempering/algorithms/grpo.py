"""Group Relative Policy Optimisation (GRPO), the project's main job.

    uv run examples/run_grpo_math.py [--config FILE] [dotted.key=value ...]

One step (DESIGN.md "One GRPO step"):
  1. a batch of prompts, each repeated `num_generations_per_prompt` times
  2. generation (torch engine colocated in the policy workers, or vLLM workers) -> tokens,
     sampling log-probs
  3. environments score the completions (routed by task name) -> rewards
  4. advantages: leave-one-out baseline per group, optional std normalisation; optional
     dynamic sampling (drop zero-variance groups and refill) and overlong filtering
  5. behaviour log-probs from the trainer when a rollout batch spans several optimizer steps
     (one step is on-policy: the train forward supplies them)
  6. policy.train(ClippedPGLoss), normalised by the global count of valid tokens; with KL on,
     the workers compute each micro-batch's reference log-probs just before its forward
  7. refit: the generator sees the new weights (colocated: in place in the workers)
  8. log, validate every `val_period` steps, checkpoint atomically
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tempering.algorithms import common, grpo_blend, ppo_critic
from tempering.algorithms import grpo_scoring as scoring
from tempering.algorithms.dynamic_sampling import DynamicSampler, mask_overlong_samples
from tempering.algorithms.grpo_learning import learn_from, samples_per_step
from tempering.algorithms.reward_shaping import shape_rewards, shaping_metrics
from tempering.algorithms.signal_watch import SignalWatch, step_signal
from tempering.config.schemas import GRPOMasterConfig
from tempering.data.grpo_problems import Problem, load_problems, reasoning_gym_problems  # noqa: F401
from tempering.data.records import data_source
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.utils import faults
from tempering.utils.timers import Timer

EXTERNAL = "external_harness"  # the run's ExternalHarness among its environments
log = logging.getLogger(__name__)


# -------------------------------------------------------------------------- setup
@dataclass
class GRPORun:
    cfg: GRPOMasterConfig
    resolved: dict[str, Any]
    tokenizer: Any
    train_problems: list[Problem]
    val_problems: list[Problem]
    dataloader: Any
    policy: Any
    cluster: Any
    generation: Any
    environments: dict[str, Any]
    logger: Any
    checkpointer: Any
    start_step: int
    chat: Any  # ChatCompletionService: prompts, batching, refit lock
    turns: Any  # TurnClient: in-process or over HTTP
    server: Any = None  # OpenAIServer when policy.generation.http_server.enabled
    prior_wall_time_s: float = 0.0  # training time of the runs this one resumed
    history: list[dict[str, float]] = field(default_factory=list)
    monitor: Any = None  # per-role resource metrics (logger.monitor_gpus)
    signal: SignalWatch = field(default_factory=SignalWatch)  # warns of no-signal steps
    correct_above: float | None = 0.5  # a correct answer's reward (`scoring.reward_threshold`)
    critic: Any = None  # PPO's value model (`critic.enabled`, ppo_critic.py)

    def close(self) -> None:
        """Free what the run started: server, logger, generation, environments, policy
        workers, placement groups."""
        import ray

        actors = []
        for env in {id(e): e for e in self.environments.values()}.values():
            shutdown = env.shutdown  # NeMo Gym first: its agents call the server
            if hasattr(shutdown, "remote"):
                actors.append((env, shutdown.remote()))
            else:
                shutdown()
        for actor, done in actors:  # each frees its own processes, then the actor goes
            try:
                ray.get(done, timeout=30)
            except Exception as exc:  # already dead, or hung: it is killed either way
                log.warning("environment actor shutdown: %s", str(exc).splitlines()[0])
            ray.kill(actor, no_restart=True)
        if self.server is not None:
            self.server.stop()
        self.logger.close()
        self.generation.shutdown()
        if self.critic is not None:
            self.critic.shutdown()
        self.policy.shutdown()
        self.cluster.shutdown()


def _problems(cfg: GRPOMasterConfig, tokenizer: Any) -> tuple[list[Problem], list[Problem]]:
    """The training and validation problems, each with the environment that scores it (a
    custom reward's module and a needed chat template checked, before any worker starts)."""
    from tempering.environments.reward_fn import check_reward_fn

    check_reward_fn(cfg.env.reward_fn)
    if cfg.data.blend:  # several datasets, each with its environment (grpo_blend.py)
        train_problems, val_problems = grpo_blend.blend_problems(cfg)
    else:
        train_problems, val_problems = load_problems(cfg.data, cfg.env.nemo_gym.default_route)
    if cfg.env.task_name:  # one environment scores every problem
        for p in train_problems + val_problems:
            p.task_name = cfg.env.task_name
    _check_chat_template(cfg, tokenizer, {p.task_name for p in train_problems + val_problems})
    scoring.check_gym_hosts(cfg, train_problems, val_problems)  # before Ray: every row hosted
    if len(val_problems) > cfg.grpo.max_val_samples:
        log.warning(
            "grpo.max_val_samples=%d: each validation reads the first %d of the %d held-out "
            "problems; raise it (or lower data.num_val_samples) to read them all",
            cfg.grpo.max_val_samples, cfg.grpo.max_val_samples, len(val_problems),
        )  # fmt: skip
    return train_problems, val_problems


def _loader(cfg: GRPOMasterConfig, train_problems: list[Problem]) -> Any:
    """The resumable loader of each step's prompts (a set too small for one step is named)."""
    from tempering.data.dataloader import StatefulDataLoader

    if cfg.data.blend:  # each prompt's entry drawn by weight, seeded and resumable
        return grpo_blend.blend_loader(cfg, train_problems)
    where = data_source(cfg.data.train_data_path, cfg.data.dataset_name)
    return StatefulDataLoader(
        train_problems, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed,
        batch_key="grpo.num_prompts_per_step", source=f"the training problems ({where})",
    )  # fmt: skip


def _check_chat_template(cfg: GRPOMasterConfig, tokenizer: Any, tasks: set[str]) -> None:
    """What in a GRPO run renders chat messages, for `common.check_chat_template`."""
    from tempering.environments.registry import offered_tools

    chat_tasks = sorted(t for t in tasks if t == "nemo_gym" or offered_tools(t))
    needs = [
        why for why, need in (
            ("policy.generation.http_server.enabled=true (clients send messages)",
             cfg.policy.generation.http_server.enabled),
            (f"grpo.max_rollout_turns={cfg.grpo.max_rollout_turns} (later turns are messages)",
             cfg.grpo.max_rollout_turns > 1),
            (f"the tasks {chat_tasks} (messages, tools)", bool(chat_tasks)),
        ) if need
    ]  # fmt: skip
    common.check_chat_template(tokenizer, cfg, needs)


def setup(cfg: GRPOMasterConfig, resolved: dict[str, Any], plan: Any = None) -> GRPORun:
    """Everything a GRPO run needs, started; ``plan``: the placement plan when the caller made
    it (distillation's, which adds the teacher), else made here."""
    from tempering.models.generation.builders import (
        build_chat_service,
        build_generation,
        needs_policy_workers,
        start_generation,
        start_http_server,
    )
    from tempering.models.registry import resolve_model_path

    common.prepare_run(cfg.deadlines, cfg.logger.log_dir)
    plan = plan or common.plan_run(cfg)
    common.check_resumable(cfg.checkpointing, resolved)
    model_path = resolve_model_path(cfg.policy.model_name)
    tokenizer = common.load_run_tokenizer(cfg.policy)
    train_problems, val_problems = _problems(cfg, tokenizer)
    dataloader = _loader(cfg, train_problems)
    tasks = {p.task_name for p in train_problems + val_problems}
    external = cfg.grpo.rollout_transport == "external"  # the harness reports the rewards
    threshold = scoring.reward_threshold(cfg, tasks)
    if external:  # the harness's rewards mean what it says
        threshold = cfg.grpo.external_harness.correct_above
    common.start_ray(cfg.cluster)  # the inputs are good: now the workers
    environments = {} if external else scoring.build_environments(cfg, tasks)
    cluster = common.build_cluster(plan.policy, cfg.cluster, "grpo")
    _warn_uncorrected_precision(cfg)
    trainers = functools.partial(_start_trainers, cfg, cluster, plan)
    generator = functools.partial(
        build_generation, cfg.policy, model_path=model_path, tokenizer=tokenizer, plan=plan,
        cluster_cfg=cfg.cluster,
        in_flight_weight_updates=cfg.grpo.async_grpo.in_flight_weight_updates,
    )  # fmt: skip
    if needs_policy_workers(cfg.policy, plan):
        policy, critic = trainers()
        generation = generator(policy)
    else:  # on workers of their own, started while the policy's start
        (policy, critic), generation = common.build_beside(trainers, lambda: generator(None))
    chat = build_chat_service(
        cfg.policy.generation, generation, tokenizer, cfg.policy.max_total_sequence_length
    )
    server = start_http_server(cfg.policy.generation, chat, cfg.logger.log_dir)
    if "nemo_gym" in tasks:
        environments["nemo_gym"] = scoring.build_gym(cfg, server, tokenizer)
    if external:  # among the environments: its counters are logged, it is shut down
        from tempering.experience.external import build_external_harness

        pad = tokenizer.pad_token_id or 0
        environments[EXTERNAL] = build_external_harness(cfg, server, chat, pad)
    turns = _turn_client(cfg, chat, server, tokenizer, train_problems[0].prompt)
    checkpointer = common.build_checkpointer(scoring.checkpoint_ranking(cfg, threshold))
    start_step, info = common.maybe_resume(checkpointer, policy, dataloader, resolved)
    ppo_critic.resume(critic, checkpointer, start_step)
    start_generation(chat, generation, policy, start_step)
    logger = common.build_logger(cfg.logger, resolved, start_step)
    return GRPORun(
        cfg,
        resolved,
        tokenizer,
        train_problems,
        val_problems,
        dataloader,
        policy,
        cluster,
        generation,
        environments,
        logger,
        checkpointer,
        start_step,
        chat,
        turns,
        server,
        prior_wall_time_s=float(info.get("wall_time_s", 0.0)),
        correct_above=threshold,
        critic=critic,
        monitor=common.build_resource_monitor(
            cfg.logger, policy=policy, generation=generation, environments=environments.values()
        ),
    )


def _start_trainers(cfg: GRPOMasterConfig, cluster: Any, plan: Any) -> tuple[Any, Any]:
    """The run's policy, and its critic (None without ``critic.enabled``) on the same
    bundles."""
    from tempering.distributed.placement import has_reference

    policy = common.build_policy_from_config(
        cfg.policy,
        cluster,
        total_steps=cfg.grpo.max_num_steps - cfg.critic.warmup_steps,  # PPO: steps it trains
        init_reference_model=has_reference(cfg),  # a KL penalty in the loss or PPO's reward
        seed=cfg.grpo.seed,
        gpu_share=plan.gpu_share,
        samples_per_step=samples_per_step(cfg),
    )
    try:
        return policy, ppo_critic.build(cfg, cluster, plan, samples_per_step(cfg))
    except BaseException:
        policy.shutdown()
        raise


def _warn_uncorrected_precision(cfg: GRPOMasterConfig) -> None:
    """Sampling in a lower precision than the trainer's without the importance-sampling
    correction is allowed (the mismatch stays in the logs) but said at start."""
    gen = cfg.policy.generation
    sampler = gen.torch_dtype_name if gen.backend == "torch" else gen.vllm_cfg.precision
    if sampler != cfg.policy.precision and not cfg.loss_fn.use_importance_sampling_correction:
        log.warning(
            "the generator samples in %s and the trainer computes in %s, and "
            "loss_fn.use_importance_sampling_correction=false: the mismatch is logged "
            "(train/token_mult_prob_error, train/gen_kl_error) but not corrected; set it true "
            "(e.g. with truncated_importance_sampling_type=tis and "
            "truncated_importance_sampling_ratio=2.0) to weight each token by pi_trainer / "
            "pi_sampler",
            sampler, cfg.policy.precision,
        )  # fmt: skip


def _turn_client(cfg: GRPOMasterConfig, chat: Any, server: Any, tokenizer: Any, prompt: str) -> Any:
    """How rollouts reach the chat service: over HTTP through the run's server
    (``grpo.rollout_transport=http``; raw prompts checked, `_check_http_prompts`, as for an
    external harness, whose calls reach the server themselves), or in process."""
    from tempering.experience.rollouts import HttpTurnClient, InProcessTurnClient

    if cfg.grpo.rollout_transport == "in_process":
        return InProcessTurnClient(chat)
    _check_http_prompts(cfg, tokenizer, prompt)
    if cfg.grpo.rollout_transport == "external":  # the harness's calls reach the server
        return InProcessTurnClient(chat)
    return HttpTurnClient(
        server.base_url, chat.settings.model_name, server.api_key, ca_file=server.ca_file
    )


def _check_http_prompts(cfg: GRPOMasterConfig, tokenizer: Any, prompt: str) -> None:
    """Over HTTP the server renders the first turn with the chat template; raw prompts
    (data.use_chat_template=false) must encode to the same ids, or training would differ."""
    from tempering.data.prompts import prompt_token_ids

    if cfg.data.use_chat_template:
        return
    if prompt_token_ids(prompt, tokenizer, False) != prompt_token_ids(prompt, tokenizer, True):
        raise ValueError(
            f"grpo.rollout_transport={cfg.grpo.rollout_transport} renders prompts with the "
            "chat template, but "
            "data.use_chat_template=false and this tokenizer's template changes the prompt "
            f"{prompt[:40]!r}; set data.use_chat_template=true or use rollout_transport=in_process"
        )


# --------------------------------------------------------------------------- loop
def make_loss(cfg: GRPOMasterConfig) -> Any:
    """The run's `ClippedPGLoss`, from ``loss_fn``."""
    from tempering.losses import ClippedPGLoss

    # every loss_fn key is the loss's own argument of that name, but two that NeMo RL names
    # differently; the temperature is the sampler's (the trainer's logits scaled as sampled)
    lf = cfg.loss_fn.model_dump(exclude={"kl_type", "token_level_loss"})
    return ClippedPGLoss(
        **lf,
        kl_estimator=cfg.loss_fn.kl_type,
        loss_type="token" if cfg.loss_fn.token_level_loss else "sequence",
        temperature=cfg.policy.generation.temperature,
    )


class SyncSteps:
    """Synchronous GRPO's steps for `train`: generate, then train, then refit, in turn.
    (Asynchronous GRPO's are `tempering.algorithms.async_grpo.AsyncSteps`.)"""

    def __init__(self, run: GRPORun) -> None:
        self.run = run
        self.loss_fn = make_loss(run.cfg)

    def step(self, step: int) -> dict[str, float]:
        return grpo_step(self.run, self.loss_fn, step)

    @contextlib.contextmanager
    def saving(self) -> Iterator[Any]:
        """Around a checkpoint: yields what writes the steps' own files (a critic's, if any)."""
        yield ppo_critic.writer(self.run.critic)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Around validation: nothing else generates (nothing does here)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def train(run: GRPORun, steps: Any = None) -> dict[str, Any]:
    """The GRPO loop; returns a summary (start/end validation accuracy, time). ``steps`` makes
    each step (default: `SyncSteps`; asynchronous GRPO passes its own)."""
    cfg = run.cfg
    if steps is None:
        if cfg.grpo.async_grpo.enabled:
            raise ValueError(
                "grpo.async_grpo.enabled=true: train with tempering.algorithms.async_grpo.train"
                "(run), which overlaps generation with training"
            )
        steps = SyncSteps(run)
    try:
        return _train_loop(run, steps)
    finally:
        steps.close()


def _train_loop(run: GRPORun, stepper: Any) -> dict[str, Any]:
    from tempering.utils.logger import print_step_summary, track

    cfg = run.cfg
    budget = cfg.grpo.max_wall_time_s  # covers the whole run, resumed parts included
    deadline = common.Deadline(None if budget is None else budget - run.prior_wall_time_s)
    first_val: dict[str, float] = {}
    val: dict[str, float] = {}
    if cfg.grpo.val_at_start and cfg.grpo.val_period and run.start_step == 0:
        first_val = val = validate(run, step=0)
    common.warn_if_finished(
        run.start_step, cfg.grpo.max_num_steps, "grpo", cfg.checkpointing.checkpoint_dir
    )
    step = run.start_step
    steps = range(run.start_step, cfg.grpo.max_num_steps)
    with track(steps, total=len(steps), description="grpo") as progress:
        for _ in progress:
            if common.epochs_reached(
                run.dataloader, cfg.grpo.max_num_epochs, "grpo.max_num_epochs", step
            ):
                break
            metrics = stepper.step(step + 1)
            step += 1
            run.logger.log_metrics(metrics, step)
            common.log_resources(run.monitor, run.logger, step)
            is_last = (
                step == cfg.grpo.max_num_steps
                or run.dataloader.epochs_completed >= cfg.grpo.max_num_epochs
                or deadline.passed()
            )
            if cfg.grpo.val_period and (step % cfg.grpo.val_period == 0 or is_last):
                with stepper.paused():
                    val = validate(run, step)
            print_step_summary(
                step, cfg.grpo.max_num_steps, {**metrics, **{f"val/{k}": v for k, v in val.items()}}
            )
            if run.checkpointer and run.checkpointer.should_save(step, is_last_step=is_last):
                with stepper.saving() as write_files:
                    common.save_checkpoint(
                        run, run.policy, step, val, write_files=write_files,
                        extra={"wall_time_s": run.prior_wall_time_s + deadline.elapsed},
                    )  # fmt: skip
            if deadline.passed():
                log.info(
                    "grpo.max_wall_time_s=%s reached at step %d", cfg.grpo.max_wall_time_s, step
                )
                break
    final = common.export_final_model(
        run.policy, cfg.checkpointing, cfg.policy.dtensor_cfg.lora_cfg.enabled
    )
    final_critic = ppo_critic.export(run.critic, cfg.checkpointing.checkpoint_dir)
    first_val = first_val or common.first_logged(cfg.logger.log_dir, "val/")  # resumed: records
    if step == run.start_step:  # nothing left to do: the checkpoint's validation is the last
        val = val or common.resumed_val(run.checkpointer, step)
    return {
        "steps": step,
        "steps_this_run": step - run.start_step,
        "epochs": run.dataloader.epochs_completed,  # whole passes over the training problems
        "final_model": str(final),
        "final_critic": final_critic,  # PPO's, else None
        "start_accuracy": first_val.get("accuracy"),  # None where rewards are scores
        "end_accuracy": val.get("accuracy"),
        "start_reward_mean": first_val.get("reward_mean"),
        "end_reward_mean": val.get("reward_mean"),
        "start_success": first_val.get("success"),
        "end_success": val.get("success"),
        "wall_time_s": run.prior_wall_time_s + deadline.elapsed,
        "warning": run.signal.warning,
    }


def held_out_line(s: dict[str, Any], who: str = "") -> str:
    """``held-out greedy accuracy a -> b``, or the mean reward where the rewards are scores."""

    def fig(x: float | None, f: str) -> str:
        return "n/a" if x is None else format(x, f)

    scores = [s.get(k) for k in ("start_reward_mean", "end_reward_mean")]
    no_accuracy = s.get("start_accuracy") is None and s.get("end_accuracy") is None
    if no_accuracy and scores != [None, None]:
        a, b = scores
        return f"{who}held-out greedy mean reward {fig(a, '.4g')} -> {fig(b, '.4g')}"
    a, b = s.get("start_accuracy"), s.get("end_accuracy")
    return f"{who}held-out greedy accuracy {fig(a, '.1%')} -> {fig(b, '.1%')}"


def summary_text(s: dict[str, Any], cfg: GRPOMasterConfig) -> str:
    """The lines a GRPO example prints at the end of a run."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    resumed = s["steps"] - s["steps_this_run"]
    where = f" ({s['steps_this_run']} in this run, resumed at step {resumed})" if resumed else ""
    name = "PPO" if cfg.critic.enabled else "GRPO"  # PPO: the critic's advantages
    lines = [
        f"\n{name} summary: {s['steps']} steps{where} in {s['wall_time_s']:.0f} s of training; "
        + held_out_line(s)
    ]
    if cfg.grpo.max_rollout_turns > 1:
        lines.append(
            f"  solved within {cfg.grpo.max_rollout_turns} turns (held-out, greedy): "
            f"{pct(s['start_success'])} -> {pct(s['end_success'])}"
        )
    for i, r in enumerate(s.get("restarts", []), 1):
        redone = r["failed_after_step"] - r["resumed_at"]
        lines.append(
            f"  restart {i}: after step {r['failed_after_step']} ({r['error'][:160]}); "
            f"resumed at step {r['resumed_at']} after {r['setup_s']:.0f} s of set-up, "
            f"{redone} step(s) redone"
        )
    if s.get("warning"):
        lines.append(f"  WARNING: {s['warning']}")
    lines.append(f"  metrics: {cfg.logger.log_dir}/metrics.jsonl")
    lines.append(f"  final model (HF folder): {s['final_model']}")
    if s.get("final_critic"):
        lines.append(f"  final critic (HF folder): {s['final_critic']}")
    lines.append(f"  checkpoints: {cfg.checkpointing.checkpoint_dir}")
    return "\n".join(lines)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of GRPO step ``step`` (1-based) of a run seeded ``seed``."""
    return (seed * 1_000_003 + step) % 2**31


def grpo_step(run: GRPORun, loss_fn: Any, step: int | None = None) -> dict[str, float]:
    """One step as a recipe: sample prompts -> roll out -> score -> advantages -> log-probs
    -> train -> refit -> metrics. Returns namespaced metrics.

    ``step`` (1-based, the step this call makes) reseeds every generation worker from the
    run's seed and the step first, so a run resumed from a checkpoint samples exactly what the
    uninterrupted run did; None keeps the workers' streams running on."""
    cfg = run.cfg.grpo
    timer = Timer()
    server_before = run.chat.stats_snapshot()
    t0 = time.perf_counter()
    problems, batch = sample_batch(run, timer, step)
    rewards_seen, logs_seen = batch["rewards"], batch["message_logs"]
    batch, extra = refill_zero_variance_groups(run, batch, timer)
    run.generation.finish_generation()  # colocated vLLM sleeps: the GPUs are the trainer's
    if cfg.overlong_filtering:
        batch, n_masked = mask_overlong_samples(batch)
        extra["train/overlong_masked"] = float(n_masked)
    # asked now, answered while the policy trains
    tasks = [p.task_name for p in problems for _ in range(cfg.num_generations_per_prompt)]
    env_metrics = scoring.environment_metrics(run.environments, rewards_seen, tasks)
    data, train_metrics, critic_metrics = learn_from(run, batch, loss_fn, timer, step)
    if not ppo_critic.warming_up(run.cfg, step):  # (a critic's warm-up keeps the weights)
        refit_generation(run, timer)
    step_s = time.perf_counter() - t0

    metrics = step_metrics(run, batch, data, rewards_seen, train_metrics, timer, step_s)
    metrics.update(extra)
    metrics.update(critic_metrics)
    metrics.update(env_metrics())
    metrics.update(grpo_blend.env_metrics(problems, rewards_seen, cfg.num_generations_per_prompt))
    metrics.update(server_metrics(run.chat, server_before))
    watch_signal(run, step or 0, problems, logs_seen, rewards_seen, metrics)
    return metrics


def sample_batch(run: GRPORun, timer: Any, step: int | None) -> tuple[list[Problem], Any]:
    """A step's prompts and their scored rollouts (`rollout_batch`: episodes, rewards,
    advantages), timed as ``generation``. ``step`` (1-based) first reseeds every generation
    worker from the run's seed and the step (see `grpo_step`); None lets the streams run on."""
    cfg = run.cfg.grpo
    if step is not None:
        run.generation.reseed(step_seed(cfg.seed, step))
    with timer.time("generation"):
        faults.maybe_fault("controller", "generation")
        problems = run.dataloader.next_batch()
        return problems, rollout_batch(run, problems, cfg.num_generations_per_prompt)


def watch_signal(
    run: GRPORun, step: int, problems: list[Problem], logs: list[Any], rewards: Any, metrics: Any
) -> None:
    """Feed the step (as first sampled) to ``run.signal`` (signal_watch.py), which warns once
    when the run has had no learning signal for several steps. With a critic (PPO) the
    signal is any difference between the batch's rewards: the batch is one group."""
    G = run.cfg.grpo.num_generations_per_prompt
    group = len(rewards) if run.cfg.critic.enabled else G

    def sample(i: int) -> str:
        p = problems[i // G]
        return f"{p.prompt[-120:]!r} -> {completion_text(logs[i])[:120]!r} -> {p.answer!r}"

    warning = run.signal.observe(step, step_signal(rewards, group, metrics, sample))
    if warning:
        log.warning("GRPO: %s", warning)


def refill_zero_variance_groups(
    run: GRPORun, batch: Any, timer: Any
) -> tuple[Any, dict[str, float]]:
    """DAPO's dynamic sampling (``grpo.use_dynamic_sampling``): drop the groups whose rewards
    are all equal and refill from new prompts. Returns (the batch, its ``train/*`` metrics);
    off, the batch as it came."""
    cfg = run.cfg.grpo
    if not cfg.use_dynamic_sampling:
        return batch, {}
    G = cfg.num_generations_per_prompt
    sampler = DynamicSampler(
        cfg.num_prompts_per_step, G, cfg.dynamic_sampling_max_gen_batches, reward_key="rewards"
    )
    sampler.add(batch)
    while sampler.needs_more():
        with timer.time("generation"):
            sampler.add(rollout_batch(run, run.dataloader.next_batch(), G))
    result = sampler.result(pad_to_target=True)
    return BatchedDataDict(result.batch), {
        f"train/{k}": float(v) for k, v in result.metrics.items()
    }


def refit_generation(run: GRPORun, timer: Any) -> None:
    """The generator takes the new weights; the chat service waits for in-flight server calls
    and holds new ones meanwhile."""
    with timer.time("refit"):
        faults.maybe_fault("controller", "refit")
        run.chat.refit(lambda: run.generation.refit(run.policy))


def step_metrics(
    run: GRPORun,
    batch: Any,
    data: Any,
    rewards_seen: torch.Tensor,
    train_metrics: dict[str, float],
    timer: Any,
    step_s: float,
) -> dict[str, float]:
    """``train/*`` (the policy's, then the rollouts' as first sampled), ``timing/*`` and
    ``throughput/*`` of one step."""
    timing = timer.get_timing_metrics()
    gen_lens = batch["generation_lengths"].float()
    reasons = list(batch["finish_reasons"])
    grouped = rewards_seen.view(-1, run.cfg.grpo.num_generations_per_prompt)
    metrics = {f"train/{k}": v for k, v in train_metrics.items()}
    metrics.update(
        {
            "train/reward_mean": float(rewards_seen.mean()),
            "train/reward_std": float(rewards_seen.std()),
            "train/gen_length_mean": float(gen_lens.mean()),
            "train/gen_length_max": float(gen_lens.max()),
            "train/truncated_fraction": sum(r == "length" for r in reasons) / len(reasons),
            "train/turns_mean": float(batch["turns"].float().mean()),
            "train/episode_truncated_fraction": float(batch["truncated"].float().mean()),
            "train/zero_variance_groups": float((grouped.amax(1) == grouped.amin(1)).sum()),
            "timing/step_s": step_s,
            "throughput/tokens_per_s": float(data["input_lengths"].sum()) / step_s,
            "throughput/generated_tokens_per_s": float(gen_lens.sum())
            / max(timing.get("timing/generation_s", 0.0), 1e-9),
        }
    )
    if run.correct_above is not None:
        metrics["train/accuracy"] = float((rewards_seen > run.correct_above).float().mean())
    if "prompt_too_long" in batch:  # masked out, no turn generated (logged by the rollouts)
        metrics["train/prompt_too_long"] = float(batch["prompt_too_long"].sum())
    metrics.update(shaping_metrics(batch))
    metrics.update(timing)
    return metrics


def server_metrics(chat: Any, before: dict[str, float]) -> dict[str, float]:
    """This step's server counts (the counters run from process start, which a resumed run
    would not reproduce): only what moved, so a step's keys do not depend on its history."""
    return {
        f"server/{k}": float(v - before.get(k, 0))
        for k, v in chat.stats_snapshot().items()
        if v != before.get(k, 0)
    }


def rollouts(
    run: GRPORun,
    problems: list[Problem],
    greedy: bool,
    repeat: int = 1,
    deadline_s: float | None = None,
) -> Any:
    """``repeat`` episodes per problem (each prompt encoded once) through the rollout loop:
    single- or multi-turn, in-process or over HTTP (tempering/experience/rollouts.py), with
    the loop's ``deadline_s`` (NeMo Gym runs its episodes itself: async GRPO refuses a
    deadline there)."""
    from tempering.experience.rollouts import InProcessTurnClient, problem_samples, run_rollouts

    cfg = run.cfg
    sampling = run.chat.settings.default_sampling
    if problems and problems[0].task_name == "nemo_gym":  # Gym runs whole episodes itself
        from tempering.data.nemo_gym import problem_row

        if any(p.task_name != "nemo_gym" for p in problems):
            raise ValueError("a batch mixes NeMo Gym rows with other tasks; use one or the other")
        rows = [p.row or problem_row(p.prompt, p.answer) for p in problems]
        gym = run.environments["nemo_gym"]
        return gym.rollouts(rows, sampling=sampling, greedy=greedy, repeat=repeat)
    if cfg.grpo.rollout_transport == "external":  # the harness runs whole episodes itself
        harness = run.environments[EXTERNAL]
        return harness.rollouts(problems, sampling=sampling, greedy=greedy, repeat=repeat)
    in_process = isinstance(run.turns, InProcessTurnClient)
    once = problem_samples(problems, run.tokenizer, cfg.data.use_chat_template, in_process)
    samples = [sample for sample in once for _ in range(repeat)]
    return run_rollouts(
        run.turns,
        samples,
        run.environments,
        sampling=sampling,
        max_turns=cfg.grpo.max_rollout_turns,
        max_seq_len=cfg.policy.max_total_sequence_length,
        greedy=greedy,
        deadline_s=deadline_s,
    )


def rollout_batch(
    run: GRPORun, problems: list[Problem], group_size: int, deadline_s: float | None = None
) -> Any:
    """Sample `group_size` episodes per problem and score them. Returns one flat per-sample
    BatchedDataDict: the train keys plus rewards, turns, truncated, generation_lengths,
    finish_reasons and message logs (and ``deadline_cut`` with a ``deadline_s``; with
    ``grpo.reward_scaling`` or ``grpo.reward_shaping``, the ``shaped_rewards`` the advantages
    read, `reward_shaping.shape_rewards`)."""
    from tempering.algorithms.advantages import group_advantages
    from tempering.config.schemas import overlong_limit

    cfg = run.cfg
    batch = rollouts(run, problems, greedy=False, repeat=group_size, deadline_s=deadline_s)
    rewards = batch["rewards"]
    if cfg.grpo.reward_scaling.enabled or cfg.grpo.reward_shaping.enabled:
        batch.update(shape_rewards(
            rewards, batch["generation_lengths"], batch["truncated"], cfg.grpo.reward_scaling,
            cfg.grpo.reward_shaping, overlong_limit(cfg),
        ))  # fmt: skip
        rewards = batch["shaped_rewards"]
    if cfg.critic.enabled:  # PPO: the critic's GAE advantages, set by grpo_step
        return batch
    valid = batch["sample_mask"] > 0  # e.g. NeMo Gym's mask_sample: out of every baseline
    adv = group_advantages(rewards, group_size, cfg.grpo.use_leave_one_out_baseline,
                           normalize_std=cfg.grpo.normalize_rewards, valid=valid)  # fmt: skip
    # [B, S]: one advantage per episode, on its generated tokens
    batch["advantages"] = adv.advantages[:, None] * batch["token_mask"]
    return batch


def completion_text(message_log: list[dict[str, Any]]) -> str:
    """What the model said in an episode, turn by turn (for logs)."""
    return " | ".join(str(m.get("content") or "") for m in message_log if m["role"] == "assistant")


# --------------------------------------------------------------------- validation
def validate(run: GRPORun, step: int) -> dict[str, float]:
    """Greedy accuracy on held-out prompts (and pass@k with sampling when configured)."""

    cfg = run.cfg
    problems = run.val_problems[: cfg.grpo.max_val_samples]
    t0 = time.perf_counter()
    correct: list[float] = []
    turns: list[float] = []
    shown = 0
    for i in range(0, len(problems), cfg.grpo.val_batch_size):
        chunk = problems[i : i + cfg.grpo.val_batch_size]
        batch = rollouts(run, chunk, greedy=True)
        correct.extend(float(r) for r in batch["rewards"])
        turns.extend(float(t) for t in batch["turns"])
        for p, log_ in zip(chunk, batch["message_logs"], strict=True):
            if shown < cfg.logger.num_val_samples_to_print:
                c = completion_text(log_)
                log.info("val sample: %r -> %r (answer %s)", p.prompt[-80:], c[:120], p.answer)
                shown += 1
    metrics = {
        "reward_mean": sum(correct) / len(correct),
        "turns_mean": sum(turns) / len(turns),
    }
    threshold = run.correct_above
    if threshold is not None:  # correct answers: the share right, and solved at any turn
        metrics["accuracy"] = sum(c > threshold for c in correct) / len(correct)
        metrics["success"] = sum(c > 0 for c in correct) / len(correct)
    metrics.update(grpo_blend.entry_metrics(problems, correct))  # val/<entry>/... (a blend)
    # the environments' counters (env/*) of these answers are reset: a step's count its own
    scoring.environment_metrics(run.environments, torch.tensor(correct))()
    k = cfg.grpo.val_pass_at_k
    if k:  # with scores for rewards, set-up refuses grpo.val_pass_at_k
        sampled = rollout_batch(run, problems, k)
        metrics[f"pass@{k}"] = float(
            (sampled["rewards"].view(-1, k) > threshold).any(dim=1).float().mean()
        )
    metrics["time_s"] = time.perf_counter() - t0
    run.logger.log_metrics(metrics, step, prefix="val")
    return metrics
