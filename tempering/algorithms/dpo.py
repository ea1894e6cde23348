"""Direct Preference Optimisation (sigmoid DPO) on FSDP2 workers.

    uv run examples/run_dpo.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (preference data, Ray cluster, policy with a frozen reference
copy, logger, checkpoints) from the config; `train()` is the loop:

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

import copy
import logging
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tempering.algorithms import common
from tempering.config.schemas import DataConfig, DPOMasterConfig

log = logging.getLogger(__name__)

TRAIN_METRICS = (
    "reference_logprob_accuracy",
    "loss",
    "preference_loss",
    "sft_loss",
    "preference_accuracy",
    "reward_margin",
    "rewards_chosen_mean",
    "rewards_rejected_mean",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "num_nonfinite_skipped",
)
VAL_METRICS = (
    "loss",
    "preference_loss",
    "sft_loss",
    "preference_accuracy",
    "reward_margin",
    "rewards_chosen_mean",
    "rewards_rejected_mean",
)


# --------------------------------------------------------------------------- data
@dataclass
class PreferenceData:
    train: list[Any]  # PreferencePair
    val: list[Any]
    num_skipped: int = 0  # bad rows skipped with data.on_bad_row=skip
    skipped_reasons: list[str] = field(default_factory=list)  # "file:line: why"
    val_problems: list[dict[str, str]] = field(default_factory=list)  # {"prompt", "answer"}


def load_preference_data(data_cfg: DataConfig) -> PreferenceData:
    """Train/held-out preference pairs for `data.dataset_name` (shared by DPO and RM).

    Synthetic "arithmetic" (default) and "gsm8k", or a local file format; a bad row raises
    `DataFormatError` naming file and line, or is skipped and counted (`data.on_bad_row`).
    """
    from tempering.data import preference_datasets as pd
    from tempering.data.records import split_off_val

    name = data_cfg.dataset_name
    if name in ("arithmetic", "arithmetic_parity"):
        from tempering.models.tiny_arith import make_problems

        make = (
            pd.arithmetic_preference_pairs if name == "arithmetic" else pd.arithmetic_parity_pairs
        )
        return PreferenceData(
            make(data_cfg.num_train_samples, data_cfg.seed).examples,
            make(data_cfg.num_val_samples, data_cfg.seed, "test").examples,
            val_problems=make_problems(data_cfg.num_val_samples, data_cfg.seed, "test"),
        )
    if name == "gsm8k":
        train, val = pd.load_preference_splits("gsm8k", num_val=data_cfg.num_val_samples)
        return PreferenceData(train, val)
    if name not in pd.PREFERENCE_LOADERS:
        raise ValueError(
            f"data.dataset_name={name!r} is not a preference dataset; use arithmetic, "
            "arithmetic_parity, gsm8k or "
            f"one of {sorted(pd.PREFERENCE_LOADERS)} with data.train_data_path"
        )
    if not data_cfg.train_data_path:
        raise ValueError(f"data.dataset_name={name!r} needs data.train_data_path=<jsonl file>")
    load = pd.PREFERENCE_LOADERS[name]
    loaded = [load(data_cfg.train_data_path, data_cfg.on_bad_row)]
    if data_cfg.val_data_path:
        loaded.append(load(data_cfg.val_data_path, data_cfg.on_bad_row))
        train, val = loaded[0].examples, loaded[1].examples
    else:
        held = min(data_cfg.num_val_samples, len(loaded[0]) // 2)
        train, val = split_off_val(loaded[0].examples, held, data_cfg.seed)
    reasons = [r for d in loaded for r in d.skipped_reasons]
    if not train or not val:
        raise ValueError(
            f"{data_cfg.train_data_path}: {len(train)} train / {len(val)} validation pairs left "
            f"after skipping {len(reasons)} bad row(s); DPO/RM need both"
        )
    return PreferenceData(train, val, sum(d.num_skipped for d in loaded), reasons)


def preference_batch(pairs: list[Any], tokenizer: Any, max_seq_len: int) -> Any:
    """Tokenized, interleaved batch (`collate_preference`) of `len(pairs) * 2` rows."""
    from tempering.data.collate import collate_preference

    return collate_preference(pairs, tokenizer, max_seq_len)


def preference_loader(
    pairs: Any,
    batch_rows: int,
    tokenizer: Any,
    max_seq_len: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
) -> Any:
    """A `StatefulDataLoader` of `preference_batch`es, ``batch_rows // 2`` pairs each (the
    policy counts rows), that tokenizes the next batch in a background thread while the
    workers train. The thread gets its own copy of ``tokenizer``: HF fast tokenizers are not
    safe to call from two threads, and the caller keeps using its own."""
    from tempering.data.dataloader import StatefulDataLoader

    own = copy.deepcopy(tokenizer)
    return StatefulDataLoader(
        pairs,
        batch_rows // 2,
        shuffle=shuffle,
        seed=seed,
        collate_fn=lambda chunk: preference_batch(chunk, own, max_seq_len),
        prefetch=True,
    )


def check_pair_batch_sizes(
    global_batch_size: int, micro_batch_size: int, dp: int, what: str
) -> None:
    """Rows = 2 x pairs: every rank's share and every micro-batch must hold whole pairs."""
    if global_batch_size % (2 * dp) or micro_batch_size % 2:
        raise ValueError(
            f"{what}: global batch {global_batch_size} rows must be a multiple of 2 x "
            f"data-parallel size ({2 * dp}) and micro batch {micro_batch_size} even; batches "
            "count rows and each chosen/rejected pair is two rows"
        )


