"""Kahneman-Tversky Optimisation (Ethayarajh et al. 2024; TRL's KTOTrainer) on FSDP2 workers:
preference learning from unpaired rows, each response labelled desirable or undesirable.

    uv run examples/run_kto.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (rows, Ray cluster, policy with a frozen reference copy, logger,
checkpoints); `train()` is the loop DPO and the reward model run too
(`tempering.algorithms.preference`), with KTO's rows and batches:

  batch of rows (row 2i an example, 2i+1 its KL row: its prompt, another example's response;
  `tempering.data.unpaired.collate_kto`), ONE forward batch
  -> policy.train(KTOLoss, with_reference=True): per micro-batch the frozen reference's
     log-probs, the reference point (the KL rows' mean log-ratio over the micro-batch of every
     rank, clamped at 0, detached) and
     lambda_D (1 - sigmoid(beta (r - kl))) / lambda_U (1 - sigmoid(beta (kl - r)))
  -> log loss, kl, reward accuracy, rewards of desirable / undesirable rows
  -> validate every `kto.val_period` steps -> checkpoint.

The KL rows ride in the training forward (their backward is zeros: the point is detached),
where TRL scores them in passes without gradients. Both measured (2026-12-01, 2 cores): tiny
66 against 78 ms a step (the passes cost a call), SmolLM2 on GSM8K rows 17.1 against 17.8 s
(a row's prompt runs once for it and its KL row, `policy.shared_prefix`); kept in the forward.

Data (`data.dataset_name`): ``unpaired`` files (``{prompt, completion, label}``, TRL's format;
`tempering.data.unpaired`), or any DPO dataset, its pairs unpaired into a desirable and an
undesirable row each -- so ``data.num_train_samples`` and ``num_val_samples`` count pairs
there (twice as many rows). Validation: held-out KTO loss, kl and rewards (the same loss,
`eval_mode`, no update); where the rows came from pairs, also DPO's ``logprob_accuracy`` on the
held-out pairs (chosen more likely than rejected) beside the frozen reference's, and for the
arithmetic data tiny-arith's greedy accuracy (`dpo.greedy_accuracy`).

TRL's guidance on the weights -- ``lambda_D n_D / (lambda_U n_U)`` within [1, 4/3] -- is
checked on the training rows: outside it a warning names the ratio and the weights that
would meet it (``data/desirable_weight_ratio`` is logged).
"""

from __future__ import annotations

import logging
from typing import Any

from tempering.algorithms import common, preference
from tempering.algorithms.dpo import greedy_accuracy, likelihood_preference_accuracy
from tempering.algorithms.preference import PreferenceData, PreferenceRun, preference_batch
from tempering.config.schemas import DataConfig, KTOMasterConfig

log = logging.getLogger(__name__)

VAL_METRICS = (
    "loss",
    "kl",
    "reward_accuracy",
    "rewards_desirable_mean",
    "rewards_undesirable_mean",
)
TRAIN_METRICS = (*VAL_METRICS, "grad_norm", "lr", "tokens_per_s", "num_nonfinite_skipped")
WEIGHT_RATIO_RANGE = (1.0, 4 / 3)  # TRL's: lambda_D n_D / (lambda_U n_U)


# -------------------------------------------------------------------------- data
def load_data(data_cfg: DataConfig) -> PreferenceData:
    """Train/held-out rows: an ``unpaired`` file, or a DPO dataset's pairs unpaired (their
    held-out pairs kept as ``val_pairs``)."""
    from tempering.data.unpaired import load_unpaired_jsonl, unpair

    if data_cfg.dataset_name == "unpaired":
        return preference.load_data_files(
            data_cfg,
            lambda path, prompt_key, on_bad_row: load_unpaired_jsonl(
                path, prompt_key, on_bad_row=on_bad_row
            ),
            "rows",
        )
    pairs = preference.load_preference_data(data_cfg)
    return PreferenceData(
        unpair(pairs.train), unpair(pairs.val), pairs.num_skipped, pairs.skipped_reasons,
        pairs.val_problems, val_pairs=pairs.val,
    )  # fmt: skip


def kto_batch(rows: list[Any], tokenizer: Any, max_seq_len: int) -> Any:
    from tempering.data.unpaired import collate_kto

    return collate_kto(rows, tokenizer, max_seq_len)


def weight_ratio(cfg: KTOMasterConfig, rows: list[Any]) -> float:
    """``lambda_D n_D / (lambda_U n_U)`` over ``rows``, warned about outside TRL's [1, 4/3]."""
    n_good = sum(row.desirable for row in rows)
    n_bad = len(rows) - n_good
    kto = cfg.kto
    if not n_good or not n_bad:
        raise ValueError(
            f"the training rows are all {'desirable' if n_good else 'undesirable'} "
            f"({len(rows)} rows): KTO learns from both kinds; add rows of the other label"
        )
    ratio = kto.desirable_weight * n_good / (kto.undesirable_weight * n_bad)
    low, high = WEIGHT_RATIO_RANGE
    if not low <= ratio <= high:
        middle = (low + high) / 2
        log.warning(
            "kto.desirable_weight=%g x %d desirable rows / (kto.undesirable_weight=%g x %d "
            "undesirable rows) = %.2f, outside the [1, 4/3] the KTO paper recommends; "
            "kto.desirable_weight=%.3g would make it %.2f",
            kto.desirable_weight, n_good, kto.undesirable_weight, n_bad, ratio,
            middle * kto.undesirable_weight * n_bad / n_good, middle,
        )  # fmt: skip
    return ratio


