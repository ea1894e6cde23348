"""What every algorithm's `setup()` does the same way: turn config sections into plain
arguments for the logger, the Ray cluster, the policy and the checkpoint manager, and resume.

Each builder takes a config section and returns a library object; library classes never see
the config itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tempering.config.schemas import (
    CheckpointingConfig,
    ClusterConfig,
    DeadlinesConfig,
    LoggerConfig,
    PolicyConfig,
)
from tempering.errors import UserInputError

log = logging.getLogger(__name__)
A = TypeVar("A")
B = TypeVar("B")

_OPTIMIZERS = {
    "torch.optim.AdamW": "adamw",
    "adamw": "adamw",
    "torch.optim.SGD": "sgd",
    "sgd": "sgd",
}


def prepare_run(deadlines_cfg: DeadlinesConfig | None = None, log_dir: str | None = None) -> None:
    """Everything before Ray: version check (containers), quiet logging, per-phase deadlines
    (workers dump their stacks into ``<log_dir>/stacks`` when one expires). A setup() then
    resolves the model and reads its data -- so a user's mistake there fails in seconds,
    before any worker starts -- and calls :func:`start_ray`. Cheap to call twice."""
    from tempering.distributed import deadlines
    from tempering.distributed.fingerprint import check_container_fingerprint

    deadlines.configure(
        (deadlines_cfg or DeadlinesConfig()).as_phases(),
        stack_dump_dir=str(Path(log_dir) / "stacks") if log_dir else None,
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check_container_fingerprint()


def whole_batches(count: int, per_batch: int, batches: int) -> int:
    """How many of ``count`` examples a validation of at most ``batches`` whole batches of
    ``per_batch`` reads."""
    return min(count, per_batch * batches) // per_batch * per_batch


def check_validation_batch(
    count: int,
    per_batch: int,
    val_batches: int,
    section: str,
    val_period: int,
    data_cfg: Any,
    unit: str,
) -> None:
    """Before Ray: validation data smaller than one validation batch would never validate
    (SFT skipped it without a word, DPO/RM warned at every validation); refuse it with the
    fix. A validation that reads only part of the data (``val_batches`` whole batches) says
    so once. Nothing to check when ``val_period`` is 0 (no validation)."""
    from tempering.data.dataloader import DatasetTooSmallError

    if not val_period:
        return
    read = whole_batches(count, per_batch, val_batches)
    if per_batch <= count != read:
        log.warning(
            "each validation reads %d of the %d held-out %s (%s.val_batches=%d whole batches "
            "of %d); raise %s.val_batches or fit the batch size to read them all",
            read, count, unit, section, val_batches, per_batch, section,
        )  # fmt: skip
    if count >= per_batch:
        return
    source = (
        f"data.val_data_path={data_cfg.val_data_path!r}"
        if data_cfg.val_data_path
        else f"data.dataset_name={data_cfg.dataset_name!r}, "
        f"data.num_val_samples={data_cfg.num_val_samples}"
    )
    key = f"{section}.val_global_batch_size"
    raise DatasetTooSmallError(
        f"the validation data ({source}) has {count} {unit}, fewer than the {per_batch} one "
        f"validation batch takes (set by {key}): validation would never run. Lower {key} "
        f"(and {section}.val_micro_batch_size) to fit, hold out more {unit} "
        f"(data.num_val_samples, data.val_data_path), or set {section}.val_period=0 to train "
        "without validation."
    )


class GPUsMissingError(RuntimeError, UserInputError):
    """The config asks for GPUs this machine does not have (or torch cannot use)."""


def start_ray(cluster_cfg: ClusterConfig) -> None:
    """Start (or join) Ray with the cluster's GPUs declared. Cheap to call twice. A local
    one-node run asking for more GPUs than torch sees here stops first, naming why: Ray would
    declare them anyway, and the workers would train on the CPU."""
    from tempering.distributed.virtual_cluster import init_ray

    gpus = cluster_cfg.gpus_per_node * cluster_cfg.num_nodes
    if gpus and cluster_cfg.num_nodes == 1 and not os.environ.get("RAY_ADDRESS"):
        import torch

        if torch.cuda.device_count() < gpus:
            from tempering.models.policy.model_setup import cuda_unusable_reason

            why = cuda_unusable_reason() if not torch.cuda.is_available() else "check nvidia-smi"
            raise GPUsMissingError(
                f"cluster.gpus_per_node={gpus} but torch sees {torch.cuda.device_count()} GPU(s) "
                f"on this machine: {why}; or set cluster.gpus_per_node=0 to train on CPUs"
            )
    init_ray(num_gpus=gpus or None)


def plan_run(cfg: Any) -> Any:
    """The run's placement plan (`tempering plan` prints the same); a config that does not
    fit its cluster fails here, before Ray starts (`PlanError`, a user error). A model that
    is not there is named first, not after a plan that could not size it."""
    from tempering.models.registry import resolve_model_path
    from tempering.models.shapes import plan_for

    for section in (cfg.policy, getattr(cfg, "teacher", None)):
        if section is not None:
            resolve_model_path(section.model_name)
    plan = plan_for(cfg)
    log.info("placement plan:\n%s", plan.table())
    return plan


def build_cluster(group: Any, cluster_cfg: ClusterConfig, name: str) -> Any:
    """The Ray virtual cluster of one group of the plan (``plan.policy``)."""
    from tempering.distributed.virtual_cluster import cluster_for_group

    return cluster_for_group(group, cluster_cfg.cpus_per_worker, name)


def build_beside(here: Callable[[], A], beside: Callable[[], B]) -> tuple[A, B]:
    """``(here(), beside())``, ``beside`` run in a thread of its own while ``here`` runs in
    this one: two worker groups that do not need each other start at once (GRPO's policy and
    its split generation workers: 9.5 s and 8.2 s one after the other on the 2-core EPYC, each
    mostly a worker importing torch and transformers on a core of its own). When either
    fails, the other's result, once it has one, is shut down and the error raised (``here``'s
    when both fail): nothing of a failed start is left in a Ray session that outlives it."""
    with ThreadPoolExecutor(1, thread_name_prefix="build-beside") as pool:
        other = pool.submit(beside)
        try:
            mine = here()
        except BaseException:
            if other.exception() is None:  # waits for it
                _shut_down(other.result())
            raise
        try:
            return mine, other.result()
        except BaseException:
            _shut_down(mine)
            raise


def _shut_down(built: Any) -> None:
    """`shutdown()` whatever of ``built`` (an object or a tuple of them) has one, quietly: it
    is cleanup on the way to another error."""
    for part in built if isinstance(built, tuple) else (built,):
        if callable(getattr(part, "shutdown", None)):
            with contextlib.suppress(Exception):
                part.shutdown()


def build_policy_from_config(
    policy_cfg: PolicyConfig,
    cluster: Any,
    *,
    total_steps: int,
    init_reference_model: bool = False,
    seed: int = 42,
    name_prefix: str = "policy",
    head: str = "causal_lm",
    pad_token_id: int | None = None,
    gpu_share: float | None = None,
    cpu_share: float | None = None,
    samples_per_step: int | None = None,
) -> Any:
    """An FSDP2 `Policy` over `cluster` with the optimizer and schedule of `policy_cfg`
    (``head="score"``: a reward model's workers, see `tempering.models.policy.reward_model`;
    ``head="value"``: a PPO critic's). ``cpu_share=0``: on bundles another group holds.
    ``samples_per_step``: the samples each of the loop's ``total_steps`` trains on (GRPO:
    prompts x generations), which may be several global batches: the lr schedule, warmup
    included, counts the loop's steps, so it spans the run however the batch is split (None:
    one global batch a step)."""
    from tempering.models.policy.lm_policy import build_policy
    from tempering.models.registry import resolve_model_path

    per_step = (samples_per_step or policy_cfg.train_global_batch_size) // (
        policy_cfg.train_global_batch_size
    )  # optimizer steps in one of the loop's
    opt = policy_cfg.optimizer
    if opt.name not in _OPTIMIZERS:
        raise ValueError(
            f"policy.optimizer.name={opt.name!r} is not supported; use one of {sorted(_OPTIMIZERS)}"
        )
    dyn, packing = policy_cfg.dynamic_batching, policy_cfg.sequence_packing
    token_budget = (
        packing.train_mb_tokens if packing.enabled else dyn.train_mb_tokens if dyn.enabled else None
    )
    return build_policy(
        cluster,
        resolve_model_path(policy_cfg.model_name),
        train_global_batch_size=policy_cfg.train_global_batch_size,
        train_micro_batch_size=policy_cfg.train_micro_batch_size,
        logprob_micro_batch_size=policy_cfg.logprob_batch_size,
        max_tokens_per_microbatch=token_budget,
        logprob_max_tokens_per_microbatch=dyn.logprob_mb_tokens if dyn.enabled else None,
        sequence_packing=packing.enabled,
        shared_prefix=policy_cfg.shared_prefix,
        padding_free=policy_cfg.padding_free,
        logprob_chunk_size=policy_cfg.logprob_chunk_size,
        allocator=policy_cfg.allocator,
        learning_rate=opt.kwargs.lr,
        weight_decay=opt.kwargs.weight_decay,
        betas=opt.kwargs.betas,
        eps=opt.kwargs.eps,
        optimizer=_OPTIMIZERS[opt.name],
        max_grad_norm=policy_cfg.max_grad_norm,
        max_consecutive_nonfinite=policy_cfg.max_consecutive_nonfinite_steps,
        lr_schedule=policy_cfg.scheduler.name,
        warmup_steps=policy_cfg.scheduler.warmup_steps * per_step,
        total_steps=total_steps * per_step,
        min_lr_ratio=policy_cfg.scheduler.min_lr_ratio,
        precision=policy_cfg.precision,
        activation_checkpointing=policy_cfg.dtensor_cfg.activation_checkpointing,
        tensor_parallel_size=policy_cfg.dtensor_cfg.tensor_parallel_size,
        lora=policy_cfg.dtensor_cfg.lora_cfg.worker_kwargs(),
        init_reference_model=init_reference_model,
        seed=seed,
        num_threads=policy_cfg.num_threads,
        name_prefix=name_prefix,
        head=head,
        pad_token_id=pad_token_id,
        tokenizer_path=run_tokenizer_path(policy_cfg),
        chat_template=policy_cfg.tokenizer.chat_template,
        gpu_share=gpu_share,
        cpu_share=cpu_share,
    )


def build_logger(
    logger_cfg: LoggerConfig, resolved_config: dict[str, Any], resume_step: int = 0
) -> Any:
    """The run's Logger; ``resume_step`` (the checkpoint's step) trims metrics.jsonl to it."""
    from tempering.utils.logger import Logger

    return Logger(
        logger_cfg.log_dir,
        tensorboard_enabled=logger_cfg.tensorboard_enabled,
        tensorboard_dir=logger_cfg.tensorboard.log_dir,
        wandb_enabled=logger_cfg.wandb_enabled,
        wandb_project=logger_cfg.wandb.project,
        wandb_name=logger_cfg.wandb.name,
        mlflow_enabled=logger_cfg.mlflow_enabled,
        mlflow_experiment=logger_cfg.mlflow.experiment_name,
        mlflow_tracking_uri=logger_cfg.mlflow.tracking_uri,
        config=resolved_config,
        resume_step=resume_step,
    )


def build_resource_monitor(
    logger_cfg: LoggerConfig,
    *,
    policy: Any = None,
    generation: Any = None,
    environments: Any = (),
) -> Any | None:
    """Per-role CPU/memory/GPU metrics (``logger.monitor_gpus``): the controller, the policy
    workers, split generation workers and environment actors (``utils/resources.py``)."""
    if not logger_cfg.monitor_gpus:
        return None
    from tempering.utils.resources import ResourceMonitor, process_usage

    sources: dict[str, Any] = {"controller": lambda: [process_usage()]}
    if policy is not None:
        sources["policy"] = policy.worker_group.resource_usage
    group = getattr(generation, "worker_group", None)
    if group is not None and group is not getattr(policy, "worker_group", None):
        sources["generation"] = group.resource_usage
    actors = [e for e in {id(e): e for e in environments}.values() if hasattr(e, "resource_usage")]
    if actors:
        import ray

        from tempering.distributed.deadlines import deadline_s

        def environment_usage() -> list[dict[str, float]]:
            refs = [a.resource_usage.remote() for a in actors]
            return ray.get(refs, timeout=deadline_s("environment"))

        sources["environment"] = environment_usage
    return ResourceMonitor(sources)


def log_resources(monitor: Any | None, logger: Any, step: int) -> None:
    """One ``resources/*`` record for ``step`` when monitoring is on."""
    if monitor is not None:
        logger.log_metrics(monitor.sample(), step)


def build_checkpointer(ckpt_cfg: CheckpointingConfig) -> Any | None:
    if not ckpt_cfg.enabled:
        return None
    from tempering.utils.checkpoint import CheckpointManager

    return CheckpointManager(
        ckpt_cfg.checkpoint_dir,
        save_period=ckpt_cfg.save_period,
        keep_top_k=ckpt_cfg.keep_top_k,
        metric_name=ckpt_cfg.metric_name,
        higher_is_better=ckpt_cfg.higher_is_better,
    )


def check_resumable(ckpt_cfg: CheckpointingConfig, config: dict[str, Any]) -> None:
    """Before Ray: a ``checkpoint_dir`` holding another model's run is refused now, in one
    line, rather than after the workers have started (`maybe_resume` checks it again)."""
    checkpointer = build_checkpointer(ckpt_cfg)
    if checkpointer is None:
        return
    latest = checkpointer.latest_complete()
    if latest is not None:
        _same_model_diff(checkpointer, int(checkpointer.load_training_info(latest)["step"]), config)


def maybe_resume(
    checkpointer: Any | None, policy: Any, dataloader: Any, config: dict[str, Any]
) -> tuple[int, dict]:
    """Load the newest complete checkpoint, if any: returns (step, training_info). A
    ``config`` (the resolved one) that differs from the checkpoint's is logged key by key."""
    if checkpointer is None:
        return 0, {}
    found = checkpointer.maybe_resume()
    if found is None:
        return 0, {}
    step, info = found
    from tempering.utils.checkpoint import change_lines

    changes = change_lines(_same_model_diff(checkpointer, step, config))
    if changes:
        log.warning(
            "resuming %s with a config that differs from the checkpoint's in %d key(s) "
            "(a fresh run needs another checkpointing.checkpoint_dir): %s",
            checkpointer.step_dir(step), len(changes), "; ".join(changes),
        )  # fmt: skip
    policy.load_checkpoint(str(checkpointer.policy_dir(step)))
    if dataloader is not None and "dataloader" in info:
        dataloader.load_state_dict(info["dataloader"])
    if "rng_state" in info:  # the controller draws what the uninterrupted run would have
        from tempering.utils.checkpoint import restore_rng_state

        restore_rng_state(info["rng_state"])
    log.info("resumed from %s", checkpointer.step_dir(step))
    return step, info


def _same_model_diff(checkpointer: Any, step: int, config: dict[str, Any]) -> dict[str, tuple]:
    """How ``config`` differs from checkpoint ``step``'s, after refusing a checkpoint of
    another model (`_refuse_another_model`)."""
    diff = checkpointer.config_diff(checkpointer.step_dir(step), config)
    lora_cfg = config.get("policy", {}).get("dtensor_cfg", {}).get("lora_cfg", {})
    _refuse_another_model(checkpointer, step, diff, bool(lora_cfg.get("enabled")))
    _refuse_another_critic(checkpointer, step, diff, config)
    return diff


# lora_cfg keys that change which weights the policy has (alpha and dropout do not)
_LORA_SHAPE_KEYS = ("enabled", "dim", "target_modules", "exclude_modules", "match_all_linear")


def _refuse_another_model(
    checkpointer: Any, step: int, diff: dict[str, tuple], lora_enabled: bool
) -> None:
    """A checkpoint resumes only the model it was saved from: another ``policy.model_name``
    (unless both name the same architecture and sizes, e.g. a moved folder) or LoRA settings
    that change the weights' names and shapes (LoRA on or off, or, while it is on, its rank
    or layers) would fail deep inside torch.distributed.checkpoint. Raise
    `CheckpointMismatchError` naming the fix instead."""
    from tempering.utils.checkpoint import CheckpointMismatchError

    lora = "policy.dtensor_cfg.lora_cfg."
    keys = _LORA_SHAPE_KEYS if lora_enabled else ("enabled",)
    changed = [k for k in diff if k.startswith(lora) and k[len(lora) :] in keys]
    if "policy.model_name" in diff and not _same_model(*diff["policy.model_name"]):
        changed.insert(0, "policy.model_name")
    if not changed:
        return
    folder = checkpointer.checkpoint_dir
    said = "; ".join(f"{k}: {diff[k][0]!r} there, {diff[k][1]!r} now" for k in changed)
    same = ", ".join(f"{k}={diff[k][0]!r}" for k in changed)
    raise CheckpointMismatchError(
        f"checkpointing.checkpoint_dir={str(folder)!r} holds step {step} of another model's "
        f"run ({said}), and a checkpoint resumes only its own model. Fix: give this run its "
        f"own folder, e.g. checkpointing.checkpoint_dir={str(folder)}_2 (or remove {folder} "
        f"to start it over); to resume that run, give what it had: {same}."
    )


def _refuse_another_critic(
    checkpointer: Any, step: int, diff: dict[str, tuple], config: dict[str, Any]
) -> None:
    """A PPO run resumes its checkpoint's critic: a ``critic.model_name`` of another
    architecture or size than the one it was saved from (null: the policy's) would fail inside
    torch.distributed.checkpoint; `CheckpointMismatchError` names it and the fix instead."""
    from tempering.utils.checkpoint import CheckpointMismatchError

    critic = config.get("critic") or {}
    if not critic.get("enabled") or "critic.model_name" not in diff:
        return
    policy = config.get("policy", {}).get("model_name")
    saved, now = (policy if v in (None, "(absent)") else v for v in diff["critic.model_name"])
    if _same_model(saved, now, _HEAD_KEYS):  # the same body: its head is the critic's own
        return
    had = diff["critic.model_name"][0]
    folder = checkpointer.checkpoint_dir
    raise CheckpointMismatchError(
        f"checkpointing.checkpoint_dir={str(folder)!r} holds step {step} of a PPO run whose "
        f"critic started from {saved!r}, and critic.model_name now names {now!r}: a checkpoint "
        f"resumes only its own critic. Fix: give this run its own folder, e.g. "
        f"checkpointing.checkpoint_dir={str(folder)}_2; to resume that run, give "
        f"critic.model_name={'null' if had in (None, '(absent)') else repr(had)}."
    )


# config.json keys of a model's head, not its body (a critic's folder vs a causal LM's)
_HEAD_KEYS = frozenset({"architectures", "num_labels", "id2label", "label2id",
                        "classifier_dropout", "problem_type"})  # fmt: skip


def _same_model(saved: Any, now: Any, also_ignore: frozenset[str] = frozenset()) -> bool:
    """Whether two ``policy.model_name`` values resolve to models of one architecture and
    size (their config.json alike, names and versions aside, and ``also_ignore``)."""
    import json

    from tempering.models.registry import resolve_model_path

    ignore = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", *also_ignore}
    configs = []
    for name in (saved, now):
        try:
            path = Path(resolve_model_path(str(name))) / "config.json"
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # gone, or no config.json: not provably the same
            return False
        configs.append({k: v for k, v in config.items() if k not in ignore})
    return configs[0] == configs[1]


def save_checkpoint(
    run: Any,
    policy: Any,
    step: int,
    val: dict[str, float],
    *,
    extra: dict[str, Any] | None = None,
    write_files: Any = None,
) -> Path | None:
    """Atomically write step_<step>/ of `run` (its checkpointer, dataloader and resolved
    config) with `policy`'s sharded state, the step's validation `val` (stored as val/<key>,
    what keep_top_k ranks by) and the loop's state; ``write_files(folder)`` adds files of the
    loop's own (async GRPO's buffer)."""
    checkpointer = run.checkpointer
    if checkpointer is None:
        return None
    info = {
        "metrics": {f"val/{k}": v for k, v in val.items()},
        "dataloader": run.dataloader.state_dict(),
        **(extra or {}),
    }
    from tempering.utils import faults

    with checkpointer.save(step, info, run.resolved) as tmp:
        policy.save_checkpoint(str(Path(tmp) / "policy"))
        if write_files is not None:
            write_files(Path(tmp))
        faults.maybe_fault("controller", "checkpoint")  # killed mid-save (reliability tests)
    return checkpointer.step_dir(step)


def epochs_reached(dataloader: Any, max_num_epochs: int, key: str, step: int) -> bool:
    """Whether the loop has made ``max_num_epochs`` whole passes over its training data
    (``key`` names the setting, e.g. ``grpo.max_num_epochs``); stopping is logged."""
    done = dataloader.epochs_completed
    if done < max_num_epochs:
        return False
    log.info(
        "%s=%d reached: %d pass(es) over the %d training examples after step %d; stopping",
        key, max_num_epochs, done, len(dataloader.dataset), step,
    )  # fmt: skip
    return True


class Deadline:
    """Optional wall-clock budget for a run (`max_wall_time_s`)."""

    def __init__(self, seconds: float | None) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def passed(self) -> bool:
        return self.seconds is not None and self.elapsed >= self.seconds


def export_final_model(policy: Any, checkpointing: CheckpointingConfig, lora: bool) -> Path:
    """The usable model every run ends with: ``<checkpoint_dir>/final_hf`` (atomic); with
    LoRA the adapters merged in, and beside it ``final_adapter/`` in PEFT's format."""
    path = Path(checkpointing.checkpoint_dir) / "final_hf"
    policy.export_hf(str(path))
    log.info("final model written to %s", path)
    if lora:
        adapter = path.with_name("final_adapter")
        policy.export_hf(str(adapter), adapter=True)
        log.info("final LoRA adapter (PEFT format) written to %s", adapter)
    return path


def warn_if_finished(start_step: int, max_steps: int, section: str, checkpoint_dir: str) -> None:
    """A resumed run whose checkpoint is already at ``<section>.max_num_steps`` has nothing to
    train: say so, and how to get a fresh run or more steps."""
    if start_step and start_step >= max_steps:
        log.warning(
            "the run in %s has already finished (step %d, %s.max_num_steps=%d): nothing to "
            "train. For a fresh run give another checkpointing.checkpoint_dir (or remove %s); "
            "for more steps raise %s.max_num_steps.",
            checkpoint_dir, start_step, section, max_steps, checkpoint_dir, section,
        )  # fmt: skip


def resumed_val(checkpointer: Any | None, step: int) -> dict[str, float]:
    """The validation metrics the checkpoint of ``step`` recorded (its ``val/*``, without the
    prefix): what a resumed run that makes no step (it had already finished) reports as its
    last validation. Empty for step 0 or without checkpoints."""
    if checkpointer is None or step == 0:
        return {}
    metrics = checkpointer.load_training_info(checkpointer.step_dir(step)).get("metrics", {})
    return {k[len("val/") :]: v for k, v in metrics.items() if k.startswith("val/")}


def first_logged(log_dir: str, prefix: str) -> dict[str, float]:
    """The earliest step's metrics under `prefix` (e.g. ``val/``) in ``<log_dir>/metrics.jsonl``,
    without the prefix: a resumed run's summary starts from its records, not from this
    process's memory. A torn last line (a killed writer) is skipped."""
    import json

    path = Path(log_dir) / "metrics.jsonl"
    best: tuple[int, dict[str, float]] | None = None
    if not path.is_file():
        return {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        found = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
        if found and (best is None or row.get("step", 0) < best[0]):
            best = (row.get("step", 0), found)
    return best[1] if best else {}


class ChatTemplateMissingError(ValueError, UserInputError):
    """The run renders chat messages and the tokenizer has no chat template."""


def check_chat_template(tokenizer: Any, cfg: Any, needs: list[str] | None = None) -> None:
    """A base model's tokenizer (no chat template) trains on raw text; whatever renders chat
    messages (`data.use_chat_template`, and the GRPO features in ``needs``) needs a template:
    refused here, before Ray starts, naming what needs it and the fix."""
    if getattr(tokenizer, "chat_template", None):
        return
    asked = cfg.data.use_chat_template
    needs = ["data.use_chat_template=true"] * asked + list(needs or [])
    if needs:
        raw = " (or data.use_chat_template=false for raw prompts)" * asked
        raise ChatTemplateMissingError(
            f"policy.model_name={cfg.policy.model_name!r}: its tokenizer has no chat template "
            f"(a base model?), and {'; '.join(needs)} needs one. Fix: set "
            f"policy.tokenizer.chat_template to a Jinja template{raw}, or use the model's "
            "instruct version"
        )


def load_run_tokenizer(policy_cfg: PolicyConfig) -> Any:
    """The run's tokenizer: `policy.tokenizer.name` (default: the model's), with
    `policy.tokenizer.chat_template` replacing its chat template when set (for every prompt,
    training example and the generation server alike)."""
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    resolve_model_path(policy_cfg.model_name)  # a bad name fails here, early
    path = run_tokenizer_path(policy_cfg)
    key = "policy.tokenizer.name" if policy_cfg.tokenizer.name else "policy.model_name"
    return load_tokenizer(
        path, policy_cfg.tokenizer.chat_template,
        named=(f"{key}={policy_cfg.tokenizer.name or policy_cfg.model_name!r}",
               "set policy.tokenizer.name to the folder or hub id of the model's tokenizer"),
    )  # fmt: skip


def run_tokenizer_path(policy_cfg: PolicyConfig) -> str:
    """Where the run's tokenizer is read from: `policy.tokenizer.name`, else the model's folder
    (every worker that decodes, and every exported model, reads it from there)."""
    from tempering.models.registry import resolve_model_path

    return resolve_model_path(policy_cfg.tokenizer.name or policy_cfg.model_name)
