"""On-policy distillation: the student samples, a frozen teacher scores every sampled token
with its top-k log-probs, and the student trains on the KL between the two.

    uv run examples/run_distillation.py [--config FILE] [dotted.key=value ...]

One step (`distillation_step`):
  1. prompts -> the student's rollouts through GRPO's loop (single- or multi-turn, in-process
     or over HTTP, NeMo Gym); the environments' rewards are logged, never trained on
  2. the teacher's top-k log-probs and token ids on the sampled sequences, each of its
     data-parallel ranks scoring its shard: only ``[B, S, k]`` tensors travel
  3. policy.train(`DistillationLoss`) on the student's generated tokens (forward, reverse or
     mixed KL over the teacher's top-k)
  4. refit the student's generator; log, validate (held-out greedy accuracy), checkpoint

Everything but steps 2 and 3 is GRPO's, reused rather than restated: `setup` hands the run's
GRPO view (`DistillationMasterConfig.grpo_view`: the ``distillation.*`` loop keys as
``grpo.*``) to `grpo.setup` with the placement plan that includes the teacher, and `train`
runs `grpo.train` with `DistillationSteps`, so validation, checkpoints, exact resume, the
wall-time budget and the final exports behave as in GRPO. The teacher is frozen: checkpoints
hold the student alone. The teacher is its own worker group (`build_teacher`): CPU bundles of
its own on CPU, the policy's GPUs on GPUs (`tempering.distributed.placement`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tempering.algorithms import common, grpo, grpo_scoring
from tempering.config.schemas import DistillationMasterConfig
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.utils.timers import Timer

log = logging.getLogger(__name__)

# What the student trains on: its samples (the teacher's top-k are added per step).
STUDENT_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


@dataclass
class DistillationRun:
    cfg: DistillationMasterConfig
    student: grpo.GRPORun  # the student's rollouts, policy, logger, checkpoints
    teacher: Any  # a `Policy` without optimizer
    teacher_cluster: Any  # None when the teacher sits on the student's bundles

    def close(self) -> None:
        try:
            self.teacher.shutdown()
            if self.teacher_cluster is not None:
                self.teacher_cluster.shutdown()
        finally:
            self.student.close()


def setup(cfg: DistillationMasterConfig, resolved: dict[str, Any]) -> DistillationRun:
    """The student's GRPO machinery and the teacher's workers. The plan (a vocabulary
    mismatch between teacher and student is refused there) comes before any worker."""
    teacher_path = say_if_self_distillation(cfg)  # a missing teacher: named, before Ray
    plan = common.plan_run(cfg)
    student = grpo.setup(cfg.grpo_view(), resolved, plan)
    try:
        teacher, cluster = build_teacher(cfg, plan, student.cluster, teacher_path)
    except BaseException:
        student.close()
        raise
    return DistillationRun(cfg, student, teacher, cluster)


def say_if_self_distillation(cfg: DistillationMasterConfig) -> str:
    """The teacher's folder; logs when it is the student's own starting checkpoint
    (self-distillation: allowed, and said)."""
    from tempering.models.registry import resolve_model_path

    teacher = resolve_model_path(cfg.teacher.model_name)
    if Path(teacher).resolve() == Path(resolve_model_path(cfg.policy.model_name)).resolve():
        log.info(
            "self-distillation: teacher.model_name=%r is the student's own starting "
            "checkpoint (allowed: the student is pulled toward its first distribution)",
            cfg.teacher.model_name,
        )
    return teacher


def build_teacher(
    cfg: DistillationMasterConfig, plan: Any, student_cluster: Any, model_path: str | Path
) -> tuple[Any, Any]:
    """The teacher's `Policy` (no optimizer) on the plan's teacher group: ``(policy, its own
    cluster or None when it shares the student's bundles)``."""
    from tempering.models.policy.lm_policy import build_policy

    t, group = cfg.teacher, plan.teacher
    own = group.colocated_with is None
    cluster = common.build_cluster(group, cfg.cluster, "teacher") if own else student_cluster
    try:
        teacher = build_policy(
            cluster,
            str(model_path),
            name_prefix="teacher",
            tensor_parallel_size=t.dtensor_cfg.tensor_parallel_size,
            gpu_share=plan.gpu_share,
            cpu_share=None if own else 0,  # on the student's bundles its workers hold the CPUs
            train_global_batch_size=t.logprob_batch_size * group.dp,  # it never trains
            train_micro_batch_size=t.logprob_batch_size,
            logprob_micro_batch_size=t.logprob_batch_size,
            precision=t.precision,
            num_threads=t.num_threads,
            init_optimizer=False,
            seed=cfg.distillation.seed,
        )
    except BaseException:
        if own:
            cluster.shutdown()
        raise
    return teacher, cluster if own else None


def make_loss(cfg: DistillationMasterConfig) -> Any:
    """The run's `DistillationLoss`, from ``loss_fn``."""
    from tempering.losses import DistillationLoss

    return DistillationLoss(**cfg.loss_fn.model_dump())  # its keys are the loss's arguments


class DistillationSteps(grpo.SyncSteps):
    """`grpo.train`'s steps for a distillation run (checkpoints and validation as GRPO's)."""

    def __init__(self, run: DistillationRun) -> None:
        self.run = run.student
        self.teacher = run.teacher
        self.k = run.cfg.distillation.topk_logits_k
        self.loss_fn = make_loss(run.cfg)

    def step(self, step: int) -> dict[str, float]:
        return distillation_step(self.run, self.teacher, self.k, self.loss_fn, step)


def train(run: DistillationRun) -> dict[str, Any]:
    """The distillation loop (`grpo.train` with `DistillationSteps`); returns its summary."""
    return grpo.train(run.student, steps=DistillationSteps(run))


def distillation_step(
    run: grpo.GRPORun, teacher: Any, k: int, loss_fn: Any, step: int
) -> dict[str, float]:
    """One step: roll out -> the teacher's top-k -> train -> refit. ``step`` (1-based)
    reseeds generation from the run's seed, so a resumed run samples what the uninterrupted
    one did. Returns GRPO's step metrics (rewards logged, not trained on), the loss's
    (``train/kl_forward``, ``train/teacher_topk_mass``, ...) and ``timing/teacher_s``."""
    timer = Timer()
    server_before = run.chat.stats_snapshot()
    t0 = time.perf_counter()
    _, batch = grpo.sample_batch(run, timer, step)
    run.generation.finish_generation()  # colocated vLLM sleeps: the GPUs are the trainers'
    data = BatchedDataDict({key: batch[key] for key in STUDENT_KEYS})
    env_metrics = grpo_scoring.environment_metrics(run.environments, batch["rewards"])
    with timer.time("teacher"):
        scored = teacher.get_topk_logprobs(data, k)
    for key in scored:
        data[key] = scored[key]
    with timer.time("train"):
        train_metrics = run.policy.train(data, loss_fn)
    grpo.refit_generation(run, timer)
    step_s = time.perf_counter() - t0
    metrics = grpo.step_metrics(run, batch, data, batch["rewards"], train_metrics, timer, step_s)
    metrics["train/teacher_topk_mb"] = (
        sum(scored[key].numel() * scored[key].element_size() for key in scored) / 2**20
    )
    metrics.update(env_metrics())
    metrics.update(grpo.server_metrics(run.chat, server_before))
    return metrics


def summary_text(s: dict[str, Any], cfg: DistillationMasterConfig) -> str:
    """The lines `examples/run_distillation.py` prints at the end of a run."""
    resumed = s["steps"] - s["steps_this_run"]
    where = f" ({s['steps_this_run']} in this run, resumed at step {resumed})" if resumed else ""
    return "\n".join([
        f"\ndistillation summary: {s['steps']} steps{where} in {s['wall_time_s']:.0f} s of "
        f"training; {grpo.held_out_line(s, 'student ')} (teacher {cfg.teacher.model_name})",
        f"  metrics: {cfg.logger.log_dir}/metrics.jsonl",
        f"  final model (HF folder): {s['final_model']}",
        f"  checkpoints: {cfg.checkpointing.checkpoint_dir}",
    ])  # fmt: skip