# -------------------------------------------------------------------------- setup
@dataclass
class DPORun:
    cfg: DPOMasterConfig
    resolved: dict[str, Any]
    tokenizer: Any
    data: PreferenceData
    dataloader: Any
    policy: Any
    cluster: Any
    logger: Any
    checkpointer: Any
    start_step: int
    final_step: int = 0
    generation: Any = None  # colocated greedy generation for validation, built on first use
    monitor: Any = None  # per-role resource metrics (logger.monitor_gpus)

    def close(self) -> None:
        """Free what the run started: logger, policy workers, placement groups."""
        self.logger.close()
        self.policy.shutdown()
        self.cluster.shutdown()


def setup(cfg: DPOMasterConfig, resolved: dict[str, Any]) -> DPORun:
    pol = cfg.policy
    dp = cfg.cluster.num_nodes * (cfg.cluster.gpus_per_node or cfg.cluster.workers_per_node)
    check_pair_batch_sizes(
        pol.train_global_batch_size,
        pol.train_micro_batch_size,
        dp,
        "policy.train_global_batch_size / train_micro_batch_size",
    )
    check_pair_batch_sizes(
        cfg.dpo.val_global_batch_size,
        cfg.dpo.val_micro_batch_size,
        dp,
        "dpo.val_global_batch_size / val_micro_batch_size",
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
        seed=cfg.dpo.seed,
    )
    common.start_ray(cfg.cluster)  # the inputs are good: now the workers
    cluster = common.build_cluster(plan.policy, cfg.cluster, "dpo")
    policy = common.build_policy_from_config(
        pol,
        cluster,
        total_steps=cfg.dpo.max_num_steps,
        init_reference_model=True,
        seed=cfg.dpo.seed,
    )
    checkpointer = common.build_checkpointer(cfg.checkpointing)
    start_step, _ = common.maybe_resume(checkpointer, policy, dataloader)
    logger = common.build_logger(cfg.logger, resolved, start_step)
    logger.log_metrics(
        {
            "num_skipped": float(data.num_skipped),
            "num_train_pairs": float(len(data.train)),
            "num_val_pairs": float(len(data.val)),
        },
        start_step,
        prefix="data",
    )
    return DPORun(
        cfg,
        resolved,
        tokenizer,
        data,
        dataloader,
        policy,
        cluster,
        logger,
        checkpointer,
        start_step,
        monitor=common.build_resource_monitor(cfg.logger, policy=policy),
    )


# --------------------------------------------------------------------------- loop
def make_loss(cfg: DPOMasterConfig) -> Any:
    from tempering.losses import DPOLoss

    return DPOLoss(
        reference_policy_kl_penalty=cfg.dpo.reference_policy_kl_penalty,
        preference_average_log_probs=cfg.dpo.preference_average_log_probs,
        sft_loss_weight=cfg.dpo.sft_loss_weight,
    )


def dpo_step(policy: Any, batch: Any, loss_fn: Any, **train_kwargs: Any) -> dict[str, float]:
    """One `policy.train` call; the workers compute the reference log-probs per micro-batch
    (the metrics' ``reference_logprob_accuracy`` reads them)."""
    return policy.train(batch, loss_fn, with_reference=True, **train_kwargs)