# -------------------------------------------------------------------------- setup
def setup(cfg: KTOMasterConfig, resolved: dict[str, Any]) -> PreferenceRun:
    """Rows, tokenizer and cluster (`preference.prepare` with KTO's data and batches), the
    policy with its frozen reference, then checkpoints, logger and monitor."""
    run = preference.prepare(cfg, resolved, "kto", load_data, kto_batch, "rows")
    ratio = weight_ratio(cfg, run.data.train)
    run.model = common.build_policy_from_config(
        cfg.policy,
        run.cluster,
        total_steps=cfg.kto.max_num_steps,
        init_reference_model=True,
        seed=cfg.kto.seed,
    )
    data_metrics = {
        "num_skipped": float(run.data.num_skipped),
        "num_train_rows": float(len(run.data.train)),
        "num_train_desirable": float(sum(row.desirable for row in run.data.train)),
        "num_val_rows": float(len(run.data.val)),
        "desirable_weight_ratio": ratio,
    }
    preference.resume(run, data_metrics, monitored_policy=run.model)
    return run


# --------------------------------------------------------------------------- loop
def make_loss(cfg: KTOMasterConfig) -> Any:
    from tempering.preference_losses import KTOLoss

    return KTOLoss(cfg.kto.beta, cfg.kto.desirable_weight, cfg.kto.undesirable_weight)


def kto_step(
    policy: Any, batch: Any, loss_fn: Any, with_reference: bool = True, **train_kwargs: Any
) -> dict[str, float]:
    """One `policy.train` call with the reference's log-probs (computed per micro-batch, or
    already in ``batch`` without ``with_reference``); the rewards' means per label from the
    loss's exact sums (a label absent from the batch has none)."""
    metrics = policy.train(batch, loss_fn, with_reference=with_reference, **train_kwargs)
    for label in ("desirable", "undesirable"):
        if metrics.get(f"num_{label}"):
            metrics[f"rewards_{label}_mean"] = (
                metrics[f"rewards_{label}_sum"] / metrics[f"num_{label}"]
            )
    return metrics


def train(run: PreferenceRun) -> dict[str, Any]:
    """The KTO loop (`preference.train_loop` with `kto_step`), then the final model
    (`preference.train_policy`'s summary)."""
    return preference.train_policy(run, kto_step, make_loss(run.cfg), validate, TRAIN_METRICS)


def validate(run: PreferenceRun, step: int) -> dict[str, float]:
    """Held-out KTO loss, kl and rewards (no update); the held-out pairs' log-prob accuracy,
    the policy's and the reference's, where the rows came from pairs; greedy accuracy where
    answers are known (arithmetic). The reference's log-probs of both are computed once a run
    (`preference.held_out_reference`)."""
    cfg = run.cfg.kto
    rows = preference.held_out(run)
    max_len = run.cfg.policy.max_total_sequence_length
    batch = kto_batch(rows, run.tokenizer, max_len)
    batch["reference_policy_logprobs"] = preference.held_out_reference(run, batch)
    m = kto_step(
        run.model,
        batch,
        make_loss(run.cfg),
        with_reference=False,
        eval_mode=True,
        global_batch_size=cfg.val_global_batch_size,
        micro_batch_size=cfg.val_micro_batch_size,
    )
    out = {k: m[k] for k in VAL_METRICS if k in m}
    if run.data.val_pairs:
        # the pairs the rows came from (unpair keeps a pair's two rows together, in order)
        pairs = preference_batch(run.data.val_pairs[: len(rows) // 2], run.tokenizer, max_len)
        logprobs = run.model.get_logprobs(pairs)["logprobs"]
        reference = preference.held_out_reference(run, pairs, "pairs")
        out["logprob_accuracy"] = likelihood_preference_accuracy(logprobs, pairs, False)
        out["reference_logprob_accuracy"] = likelihood_preference_accuracy(reference, pairs, False)
    if cfg.val_greedy_accuracy and run.data.val_problems:
        out.update(greedy_accuracy(run))
    run.logger.log_metrics(out, step, prefix="val")
    return out


def report(summary: dict[str, Any], cfg: KTOMasterConfig, task_accuracy: str | None = None) -> str:
    """What a KTO run shows: held-out rewards by label, the reference point and, where the rows
    came from pairs, the pairs' log-prob accuracy beside the reference's; the held-out task
    accuracy when the caller measured it (``task_accuracy``, printed as given)."""
    start, end = summary["start"], summary["end"]

    def fig(key: str) -> str:
        return preference.before_after(start, end, key)

    lines = [
        f"\nKTO done: {summary['steps']} steps; held-out rows:",
        f"  reward accuracy (reward on its label's side of the reference point): "
        f"{fig('reward_accuracy')}",
        f"  rewards, desirable rows: {fig('rewards_desirable_mean')}; undesirable rows: "
        f"{fig('rewards_undesirable_mean')}; reference point (kl): {fig('kl')}",
    ]
    if "logprob_accuracy" in end:
        lines += [
            f"  held-out pairs, policy log-prob accuracy: {fig('logprob_accuracy')} (the frozen "
            f"reference: {end.get('reference_logprob_accuracy', float('nan')):.3f})",
        ]
    if task_accuracy is not None:
        lines.append(task_accuracy)
    lines.append(f"  final model (HF folder): {summary['final_model']}")
    return "\n".join(lines)
