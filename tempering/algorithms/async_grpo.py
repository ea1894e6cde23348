"""Asynchronous GRPO (``grpo.async_grpo.enabled``): the batch of step ``t + 1`` is generated
while step ``t`` trains.

The loop is GRPO's own (`grpo.train`: validation, checkpoints, wall-clock budget, summary);
what differs is each step, made by :class:`AsyncSteps`:

    take the step's groups from the replay buffer (waiting: timing/idle/buffer_starvation)
    -> advantages came with the groups (PPO: the critic's, now) -> train -> wait for the
    collector to drain
    (timing/idle/refit_bubble) -> refit -> the collector goes on with the new weights

The collector (`tempering.experience.collector`) is a thread of this process that rolls out
through the same `grpo.rollout_batch` as synchronous GRPO -- single-turn, multi-turn,
in-process or over HTTP, NeMo Gym -- on the generation workers, which run beside the policy
workers (colocated generation is refused at config load). Its schedule makes every sample's
weight version a function of its step, so a run is reproducible and a resumed run draws what
the uninterrupted one did: the buffer's groups and the collector's position go into each
checkpoint (``async_state.pt``). With ``max_trajectory_age_steps=0`` the schedule is the
synchronous one. Every phase of the trainer and the collector goes to
``<log_dir>/timeline.jsonl`` for ``tempering plot --timeline``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tempering.algorithms import grpo, grpo_blend, grpo_learning, grpo_scoring, ppo_critic
from tempering.algorithms.dynamic_sampling import mask_overlong_samples
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.experience.collector import RolloutCollector
from tempering.experience.replay_buffer import ReplayBuffer
from tempering.utils import faults
from tempering.utils.timers import PhaseLog, Timer

log = logging.getLogger(__name__)

STATE_FILE = "async_state.pt"
VERSIONS = "generation_weight_versions"  # [B, S]: each generated token's weights (in-flight)


def token_version_metrics(versions: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """With in-flight weight updates: the share of samples whose tokens came from more than
    one weight version, and the tokens' mean and largest age against the trainer's weights."""
    generated = versions >= 0
    newest = torch.where(generated, versions, -1).amax(1)
    oldest = torch.where(generated, versions, 1 << 62).amin(1)
    has = generated.any(1)
    ages = (trainer_version - versions)[generated].float()
    return {
        "train/mixed_version_samples": float(((newest > oldest) & has).float().mean()),
        "train/avg_token_age": float(ages.mean()) if ages.numel() else 0.0,
        "train/max_token_age": float(ages.max()) if ages.numel() else 0.0,
    }


def train(run: grpo.GRPORun) -> dict[str, Any]:
    """Asynchronous GRPO's loop; returns `grpo.train`'s summary."""
    return grpo.train(run, AsyncSteps(run))


class AsyncSteps:
    """The steps of asynchronous GRPO (see the module docstring), for `grpo.train`."""

    def __init__(self, run: grpo.GRPORun) -> None:
        cfg = run.cfg
        a = cfg.grpo.async_grpo
        if a.group_timeout_s is not None and "nemo_gym" in run.environments:
            raise ValueError(
                f"grpo.async_grpo.group_timeout_s={a.group_timeout_s} cannot bound NeMo Gym "
                "episodes, which Gym's agents run; bound each with nemo_gym.request_timeout_s "
                "and set group_timeout_s=null"
            )
        self.run = run
        self.in_flight = a.in_flight_weight_updates
        self.loss_fn = grpo.make_loss(cfg)
        self.num_groups = cfg.grpo.num_prompts_per_step
        self.phases = PhaseLog(str(Path(cfg.logger.log_dir) / "timeline.jsonl"))
        # room for the batches the schedule lets the collector make ahead (max_age + 1 steps)
        self.buffer = ReplayBuffer(max_size=self.num_groups * (a.max_trajectory_age_steps + 1))
        # step -> what the collector measured making its batch: generation seconds, the
        # environments' and the server's counters (collected per batch, so they do not
        # depend on thread timing); checkpointed with the buffer
        self.made: dict[int, dict[str, float]] = {}
        self.problems: dict[int, list[tuple[str, str, str]]] = {}  # step -> its prompts, answers
        self._drawn: dict[int, list[Any]] = {}  # step -> problems of a batch being generated
        next_step, failures = run.start_step + 1, 0
        state = _load_state(run)
        if state is not None:
            self.buffer.load_state_dict(state["buffer"])
            self.made = state["made"]
            self.problems = state["problems"]
            next_step = state["collector"]["next_step"]
            failures = state["collector"]["failures"]
        self.collector = RolloutCollector(
            self._produce,
            self.buffer,
            group_size=cfg.grpo.num_generations_per_prompt,
            max_age=a.max_trajectory_age_steps,
            next_step=next_step,
            weight_version=run.start_step,
            last_step=cfg.grpo.max_num_steps,
            max_failures=a.max_generation_failures,
            failures=failures,
            stall_timeout_s=a.starvation_timeout_s,
            phases=self.phases,
        )
        self._started = False
        # Generation workers and environment actors run one call at a time: a resource query
        # from the trainer would queue behind the collector's batch and stall the step, so
        # the collector samples them itself, between its batches.
        self.collector_monitor = None
        if run.monitor is not None:
            from tempering.utils.resources import ResourceMonitor

            moved = {r: run.monitor.sources.pop(r) for r in ("generation", "environment")
                     if r in run.monitor.sources}  # fmt: skip
            self.collector_monitor = ResourceMonitor(moved) if moved else None

    def _produce(self, step: int) -> BatchedDataDict:
        """The collector's work for one step: GRPO's own rollouts, seeded by the step."""
        run, cfg = self.run, self.run.cfg.grpo
        t0 = time.perf_counter()
        server_before = run.chat.stats_snapshot()
        faults.maybe_fault("collector", "generation")
        run.generation.reseed(grpo.step_seed(cfg.seed, step))
        if step not in self._drawn:  # once per step: a retried batch rolls out the same prompts
            self._drawn[step] = run.dataloader.next_batch()
        problems = self._drawn[step]
        batch = grpo.rollout_batch(
            run, problems, cfg.num_generations_per_prompt, cfg.async_grpo.group_timeout_s
        )
        del self._drawn[step]
        self.problems[step] = [(p.prompt, p.answer, p.task_name) for p in problems]
        made = {"timing/generation_s": time.perf_counter() - t0}
        tasks = [p.task_name for p in problems for _ in range(cfg.num_generations_per_prompt)]
        made.update(grpo_scoring.environment_metrics(run.environments, batch["rewards"], tasks)())
        made.update(
            grpo_blend.env_metrics(problems, batch["rewards"], cfg.num_generations_per_prompt)
        )
        made.update(grpo.server_metrics(run.chat, server_before))
        if self.collector_monitor is not None:
            made.update(self.collector_monitor.sample())
        self.made[step] = made
        return batch

    def step(self, step: int) -> dict[str, float]:
        run = self.run
        if not self._started:  # after the first validation, which uses the generator alone
            self.collector.start()
            self._started = True
        timer = Timer()
        t0 = time.perf_counter()
        with timer.time("idle/buffer_starvation"), self.phases.phase("trainer", "wait", step):
            groups, taken = self.collector.take(step, self.num_groups)
        batch = BatchedDataDict.from_batches(groups, {VERSIONS: -1})
        extra: dict[str, float] = {}
        if VERSIONS in batch:  # in-flight weight updates
            extra.update(token_version_metrics(batch[VERSIONS], trainer_version=step - 1))
        if run.cfg.grpo.overlong_filtering:
            batch, n_masked = mask_overlong_samples(batch)
            extra["train/overlong_masked"] = float(n_masked)
        if "deadline_cut" in batch:  # grpo.async_grpo.group_timeout_s
            cut = batch["deadline_cut"].view(-1, run.cfg.grpo.num_generations_per_prompt)
            extra["train/deadline_cut_episodes"] = float(cut.sum())
            extra["train/deadline_cut_groups"] = float(cut.any(1).sum())
        rewards_seen = batch["rewards"]
        with self.phases.phase("trainer", "train", step):  # (PPO: the critic's turns too)
            data, train_metrics, critic_metrics = grpo_learning.learn_from(
                run, batch, self.loss_fn, timer, step
            )
        if self.in_flight:  # the refit goes to the batch in progress: nothing to wait for
            timer.record("idle/refit_bubble", 0.0)
        else:  # drain-then-refit: no batch mixes weight versions
            with timer.time("idle/refit_bubble"), self.phases.phase("trainer", "drain", step):
                self.collector.wait_for_drain(step)
        with self.phases.phase("trainer", "refit", step):
            with timer.time("refit"):
                faults.maybe_fault("controller", "refit")
                run.chat.refit(
                    lambda: run.generation.refit(run.policy, version=step),
                    version=step,
                    drain=not self.in_flight,
                )
            self.collector.weights_loaded(step)
        step_s = time.perf_counter() - t0

        made = self.made.pop(step)
        timer.record("generation", made.pop("timing/generation_s"))  # the collector's
        metrics = grpo.step_metrics(run, batch, data, rewards_seen, train_metrics, timer, step_s)
        metrics.update(extra)
        metrics.update(critic_metrics)
        metrics.update(taken)
        metrics.update(made)  # the environments' and the server's counters of this batch
        problems = [grpo.Problem(*p) for p in self.problems.pop(step)]
        grpo.watch_signal(run, step, problems, batch["message_logs"], rewards_seen, metrics)
        return metrics

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Validation runs with the collector held between batches: the generator and the
        environments' counters are validation's alone meanwhile."""
        return self.collector.quiesce()

    @contextlib.contextmanager
    def saving(self) -> Iterator[Any]:
        """Hold the collector between batches while a checkpoint takes the data loader's
        position, the buffer and the collector's next step together."""
        with self.collector.quiesce():
            state = {
                "buffer": self.buffer.state_dict(),
                "collector": self.collector.state_dict(),
                "made": dict(self.made),
                "problems": dict(self.problems),
            }

            critic = ppo_critic.writer(self.run.critic)

            def write(folder: Path) -> None:
                torch.save(state, folder / STATE_FILE)
                if critic is not None:
                    critic(folder)

            yield write

    def close(self) -> None:
        """Stop the collector (after its current batch) and close the timeline; an error of
        the collector after the last step's batch does not matter any more."""
        self.collector.stop()
        self.phases.close()


def _load_state(run: grpo.GRPORun) -> dict[str, Any] | None:
    """The buffer and collector position of the checkpoint the run resumed from, if async."""
    if not run.start_step or run.checkpointer is None:
        return None
    path = run.checkpointer.step_dir(run.start_step) / STATE_FILE
    if not path.exists():
        log.warning(
            "resuming asynchronous GRPO from %s, which a synchronous run wrote: the collector "
            "starts at step %d with an empty buffer",
            path.parent, run.start_step + 1,
        )  # fmt: skip
        return None
    return torch.load(path, weights_only=True)