def train(run: DPORun) -> dict[str, Any]:
    """The DPO loop. Returns {"steps", "start": first val metrics, "end": last val metrics}."""
    from tempering.utils.logger import print_step_summary, track

    cfg = run.cfg.dpo
    loss_fn = make_loss(run.cfg)
    first: dict[str, float] = {}
    val: dict[str, float] = {}
    if cfg.val_at_start and cfg.val_period and run.start_step == 0:
        first = val = validate(run, step=0)
    step = run.start_step
    steps = range(run.start_step, cfg.max_num_steps)
    with track(steps, len(steps), "dpo") as progress:
        for _ in progress:
            if run.dataloader.epoch >= cfg.max_num_epochs:
                break
            t0 = time.perf_counter()
            batch = run.dataloader.next_batch()
            metrics = dpo_step(run.policy, batch, loss_fn)
            step += 1
            step_s = time.perf_counter() - t0
            run.logger.log_metrics(
                {k: metrics[k] for k in TRAIN_METRICS if k in metrics}, step, prefix="train"
            )
            run.logger.log_metrics({"step_s": step_s}, step, prefix="timing")
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
                    run.policy,
                    step,
                    metrics={f"val/{k}": v for k, v in val.items()},
                    dataloader=run.dataloader,
                    config=run.resolved,
                )
    run.final_step = step
    final = common.export_final_model(run.policy, run.cfg.checkpointing)
    first = first or common.first_logged(run.cfg.logger.log_dir, "val/")  # resumed: records
    return {"steps": step, "start": first, "end": val, "final_model": str(final)}


def validate(run: DPORun, step: int) -> dict[str, float]:
    """Held-out DPO loss and preference accuracy (no update) and, where answers are known
    (arithmetic), greedy accuracy."""
    cfg = run.cfg.dpo
    gbs = cfg.val_global_batch_size
    n_pairs = min(len(run.data.val), gbs // 2 * cfg.val_batches) // (gbs // 2) * (gbs // 2)
    out: dict[str, float] = {}
    if n_pairs:
        batch = preference_batch(
            run.data.val[:n_pairs], run.tokenizer, run.cfg.policy.max_total_sequence_length
        )
        m = dpo_step(
            run.policy,
            batch,
            make_loss(run.cfg),
            eval_mode=True,
            global_batch_size=gbs,
            micro_batch_size=cfg.val_micro_batch_size,
        )
        out.update({k: m[k] for k in VAL_METRICS if k in m})
        logprobs = run.policy.get_logprobs(batch)["logprobs"]
        out["logprob_accuracy"] = likelihood_preference_accuracy(
            logprobs, batch, cfg.preference_average_log_probs
        )
        # what the reference already ranks right: the floor preference learning starts from
        out["reference_logprob_accuracy"] = m["reference_logprob_accuracy"]
    else:
        log.warning(
            "dpo validation skipped: %d held-out pairs < dpo.val_global_batch_size/2=%d",
            len(run.data.val),
            gbs // 2,
        )
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


def greedy_accuracy(run: DPORun) -> dict[str, float]:
    """tiny-arith greedy exact-match accuracy on the held-out problems.

    In the policy workers (a colocated torch engine, refitted with the current weights) when
    the policy supports it; otherwise through an exported HF copy."""
    problems = run.data.val_problems
    if not hasattr(run.policy, "init_colocated_generation"):
        return {
            "greedy_accuracy": exported_greedy_accuracy(run.policy, problems),
            "greedy_via_export": 1.0,
        }
    from tempering.algorithms import sft
    from tempering.environments.arithmetic import first_integer
    from tempering.models.generation.builders import ColocatedGeneration, sampling_from_config

    if run.generation is None:  # built on first use; later calls copy the new weights in
        sampling = sampling_from_config(run.cfg.policy.generation, run.tokenizer)
        run.generation = ColocatedGeneration(run.policy, sampling)
    else:
        run.generation.refit(run.policy)

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
        a, b = start.get(key), end.get(key)
        return f"{'n/a' if a is None else f'{a:.3f}'} -> {'n/a' if b is None else f'{b:.3f}'}"

    lines = [
        f"\nDPO done: {summary['steps']} steps; held-out pairs:",
        f"  reference log-prob accuracy (what the frozen reference already ranks right): "
        f"{end.get('reference_logprob_accuracy', float('nan')):.3f}",
        f"  policy log-prob accuracy: {fig('logprob_accuracy')}",
        f"  implicit-reward preference accuracy: {fig('preference_accuracy')} (0 at the start by "
        "construction: the policy is the reference)",
    ]
    if task_accuracy is not None:
        lines.append(task_accuracy)
    lines.append(f"  final model (HF folder): {summary['final_model']}")
    return "\n".join(lines)
