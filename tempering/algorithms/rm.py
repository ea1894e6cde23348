"""Reward-model training: Bradley-Terry loss on a sequence-classification head, FSDP2 workers.

    uv run examples/run_rm.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (preference data, Ray cluster, `RewardModel` workers, logger,
checkpoints); `train()` is the loop: batch of pairs (chosen 2i / rejected 2i+1) ->
`reward_model.train` (Bradley-Terry: -logsigmoid(s_chosen - s_rejected)) -> log -> validate
(held-out pair accuracy, loss and margin, no update) -> checkpoint. `export()` writes an HF
folder that ``AutoModelForSequenceClassification.from_pretrained`` loads and that
`tempering.environments.reward_model.RewardModelEnvironment` (GRPO's ``env.reward_model_path``)
serves.

The model is ``AutoModelForSequenceClassification(num_labels=1)`` built from the causal-LM
folder of `policy.model_name` (its score head is new); `policy.*` gives the batch sizes,
optimizer and schedule. Data and its bad-row handling are DPO's (`dpo.load_preference_data`);
the default arithmetic pairs are SYNTHETIC (correct answer vs corrupted number).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tempering.algorithms import common
from tempering.algorithms.dpo import (
    PreferenceData,
    check_pair_batch_sizes,
    load_preference_data,
    preference_batch,
    preference_loader,
)
from tempering.config.schemas import RMMasterConfig

log = logging.getLogger(__name__)

TRAIN_METRICS = (
    "loss",
    "accuracy",
    "margin",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "num_nonfinite_skipped",
)


@dataclass
class RMRun:
    cfg: RMMasterConfig
    resolved: dict[str, Any]
    tokenizer: Any
    data: PreferenceData
    dataloader: Any
    reward_model: Any
    cluster: Any
    logger: Any
    checkpointer: Any
    start_step: int
    final_step: int = 0
    monitor: Any = None  # per-role resource metrics (logger.monitor_gpus)

    def close(self) -> None:
        """Free what the run started: logger, reward-model workers, placement groups."""
        self.logger.close()
        self.reward_model.shutdown()
        self.cluster.shutdown()


def setup(cfg: RMMasterConfig, resolved: dict[str, Any]) -> RMRun:
    from tempering.data.collate import pad_token_id_of
    from tempering.models.policy.reward_model import RewardModel

    pol = cfg.policy
    dp = cfg.cluster.num_nodes * (cfg.cluster.gpus_per_node or cfg.cluster.workers_per_node)
    check_pair_batch_sizes(
        pol.train_global_batch_size,
        pol.train_micro_batch_size,
        dp,
        "policy.train_global_batch_size / train_micro_batch_size",
    )
    check_pair_batch_sizes(
        cfg.rm.val_global_batch_size,
        cfg.rm.val_micro_batch_size,
        dp,
        "rm.val_global_batch_size / val_micro_batch_size",
    )
    common.prepare_run(cfg.deadlines, cfg.logger.log_dir)
    plan = common.plan_run(cfg)
    tokenizer = common.load_run_tokenizer(pol)
    data = load_preference_data(cfg.data)
    dataloader = preference_loader(
        data.train,
        pol.train_global_batch_size,
        tokenizer,
        pol.max_total_sequence_length,
        seed=cfg.rm.seed,
    )
    common.start_ray(cfg.cluster)  # the inputs are good: now the workers
    cluster = common.build_cluster(plan.policy, cfg.cluster, "rm")
    reward_model = RewardModel(
        common.build_policy_from_config(
            pol,
            cluster,
            total_steps=cfg.rm.max_num_steps,
            seed=cfg.rm.seed,
            name_prefix="reward_model",
            head="score",
            pad_token_id=pad_token_id_of(tokenizer),
        )
    )
    checkpointer = common.build_checkpointer(cfg.checkpointing)
    start_step, _ = common.maybe_resume(checkpointer, reward_model, dataloader)
    logger = common.build_logger(cfg.logger, resolved, start_step)
    logger.log_metrics({"num_skipped": float(data.num_skipped)}, start_step, prefix="data")
    return RMRun(
        cfg,
        resolved,
        tokenizer,
        data,
        dataloader,
        reward_model,
        cluster,
        logger,
        checkpointer,
        start_step,
        monitor=common.build_resource_monitor(cfg.logger, policy=reward_model.policy),
    )


def train(run: RMRun) -> dict[str, Any]:
    """The reward-model loop. Returns {"steps", "start": first val, "end": last val}."""
    from tempering.utils.logger import print_step_summary, track

    cfg = run.cfg.rm
    first: dict[str, float] = {}
    val: dict[str, float] = {}
    if cfg.val_at_start and cfg.val_period and run.start_step == 0:
        first = val = validate(run, step=0)
    step = run.start_step
    steps = range(run.start_step, cfg.max_num_steps)
    with track(steps, len(steps), "rm") as progress:
        for _ in progress:
            if run.dataloader.epoch >= cfg.max_num_epochs:
                break
            t0 = time.perf_counter()
            metrics = run.reward_model.train(run.dataloader.next_batch())
            step += 1
            run.logger.log_metrics(
                {k: metrics[k] for k in TRAIN_METRICS if k in metrics}, step, prefix="train"
            )
            run.logger.log_metrics({"step_s": time.perf_counter() - t0}, step, prefix="timing")
            common.log_resources(run.monitor, run.logger, step)
            is_last = step == cfg.max_num_steps
            if cfg.val_period and (step % cfg.val_period == 0 or is_last):
                val = validate(run, step)
            print_step_summary(
                step, cfg.max_num_steps, {**metrics, **{f"val/{k}": v for k, v in val.items()}}
            )
            if run.checkpointer and run.checkpointer.should_save(step, is_last_step=is_last):
                common.save_checkpoint(
                    run.checkpointer,
                    run.reward_model,
                    step,
                    metrics={f"val/{k}": v for k, v in val.items()},
                    dataloader=run.dataloader,
                    config=run.resolved,
                )
    run.final_step = step
    first = first or common.first_logged(run.cfg.logger.log_dir, "val/")  # resumed: records
    return {"steps": step, "start": first, "end": val}


def validate(run: RMRun, step: int) -> dict[str, float]:
    """Held-out pair accuracy (share of pairs scored chosen > rejected), loss and margin."""
    cfg = run.cfg.rm
    half = cfg.val_global_batch_size // 2
    n_pairs = min(len(run.data.val), half * cfg.val_batches) // half * half
    if not n_pairs:
        log.warning(
            "rm validation skipped: %d held-out pairs < rm.val_global_batch_size/2=%d",
            len(run.data.val),
            half,
        )
        return {}
    batch = preference_batch(
        run.data.val[:n_pairs], run.tokenizer, run.cfg.policy.max_total_sequence_length
    )
    m = run.reward_model.train(
        batch,
        eval_mode=True,
        global_batch_size=cfg.val_global_batch_size,
        micro_batch_size=cfg.val_micro_batch_size,
    )
    out = {"accuracy": m["accuracy"], "loss": m["loss"], "margin": m["margin"]}
    run.logger.log_metrics(out, step, prefix="val")
    return out


def export(run: RMRun) -> Path:
    """Write the trained reward model as an HF folder; returns its path."""
    path = Path(run.cfg.rm.export_dir or Path(run.cfg.checkpointing.checkpoint_dir) / "final_hf")
    run.reward_model.export_hf(str(path))
    return path
