"""Supervised fine-tuning: next-token loss on assistant tokens only, on FSDP2 workers.

    uv run examples/run_sft.py [--config FILE] [dotted.key=value ...]

`setup()` builds the pieces (data, Ray cluster, policy, logger, checkpoints) from the config;
`train()` is the loop: batch -> policy.train(NLLLoss) -> log -> validate -> checkpoint.
Validation reports the held-out loss and, for data with known answers (arithmetic, GSM8K),
greedy accuracy from generation inside the policy workers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from tempering.algorithms import common
from tempering.config.schemas import GENERATED_TRAIN_SAMPLES, DataConfig, SFTMasterConfig
from tempering.data.records import data_source, first_n, first_val

log = logging.getLogger(__name__)


@dataclass
class SFTData:
    train: list[Any]  # tokenized examples
    val: list[Any]
    val_problems: list[dict[str, str]]  # {"prompt", "answer"} for greedy accuracy ([] = none)
    answer_checker: Any  # callable(completion, answer) -> bool


def load_sft_data(
    data_cfg: DataConfig, tokenizer: Any, max_seq_len: int, problems_per_sample: int = 1
) -> SFTData:
    """Message logs for the configured dataset, tokenized with assistant-only loss masks."""
    from tempering.data import sft_datasets
    from tempering.data.processing import tokenize_message_logs
    from tempering.environments.arithmetic import first_integer

    name = data_cfg.dataset_name
    problems: list[dict[str, str]] = []
    checker = None
    if name == "arithmetic":
        from tempering.data.arithmetic import arithmetic_message_log
        from tempering.models.tiny_arith import make_problems

        train_p = make_problems(
            data_cfg.num_train_samples or GENERATED_TRAIN_SAMPLES, seed=data_cfg.seed, split="train"
        )
        problems = make_problems(data_cfg.num_val_samples, seed=data_cfg.seed, split="test")
        train_logs = [arithmetic_message_log(p["prompt"], p["answer"]) for p in train_p]
        k = problems_per_sample  # k problems per conversation: [user, assistant] * k
        train_logs = [sum(train_logs[i : i + k], []) for i in range(0, len(train_logs), k)]
        val_logs = [arithmetic_message_log(p["prompt"], p["answer"]) for p in problems]

        def checker(completion: str, answer: str) -> bool:
            got = first_integer(completion)
            return got is not None and str(got) == answer

    elif name == "arithmetic_calculator":  # tool-call demonstrations (data/arithmetic.py)
        from tempering.data.arithmetic import calculator_conversation
        from tempering.environments.calculator import CALCULATOR_TOOL
        from tempering.models.tiny_arith import make_problems

        def demos(count: int, split: str) -> list[Any]:
            problems = make_problems(count, seed=data_cfg.seed, split=split)
            return [
                calculator_conversation(p["prompt"], p["answer"], CALCULATOR_TOOL) for p in problems
            ]

        train_logs = demos(data_cfg.num_train_samples or GENERATED_TRAIN_SAMPLES, "train")
        val_logs = demos(data_cfg.num_val_samples, "test")
    elif name == "gsm8k":
        from tempering.data.gsm8k import gsm8k_rl_pairs, gsm8k_sft_message_logs

        train_logs = gsm8k_sft_message_logs("train").examples
        val_logs = gsm8k_sft_message_logs("test").examples
        problems = [
            {"prompt": q, "answer": a}
            for q, a in gsm8k_rl_pairs("test")[: data_cfg.num_val_samples]
        ]
        checker = _math_checker
    else:
        train_logs, val_logs = sft_datasets.load_sft_splits(
            name,
            data_cfg.train_data_path,
            data_cfg.val_data_path,
            prompt_key=data_cfg.prompt_key,
            response_key=data_cfg.response_key,
            on_bad_row=data_cfg.on_bad_row,
            num_val=data_cfg.num_val_samples,
            seed=data_cfg.seed,
            text_key=data_cfg.text_key,
        )
    if name not in ("arithmetic", "arithmetic_calculator"):  # made to num_train_samples
        train_logs = first_n(
            train_logs,
            data_cfg.num_train_samples,
            data_source(data_cfg.train_data_path, data_cfg.dataset_name),
            "examples",
        )
    split = data_cfg.split_long_texts
    train, _ = tokenize_message_logs(train_logs, tokenizer, max_seq_len, split)
    val_source = (
        f"data.val_data_path={data_cfg.val_data_path!r}"
        if data_cfg.val_data_path
        else f"data.dataset_name={name!r}'s validation split"
    )
    val_logs = first_val(val_logs, data_cfg.num_val_samples, val_source, "examples")
    val, _ = tokenize_message_logs(val_logs, tokenizer, max_seq_len, split)
    return SFTData(train, val, problems, checker)


def _math_checker(completion: str, answer: str) -> bool:
    from tempering.environments.math import math_verify_score

    return math_verify_score(completion, answer)[0] > 0


# --------------------------------------------------------------------------- setup
@dataclass
class SFTRun:
    cfg: SFTMasterConfig
    resolved: dict[str, Any]
    tokenizer: Any
    data: SFTData
    dataloader: Any
    policy: Any
    cluster: Any
    generation: Any  # colocated torch engine for greedy validation (None without answers)
    logger: Any
    checkpointer: Any
    start_step: int
    monitor: Any = None  # per-role resource metrics (logger.monitor_gpus)

    def close(self) -> None:
        """Free what the run started: logger, policy workers, placement groups."""
        self.logger.close()
        self.policy.shutdown()
        self.cluster.shutdown()


def setup(cfg: SFTMasterConfig, resolved: dict[str, Any]) -> SFTRun:
    from tempering.data.collate import collate_sft, pad_token_id_of
    from tempering.data.dataloader import StatefulDataLoader

    common.prepare_run(cfg.deadlines, cfg.logger.log_dir)
    plan = common.plan_run(cfg)
    common.check_resumable(cfg.checkpointing, resolved)
    tokenizer = common.load_run_tokenizer(cfg.policy)
    common.check_chat_template(tokenizer, cfg)
    data = load_sft_data(
        cfg.data,
        tokenizer,
        cfg.policy.max_total_sequence_length,
        cfg.sft.arithmetic_problems_per_sample,
    )
    common.check_validation_batch(
        len(data.val), cfg.sft.val_global_batch_size, cfg.sft.val_batches, "sft",
        cfg.sft.val_period, cfg.data, "examples",
    )  # fmt: skip
    pad = pad_token_id_of(tokenizer)
    dataloader = StatefulDataLoader(
        data.train,
        cfg.policy.train_global_batch_size,
        seed=cfg.sft.seed,
        collate_fn=lambda ex: collate_sft(ex, pad),
        prefetch=True,  # tokenize the next batch while the workers train
        batch_key="policy.train_global_batch_size",
        source="the training data "
        f"({data_source(cfg.data.train_data_path, cfg.data.dataset_name)})",
    )
    common.start_ray(cfg.cluster)  # the inputs are good: now the workers
    cluster = common.build_cluster(plan.policy, cfg.cluster, "sft")
    policy = common.build_policy_from_config(
        cfg.policy, cluster, total_steps=cfg.sft.max_num_steps, seed=cfg.sft.seed
    )
    generation = None
    if data.val_problems:
        from tempering.models.generation.builders import ColocatedGeneration, sampling_from_config

        gen = cfg.policy.generation
        generation = ColocatedGeneration(
            policy, sampling_from_config(gen, tokenizer), gen.torch_dtype_name
        )
    checkpointer = common.build_checkpointer(cfg.checkpointing)
    start_step, _ = common.maybe_resume(checkpointer, policy, dataloader, resolved)
    logger = common.build_logger(cfg.logger, resolved, start_step)
    return SFTRun(
        cfg,
        resolved,
        tokenizer,
        data,
        dataloader,
        policy,
        cluster,
        generation,
        logger,
        checkpointer,
        start_step,
        common.build_resource_monitor(cfg.logger, policy=policy),
    )


# ---------------------------------------------------------------------------- loop
def train(run: SFTRun) -> dict[str, float]:
    """The SFT loop. Returns the last validation metrics."""
    from tempering.losses import NLLLoss
    from tempering.utils.logger import print_step_summary, track

    cfg = run.cfg.sft
    loss_fn = NLLLoss()
    val_metrics: dict[str, float] = {}
    if cfg.val_at_start and cfg.val_period and run.start_step == 0:
        val_metrics = validate(run, step=0)
    common.warn_if_finished(
        run.start_step, cfg.max_num_steps, "sft", run.cfg.checkpointing.checkpoint_dir
    )
    step = run.start_step
    steps = range(run.start_step, cfg.max_num_steps)
    with track(steps, total=len(steps), description="sft") as progress:
        for _ in progress:
            if common.epochs_reached(
                run.dataloader, cfg.max_num_epochs, "sft.max_num_epochs", step
            ):
                break
            t0 = time.perf_counter()
            batch = run.dataloader.next_batch()
            metrics = run.policy.train(batch, loss_fn)
            step += 1
            metrics["step_s"] = time.perf_counter() - t0
            run.logger.log_metrics(_train_metrics(metrics), step, prefix="train")
            run.logger.log_metrics({"step_s": metrics["step_s"]}, step, prefix="timing")
            common.log_resources(run.monitor, run.logger, step)
            is_last = (
                step == cfg.max_num_steps or run.dataloader.epochs_completed >= cfg.max_num_epochs
            )
            if cfg.val_period and (step % cfg.val_period == 0 or is_last):
                val_metrics = validate(run, step)
            print_step_summary(
                step,
                cfg.max_num_steps,
                {
                    **{f"train/{k}": v for k, v in metrics.items()},
                    "timing/step_s": metrics["step_s"],
                    **{f"val/{k}": v for k, v in val_metrics.items()},
                },
            )
            stop = _inside_band(val_metrics, cfg.stop_val_accuracy_range)
            if run.checkpointer and (
                run.checkpointer.should_save(step, is_last_step=is_last or stop)
            ):
                common.save_checkpoint(run, run.policy, step, val_metrics)
            if stop:
                log.info(
                    "val/accuracy %.3f is inside %s: stopping at step %d",
                    val_metrics["accuracy"],
                    cfg.stop_val_accuracy_range,
                    step,
                )
                break
    if step == run.start_step:  # nothing left to do: the checkpoint's validation is the last
        val_metrics = val_metrics or common.resumed_val(run.checkpointer, step)
    run.final_step = step  # type: ignore[attr-defined]
    common.export_final_model(  # <checkpoint_dir>/final_hf
        run.policy, run.cfg.checkpointing, run.cfg.policy.dtensor_cfg.lora_cfg.enabled
    )
    return val_metrics


def _train_metrics(m: dict[str, float]) -> dict[str, float]:
    keep = ("loss", "grad_norm", "lr", "num_valid_tokens", "tokens_per_s", "num_nonfinite_skipped")
    return {k: m[k] for k in keep if k in m}


def _inside_band(val: dict[str, float], band: tuple[float, float] | None) -> bool:
    return band is not None and "accuracy" in val and band[0] <= val["accuracy"] <= band[1]


def validate(run: SFTRun, step: int) -> dict[str, float]:
    """Held-out loss (no update) and, where answers are known, greedy accuracy."""
    from tempering.data.collate import collate_sft, pad_token_id_of
    from tempering.losses import NLLLoss

    cfg = run.cfg.sft
    pad = pad_token_id_of(run.tokenizer)
    gbs = cfg.val_global_batch_size
    # at least one batch: fewer examples are refused at set-up (`common.check_validation_batch`)
    n = min(len(run.data.val), gbs * cfg.val_batches) // gbs * gbs
    batch = collate_sft(run.data.val[:n], pad)
    m = run.policy.train(
        batch,
        NLLLoss(),
        eval_mode=True,
        global_batch_size=gbs,
        micro_batch_size=cfg.val_micro_batch_size,
    )
    out = {"loss": m["loss"]}
    if run.generation is not None:
        run.generation.refit(run.policy)
        acc, samples = greedy_accuracy(
            run.generation,
            run.tokenizer,
            run.data.val_problems,
            run.data.answer_checker,
            use_chat_template=run.cfg.data.use_chat_template,
        )
        out["accuracy"] = acc
        for s in samples[: run.cfg.logger.num_val_samples_to_print]:
            log.info("val sample: %r -> %r (answer %s)", *s)
    run.logger.log_metrics(out, step, prefix="val")
    return out


def greedy_accuracy(
    generation: Any,
    tokenizer: Any,
    problems: list[dict[str, str]],
    checker: Any,
    *,
    use_chat_template: bool,
) -> tuple[float, list[tuple[str, str, str]]]:
    """Greedy generation (e.g. in the policy workers); fraction of answers the checker accepts."""
    from tempering.data.prompts import encode_prompts

    batch = encode_prompts([p["prompt"] for p in problems], tokenizer, use_chat_template)
    out = generation.generate(batch, greedy=True)
    completions = decode_generations(out, batch, tokenizer)
    correct = [checker(c, p["answer"]) for c, p in zip(completions, problems, strict=True)]
    samples = [(p["prompt"], c, p["answer"]) for c, p in zip(completions, problems, strict=True)]
    return sum(correct) / len(correct), samples


def decode_generations(out: Any, prompts: Any, tokenizer: Any) -> list[str]:
    """Text of the generated part of each row of a generation result."""
    texts = []
    for i in range(out["output_ids"].shape[0]):
        start = int(prompts["input_lengths"][i])
        end = start + int(out["generation_lengths"][i])
        texts.append(tokenizer.decode(out["output_ids"][i, start:end], skip_special_tokens=True))
    return texts
