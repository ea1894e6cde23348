"""What DPO, KTO and the reward model share: preference pairs, the run they build and the
training loop they call (KTO brings its own rows and batches: `prepare`'s ``load`` and
``collate``).

    pairs (chosen 2i / rejected 2i+1 interleaved) -> prepare() -> the algorithm builds its
    model -> resume() -> train_loop(step, validate) -> the algorithm's own ending

`algorithms/dpo.py` and `algorithms/rm.py` keep what differs -- which model trains, its step,
its validation and what a run ends with; this module holds the mechanism they run the same
way: the data (`load_preference_data`, `preference_batch`, `preference_loader`, the
batch-size rule), the `PreferenceRun` they hold and the step loop (validate at start, train,
log, validate every `val_period` steps, checkpoint).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tempering.algorithms import common
from tempering.config.schemas import GENERATED_TRAIN_SAMPLES, DataConfig
from tempering.data.records import data_source, first_n


# --------------------------------------------------------------------------- data
@dataclass
class PreferenceData:
    train: list[Any]  # PreferencePair (KTO: UnpairedExample)
    val: list[Any]
    num_skipped: int = 0  # bad rows skipped with data.on_bad_row=skip
    skipped_reasons: list[str] = field(default_factory=list)  # "file:line: why"
    val_problems: list[dict[str, str]] = field(default_factory=list)  # {"prompt", "answer"}
    val_pairs: list[Any] = field(default_factory=list)  # KTO: the held-out pairs it unpaired


def load_preference_data(data_cfg: DataConfig) -> PreferenceData:
    """Train/held-out preference pairs for `data.dataset_name` (shared by DPO and RM).

    Synthetic "arithmetic" (default) and "gsm8k", or a local file format; a bad row raises
    `DataFormatError` naming file and line, or is skipped and counted (`data.on_bad_row`).
    """
    from tempering.data import preference_datasets as pd

    name = data_cfg.dataset_name
    if name in ("arithmetic", "arithmetic_parity"):
        from tempering.models.tiny_arith import make_problems

        make = (
            pd.arithmetic_preference_pairs if name == "arithmetic" else pd.arithmetic_parity_pairs
        )
        return PreferenceData(
            make(data_cfg.num_train_samples or GENERATED_TRAIN_SAMPLES, data_cfg.seed).examples,
            make(data_cfg.num_val_samples, data_cfg.seed, "test").examples,
            val_problems=make_problems(data_cfg.num_val_samples, data_cfg.seed, "test"),
        )
    if name == "gsm8k":
        train, val = pd.load_preference_splits("gsm8k", num_val=data_cfg.num_val_samples)
        source = data_source(data_cfg.train_data_path, name)
        return PreferenceData(first_n(train, data_cfg.num_train_samples, source, "pairs"), val)
    if name not in pd.PREFERENCE_LOADERS:
        raise ValueError(
            f"data.dataset_name={name!r} is not a preference dataset; use arithmetic, "
            "arithmetic_parity, gsm8k or "
            f"one of {sorted(pd.PREFERENCE_LOADERS)} with data.train_data_path"
        )
    return load_data_files(data_cfg, pd.PREFERENCE_LOADERS[name], "pairs")


def load_data_files(data_cfg: DataConfig, load: Callable[..., Any], unit: str) -> PreferenceData:
    """Train/held-out examples from ``data.train_data_path`` (and ``val_data_path``, else
    ``num_val_samples`` held out of the training file) by ``load(path, prompt_key,
    on_bad_row)``; ``unit`` names the examples (pairs, rows) in messages."""
    from tempering.data.records import hold_out

    source = data_source(data_cfg.train_data_path, data_cfg.dataset_name)
    if not data_cfg.train_data_path:
        raise ValueError(
            f"data.dataset_name={data_cfg.dataset_name!r} needs data.train_data_path=<data "
            "file: JSONL, JSON, Parquet or CSV>"
        )
    loaded = [load(data_cfg.train_data_path, data_cfg.prompt_key, data_cfg.on_bad_row)]
    if data_cfg.val_data_path:
        loaded.append(load(data_cfg.val_data_path, data_cfg.prompt_key, data_cfg.on_bad_row))
        train, val = loaded[0].examples, loaded[1].examples
    else:
        train, val = hold_out(
            loaded[0].examples, data_cfg.num_val_samples, data_cfg.seed, source, unit
        )
    reasons = [r for d in loaded for r in d.skipped_reasons]
    if not train or not val:
        raise ValueError(
            f"{data_cfg.train_data_path}: {len(train)} train / {len(val)} validation {unit} "
            f"left after skipping {len(reasons)} bad row(s); training needs both"
        )
    train = first_n(train, data_cfg.num_train_samples, source, unit)
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
    source: str = "the preference pairs",
    collate: Callable[[Any, Any, int], Any] = preference_batch,
) -> Any:
    """A `StatefulDataLoader` of `preference_batch`es (or ``collate``'s), ``batch_rows // 2``
    pairs each (the policy counts rows), that tokenizes the next batch in a background thread
    while the workers train. The thread gets its own copy of ``tokenizer``: HF fast tokenizers
    are not safe to call from two threads, and the caller keeps using its own."""
    from tempering.data.dataloader import StatefulDataLoader

    own = copy.deepcopy(tokenizer)
    return StatefulDataLoader(
        pairs,
        batch_rows // 2,
        shuffle=shuffle,
        seed=seed,
        collate_fn=lambda chunk: collate(chunk, own, max_seq_len),
        prefetch=True,
        batch_key="policy.train_global_batch_size",  # rows: a pair is two
        source=source,
    )


def check_pair_batch_sizes(
    global_batch_size: int, micro_batch_size: int, dp: int, what: str
) -> None:
    """Rows = 2 x pairs: every rank's share and every micro-batch must hold whole pairs."""
    if global_batch_size % (2 * dp) or micro_batch_size % 2:
        raise ValueError(
            f"{what}: global batch {global_batch_size} rows must be a multiple of 2 x "
            f"data-parallel size ({2 * dp}) and micro batch {micro_batch_size} even; batches "
            "count rows and each chosen/rejected pair (KTO: each row with its KL row) is two"
        )


# --------------------------------------------------------------------------- run
@dataclass
class PreferenceRun:
    """A DPO, KTO or reward-model run: ``model`` is the `Policy` (DPO and KTO, with its frozen
    reference) or the `RewardModel` (RM) that trains, is checkpointed and is freed by `close`."""

    cfg: Any  # DPOMasterConfig | KTOMasterConfig | RMMasterConfig
    resolved: dict[str, Any]
    name: str  # "dpo" | "kto" | "rm": the config section, the cluster's and progress bar's name
    tokenizer: Any
    data: PreferenceData
    dataloader: Any
    cluster: Any
    model: Any = None  # built by the algorithm's setup() between prepare() and resume()
    logger: Any = None
    checkpointer: Any = None
    start_step: int = 0
    final_step: int = 0
    monitor: Any = None  # per-role resource metrics (logger.monitor_gpus)
    generation: Any = None  # DPO, KTO: colocated greedy generation at validation, built once
    val_reference: dict[str, Any] = field(default_factory=dict)  # `held_out_reference`'s

    @property
    def section(self) -> Any:
        """This algorithm's config section: ``cfg.dpo``, ``cfg.kto`` or ``cfg.rm``."""
        return getattr(self.cfg, self.name)

    def close(self) -> None:
        """Free what the run started: logger, model workers, placement groups."""
        self.logger.close()
        self.model.shutdown()
        self.cluster.shutdown()


def held_out(run: PreferenceRun) -> list[Any]:
    """The held-out pairs (KTO: rows) a validation reads: whole batches of half
    ``val_global_batch_size`` (a pair, or a row with its KL row, is two sequences), at most
    ``val_batches`` of them; at least one (fewer are refused at set-up,
    `common.check_validation_batch`)."""
    section = run.section
    n = common.whole_batches(len(run.data.val), section.val_global_batch_size // 2,
                             section.val_batches)  # fmt: skip
    return run.data.val[:n]


def held_out_reference(run: PreferenceRun, batch: Any, key: str = "rows") -> Any:
    """The frozen reference's log-probs of a held-out batch (``[B, S]``), asked of the workers
    at the run's first validation and kept: neither the reference nor the held-out rows change,
    so each later validation runs the policy alone (a resumed run asks once again). ``key``
    names the batch (KTO validates its rows and the pairs they came from)."""
    if key not in run.val_reference:
        out = run.model.get_reference_policy_logprobs(batch)
        run.val_reference[key] = out["reference_policy_logprobs"]
    return run.val_reference[key]


def before_after(start: dict[str, float], end: dict[str, float], key: str) -> str:
    """``key`` at the first and the last validation, as a report prints it ("n/a" if absent)."""
    a, b = start.get(key), end.get(key)
    return f"{'n/a' if a is None else f'{a:.3f}'} -> {'n/a' if b is None else f'{b:.3f}'}"


def prepare(
    cfg: Any,
    resolved: dict[str, Any],
    name: str,
    load: Callable[[DataConfig], PreferenceData] = load_preference_data,
    collate: Callable[[Any, Any, int], Any] = preference_batch,
    unit: str = "pairs",
) -> PreferenceRun:
    """Everything before the model: batch-size checks, the pairs (``load``'s ``unit``), the
    tokenizer, the prefetching loader of ``collate``'s batches, then Ray and the cluster (the
    inputs are good: now the workers)."""
    pol, section = cfg.policy, getattr(cfg, name)  # cfg.dpo | cfg.kto | cfg.rm
    dp = cfg.cluster.num_nodes * (cfg.cluster.gpus_per_node or cfg.cluster.workers_per_node)
    check_pair_batch_sizes(
        pol.train_global_batch_size,
        pol.train_micro_batch_size,
        dp,
        "policy.train_global_batch_size / train_micro_batch_size",
    )
    check_pair_batch_sizes(
        section.val_global_batch_size,
        section.val_micro_batch_size,
        dp,
        f"{name}.val_global_batch_size / val_micro_batch_size",
    )
    common.prepare_run(cfg.deadlines, cfg.logger.log_dir)
    plan = common.plan_run(cfg)
    common.check_resumable(cfg.checkpointing, resolved)
    tokenizer = common.load_run_tokenizer(pol)
    common.check_chat_template(tokenizer, cfg)
    data = load(cfg.data)
    common.check_validation_batch(  # a pair is two sequences of a batch
        len(data.val), section.val_global_batch_size // 2, section.val_batches, name,
        section.val_period, cfg.data, unit,
    )  # fmt: skip
    dataloader = preference_loader(
        data.train,
        pol.train_global_batch_size,
        tokenizer,
        pol.max_total_sequence_length,
        seed=section.seed,
        source=f"the training {unit} "
        f"({data_source(cfg.data.train_data_path, cfg.data.dataset_name)})",
        collate=collate,
    )
    common.start_ray(cfg.cluster)
    cluster = common.build_cluster(plan.policy, cfg.cluster, name)
    return PreferenceRun(cfg, resolved, name, tokenizer, data, dataloader, cluster)


def resume(run: PreferenceRun, data_metrics: dict[str, float], monitored_policy: Any) -> None:
    """Once ``run.model`` is built: checkpoints (resuming from the newest), the logger, the
    ``data/*`` figures and the resource monitor of ``monitored_policy``'s workers."""
    run.checkpointer = common.build_checkpointer(run.cfg.checkpointing)
    run.start_step, _ = common.maybe_resume(
        run.checkpointer, run.model, run.dataloader, run.resolved
    )
    run.logger = common.build_logger(run.cfg.logger, run.resolved, run.start_step)
    run.logger.log_metrics(data_metrics, run.start_step, prefix="data")
    run.monitor = common.build_resource_monitor(run.cfg.logger, policy=monitored_policy)


# -------------------------------------------------------------------------- loop
def train_loop(
    run: PreferenceRun,
    train_step: Callable[[Any], dict[str, float]],
    validate: Callable[[PreferenceRun, int], dict[str, float]],
    train_metrics: tuple[str, ...],
) -> tuple[int, dict[str, float], dict[str, float]]:
    """The loop DPO, KTO and RM share: batch of pairs -> ``train_step`` -> log
    ``train_metrics`` -> validate every ``val_period`` steps -> checkpoint. Returns (last step, first validation
    metrics, last validation metrics); a resumed run's first ones come from its records."""
    from tempering.utils.logger import print_step_summary, track

    cfg = run.section
    first: dict[str, float] = {}
    val: dict[str, float] = {}
    if cfg.val_at_start and cfg.val_period and run.start_step == 0:
        first = val = validate(run, 0)
    common.warn_if_finished(
        run.start_step, cfg.max_num_steps, run.name, run.cfg.checkpointing.checkpoint_dir
    )
    step = run.start_step
    steps = range(run.start_step, cfg.max_num_steps)
    with track(steps, len(steps), run.name) as progress:
        for _ in progress:
            if common.epochs_reached(
                run.dataloader, cfg.max_num_epochs, f"{run.name}.max_num_epochs", step
            ):
                break
            t0 = time.perf_counter()
            metrics = train_step(run.dataloader.next_batch())
            step += 1
            step_s = time.perf_counter() - t0
            run.logger.log_metrics(
                {k: metrics[k] for k in train_metrics if k in metrics}, step, prefix="train"
            )
            run.logger.log_metrics({"step_s": step_s}, step, prefix="timing")
            common.log_resources(run.monitor, run.logger, step)
            is_last = (
                step == cfg.max_num_steps or run.dataloader.epochs_completed >= cfg.max_num_epochs
            )
            if cfg.val_period and (step % cfg.val_period == 0 or is_last):
                val = validate(run, step)
            val_metrics = {f"val/{k}": v for k, v in val.items()}
            print_step_summary(step, cfg.max_num_steps, {**metrics, **val_metrics})
            if run.checkpointer and run.checkpointer.should_save(step, is_last_step=is_last):
                common.save_checkpoint(run, run.model, step, val)
    run.final_step = step
    first = first or common.first_logged(run.cfg.logger.log_dir, "val/")  # resumed: records
    if step == run.start_step:  # nothing left to do: the checkpoint's validation is the last
        val = val or common.resumed_val(run.checkpointer, step)
    return step, first, val


def train_policy(
    run: PreferenceRun,
    step_fn: Callable[[Any, Any, Any], dict[str, float]],
    loss_fn: Any,
    validate: Callable[[PreferenceRun, int], dict[str, float]],
    train_metrics: tuple[str, ...],
) -> dict[str, Any]:
    """DPO's and KTO's whole training: `train_loop` with ``step_fn(run.model, batch,
    loss_fn)`` a step, then the final model. Returns {"steps", "start": first val metrics,
    "end": last val metrics, "final_model"}."""
    step, first, val = train_loop(
        run, lambda batch: step_fn(run.model, batch, loss_fn), validate, train_metrics
    )
    final = common.export_final_model(
        run.model, run.cfg.checkpointing, run.cfg.policy.dtensor_cfg.lora_cfg.enabled
    )
    return {"steps": step, "start": first, "end": val, "final_model": str(final)}
