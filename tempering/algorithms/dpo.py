"""Direct Preference Optimisation on FSDP2 workers (`dpo.loss_type`: sigmoid, hinge, IPO,
robust; `dpo.label_smoothing` for conservative DPO; reference-free SimPO, which builds no
reference model).

    uv run examples/run_dpo.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (preference data, Ray cluster, policy with a frozen reference
copy, logger, checkpoints) from the config; `train()` is the loop, the one the reward model
runs too (`tempering.algorithms.preference`, with the pair data and the run both use):

  batch of pairs (chosen 2i / rejected 2i+1 interleaved, ONE forward batch)
  -> policy.train(DPOLoss, with_reference=True): per micro-batch, the frozen reference's
     log-probs (no gradients), then the policy's forward/backward, in ONE worker call
     (beta = dpo.reference_policy_kl_penalty, + sft_loss_weight * NLL(chosen))
  -> log loss, preference accuracy, reward margin, chosen/rejected rewards
  -> validate every `dpo.val_period` steps -> checkpoint.

Validation: held-out preference loss/accuracy (the same loss, `eval_mode`, no update) and,
for the arithmetic data, tiny-arith's greedy accuracy, so a run shows that DPO does not
collapse generation. Greedy accuracy runs in the policy workers (a colocated torch engine,
refitted with the current weights before each validation) when the policy has
`init_colocated_generation`, otherwise on an exported HF copy with
`tempering.models.tiny_arith.greedy_accuracy` (the metric `val/greedy_via_export` says
which: 1.0 = export). `val/logprob_accuracy` is the share of held-out pairs whose chosen
response the policy itself finds more likely; unlike DPO's implicit-reward
`val/preference_accuracy` (0 at step 0, where policy == reference) it is meaningful at start.
`val/reference_logprob_accuracy` (and `train/...`) is the same for the frozen reference: the
share of pairs a run gets right without learning anything. Report preference learning against
it: the default arithmetic pairs start at ~0.96 there (the reference already prefers correct
answers), the `arithmetic_parity` pairs (dpo_parity.yaml) near chance.

Default data (`data.dataset_name=arithmetic`) is SYNTHETIC: tiny-arith problems with the
correct answer as chosen and the same answer with its number corrupted as rejected
(`tempering.data.preference_datasets.arithmetic_preference_pairs`); they are not human
preferences. Files: `data.dataset_name` = preference | helpsteer3 | messages_preference with
`data.train_data_path` (bad rows raise, or are skipped and counted with `data.on_bad_row=skip`;
the count is logged as `data/num_skipped`).
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from tempering.algorithms import common, preference
from tempering.algorithms.preference import PreferenceRun, preference_batch
from tempering.config.schemas import DPOMasterConfig

log = logging.getLogger(__name__)

VAL_METRICS = (
    "loss",
    "preference_loss",
    "sft_loss",
    "preference_accuracy",
    "reward_margin",
    "rewards_chosen_mean",
    "rewards_rejected_mean",
    "log_odds_ratio",  # ORPO's only
    "logprob_accuracy",
    "reference_logprob_accuracy",  # not SimPO's or ORPO's (no reference)
)
TRAIN_METRICS = (
    *VAL_METRICS,
    "grad_norm",
    "lr",
    "tokens_per_s",
    "num_nonfinite_skipped",
)


# -------------------------------------------------------------------------- setup
def setup(cfg: DPOMasterConfig, resolved: dict[str, Any]) -> PreferenceRun:
    """Pairs, tokenizer and cluster (`preference.prepare`), the policy with its frozen
    reference, then checkpoints, logger and monitor (`preference.resume`)."""
    run = preference.prepare(cfg, resolved, "dpo")
    run.model = common.build_policy_from_config(
        cfg.policy,
        run.cluster,
        total_steps=cfg.dpo.max_num_steps,
        init_reference_model=not cfg.dpo.reference_free,
        seed=cfg.dpo.seed,
    )
    data_metrics = {
        "num_skipped": float(run.data.num_skipped),
        "num_train_pairs": float(len(run.data.train)),
        "num_val_pairs": float(len(run.data.val)),
    }
    preference.resume(run, data_metrics, monitored_policy=run.model)
    return run


# --------------------------------------------------------------------------- loop
def make_loss(cfg: DPOMasterConfig) -> Any:
    from tempering.preference_losses import DPOLoss

    return DPOLoss(
        reference_policy_kl_penalty=cfg.dpo.reference_policy_kl_penalty,
        preference_average_log_probs=cfg.dpo.preference_average_log_probs,
        sft_loss_weight=cfg.dpo.sft_loss_weight,
        preference_loss_type=cfg.dpo.loss_type,
        label_smoothing=cfg.dpo.label_smoothing,
        simpo_gamma=cfg.dpo.simpo_gamma,
    )


def dpo_step(policy: Any, batch: Any, loss_fn: Any, **train_kwargs: Any) -> dict[str, float]:
    """One `policy.train` call; the workers compute the reference log-probs per micro-batch
    (the metrics' ``reference_logprob_accuracy`` reads them) unless the loss is
    reference-free (SimPO)."""
    return policy.train(batch, loss_fn, with_reference=loss_fn.needs_reference, **train_kwargs)


def train(run: PreferenceRun) -> dict[str, Any]:
    """The DPO loop (`preference.train_loop` with `dpo_step`), then the final model
    (`preference.train_policy`'s summary)."""
    return preference.train_policy(run, dpo_step, make_loss(run.cfg), validate, TRAIN_METRICS)


def validate(run: PreferenceRun, step: int) -> dict[str, float]:
    """Held-out DPO loss and preference accuracy (no update; the reference's log-probs of the
    held-out pairs computed once a run, `preference.held_out_reference`) and, where answers
    are known (arithmetic), greedy accuracy."""
    cfg = run.cfg.dpo
    batch = preference_batch(
        preference.held_out(run), run.tokenizer, run.cfg.policy.max_total_sequence_length
    )
    loss_fn = make_loss(run.cfg)
    if loss_fn.needs_reference:
        batch["reference_policy_logprobs"] = preference.held_out_reference(run, batch)
    m = run.model.train(
        batch,
        loss_fn,
        eval_mode=True,
        global_batch_size=cfg.val_global_batch_size,
        micro_batch_size=cfg.val_micro_batch_size,
    )
    # logprob_accuracy: the policy's own ranking, meaningful at step 0 (unlike the implicit
    # reward's); reference_logprob_accuracy: what the reference already ranks right, the
    # floor preference learning starts from (none without a reference: SimPO's start is the
    # policy's own)
    out = {k: m[k] for k in VAL_METRICS if k in m}
    if cfg.val_greedy_accuracy and run.data.val_problems:
        out.update(greedy_accuracy(run))
    run.logger.log_metrics(out, step, prefix="val")
    return out


def likelihood_preference_accuracy(logprobs: Any, batch: Any, average: bool) -> float:
    """Share of valid pairs whose chosen response the policy itself finds more likely than the
    rejected one (sum, or mean with `average`, of response-token log-probs).

    Unlike DPO's implicit-reward accuracy (``preference_accuracy``: reward = beta * (logp -
    logp_ref), so exactly 0 for every pair while the policy equals its reference), this is
    meaningful at step 0 too."""
    mask = batch["token_mask"].float()
    seq = (logprobs * mask).sum(-1)
    if average:
        seq = seq / mask.sum(-1).clamp(min=1)
    valid = batch["sample_mask"][0::2] * batch["sample_mask"][1::2]
    wins = (seq[0::2] > seq[1::2]).float()
    return float((wins * valid).sum() / valid.sum().clamp(min=1))


def greedy_accuracy(run: PreferenceRun) -> dict[str, float]:
    """tiny-arith greedy exact-match accuracy on the held-out problems.

    In the policy workers (a colocated torch engine, refitted with the current weights) when
    the policy supports it; otherwise through an exported HF copy."""
    problems = run.data.val_problems
    if not hasattr(run.model, "init_colocated_generation"):
        return {
            "greedy_accuracy": exported_greedy_accuracy(run.model, problems),
            "greedy_via_export": 1.0,
        }
    from tempering.algorithms import sft
    from tempering.environments.arithmetic import first_integer
    from tempering.models.generation.builders import ColocatedGeneration, sampling_from_config

    if run.generation is None:  # built on first use; later calls copy the new weights in
        gen = run.cfg.policy.generation
        sampling = sampling_from_config(gen, run.tokenizer)
        run.generation = ColocatedGeneration(run.model, sampling, gen.torch_dtype_name)
    else:
        run.generation.refit(run.model)

    def checker(completion: str, answer: str) -> bool:
        got = first_integer(completion)
        return got is not None and str(got) == answer

    acc, _ = sft.greedy_accuracy(
        run.generation,
        run.tokenizer,
        problems,
        checker,
        use_chat_template=run.cfg.data.use_chat_template,
    )
    return {"greedy_accuracy": acc, "greedy_via_export": 0.0}


def exported_greedy_accuracy(policy: Any, problems: list[dict[str, str]]) -> float:
    """Export the policy to a temporary HF folder and score it with tiny_arith.greedy_accuracy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.models import tiny_arith

    with tempfile.TemporaryDirectory(prefix="dpo_val_") as tmp:
        policy.export_hf(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    return tiny_arith.greedy_accuracy(model, tokenizer, problems)


def report(summary: dict[str, Any], cfg: DPOMasterConfig, task_accuracy: str | None = None) -> str:
    """What a DPO run shows: preference figures next to the reference's and, when the caller
    measured it (``examples/run_dpo.py``: tiny-arith data, through `tempering eval`), the
    held-out task accuracy before and after (``task_accuracy``, printed as given)."""
    start, end = summary["start"], summary["end"]

    def fig(key: str) -> str:
        return preference.before_after(start, end, key)

    lines = [f"\nDPO done: {summary['steps']} steps; held-out pairs:"]
    if cfg.dpo.reference_free:
        lines += [
            f"  policy log-prob accuracy: {fig('logprob_accuracy')} (no reference model: "
            f"dpo.loss_type={cfg.dpo.loss_type}; its start is what the model already ranks right)",
            f"  reward preference accuracy (mean log-probs): {fig('preference_accuracy')}",
        ]
    else:
        lines += [
            f"  reference log-prob accuracy (what the frozen reference already ranks right): "
            f"{end.get('reference_logprob_accuracy', float('nan')):.3f}",
            f"  policy log-prob accuracy: {fig('logprob_accuracy')}",
            f"  implicit-reward preference accuracy: {fig('preference_accuracy')} (0 at the start "
            "by construction: the policy is the reference)",
        ]
    if task_accuracy is not None:
        lines.append(task_accuracy)
    lines.append(f"  final model (HF folder): {summary['final_model']}")
    return "\n".join(lines)
