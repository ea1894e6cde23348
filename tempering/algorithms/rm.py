"""Reward-model training: Bradley-Terry loss on a sequence-classification head, FSDP2 workers.

    uv run examples/run_rm.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (preference data, Ray cluster, `RewardModel` workers, logger,
checkpoints); `train()` is the loop DPO runs too (`tempering.algorithms.preference`): batch of
pairs (chosen 2i / rejected 2i+1) -> `reward_model.train` (Bradley-Terry:
-logsigmoid(s_chosen - s_rejected)) -> log -> validate (held-out pair accuracy, loss and
margin, no update) -> checkpoint. `export()` writes an HF folder that
``AutoModelForSequenceClassification.from_pretrained`` loads and that
`tempering.environments.reward_model.RewardModelEnvironment` (GRPO's ``env.reward_model_path``)
serves.

The model is ``AutoModelForSequenceClassification(num_labels=1)`` built from the causal-LM
folder of `policy.model_name` (its score head is new); `policy.*` gives the batch sizes,
optimizer and schedule. Data and its bad-row handling are DPO's
(`preference.load_preference_data`); the default arithmetic pairs are SYNTHETIC (correct
answer vs corrupted number).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tempering.algorithms import common, preference
from tempering.algorithms.preference import PreferenceRun, preference_batch
from tempering.config.schemas import RMMasterConfig

TRAIN_METRICS = (
    "loss",
    "accuracy",
    "margin",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "num_nonfinite_skipped",
)


# -------------------------------------------------------------------------- setup
def setup(cfg: RMMasterConfig, resolved: dict[str, Any]) -> PreferenceRun:
    """Pairs, tokenizer and cluster (`preference.prepare`), the `RewardModel` workers, then
    checkpoints, logger and monitor (`preference.resume`)."""
    from tempering.data.collate import pad_token_id_of
    from tempering.models.policy.reward_model import RewardModel

    run = preference.prepare(cfg, resolved, "rm")
    run.model = RewardModel(
        common.build_policy_from_config(
            cfg.policy,
            run.cluster,
            total_steps=cfg.rm.max_num_steps,
            seed=cfg.rm.seed,
            name_prefix="reward_model",
            head="score",
            pad_token_id=pad_token_id_of(run.tokenizer),
        )
    )
    data_metrics = {"num_skipped": float(run.data.num_skipped)}
    preference.resume(run, data_metrics, monitored_policy=run.model.policy)
    return run


# --------------------------------------------------------------------------- loop
def train(run: PreferenceRun) -> dict[str, Any]:
    """The reward-model loop (`preference.train_loop` with `RewardModel.train`).
    Returns {"steps", "start": first val, "end": last val}."""
    step, first, val = preference.train_loop(run, run.model.train, validate, TRAIN_METRICS)
    return {"steps": step, "start": first, "end": val}


def validate(run: PreferenceRun, step: int) -> dict[str, float]:
    """Held-out pair accuracy (share of pairs scored chosen > rejected), loss and margin."""
    cfg = run.cfg.rm
    batch = preference_batch(
        preference.held_out(run), run.tokenizer, run.cfg.policy.max_total_sequence_length
    )
    m = run.model.train(
        batch,
        eval_mode=True,
        global_batch_size=cfg.val_global_batch_size,
        micro_batch_size=cfg.val_micro_batch_size,
    )
    out = {"accuracy": m["accuracy"], "loss": m["loss"], "margin": m["margin"]}
    run.logger.log_metrics(out, step, prefix="val")
    return out


def export(run: PreferenceRun) -> Path:
    """Write the trained reward model as an HF folder; returns its path."""
    path = Path(run.cfg.rm.export_dir or Path(run.cfg.checkpointing.checkpoint_dir) / "final_hf")
    run.model.export_hf(str(path))
    return path
