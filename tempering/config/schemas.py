"""Typed configuration schemas: one default per field, validated before anything starts.

Key names follow NeMo RL's (`policy.model_name`, `grpo.num_prompts_per_step`, ...), so a
NeMo RL override line works unchanged. Builders turn these models into plain arguments;
library classes never receive a config object. Field descriptions double as ``--help``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from tempering.config.blend_sections import BlendEntryConfig, BlendList  # noqa: F401
from tempering.config.distillation_sections import (  # noqa: F401 -- part of this namespace
    DistillationConfig,
    DistillationLossConfig,
    TeacherConfig,
    TeacherDTensorConfig,
    as_grpo_config,
)
from tempering.config.external_sections import ExternalHarnessConfig, check_external  # noqa: F401
from tempering.config.generation_sections import (  # noqa: F401 -- part of this namespace
    ColocatedConfig,
    GenerationConfig,
    GenerationResourcesConfig,
    HttpServerConfig,
    VllmConfig,
)
from tempering.config.rl_sections import (  # noqa: F401 -- part of this module's namespace
    KL_CLAMPS,
    TRUNCATED_IS_TYPES,
    ArithmeticRetryEnvConfig,
    AsyncGRPOConfig,
    CalculatorEnvConfig,
    CriticConfig,
    EnvConfig,
    FaultToleranceConfig,
    GRPOConfig,
    LossFnConfig,
    MathEnvConfig,
    NemoGymConfig,
    critic_problems,
    kl_penalty_problems,
    loss_fn_problems,
    off_policy_loss_problems,
)
from tempering.config.run_sections import (  # noqa: F401 -- part of this namespace
    CheckpointingConfig,
    ClusterConfig,
    DeadlinesConfig,
    LoggerConfig,
    MlflowConfig,
    TensorboardConfig,
    WandbConfig,
)
from tempering.config.section import Section
from tempering.config.trainer_sections import (  # noqa: F401 -- part of this namespace
    DPOConfig,
    KTOConfig,
    PreferenceLoopConfig,
    RMConfig,
    SFTConfig,
)


# ------------------------------------------------------------------------- policy
class TokenizerConfig(Section):
    name: str | None = Field(None, description="tokenizer id/folder; default: the model's")
    chat_template: str | None = Field(None, description="Jinja template overriding the tokenizer's")


def _refuse_unimplemented(section: BaseModel, prefix: str, rules: dict[str, tuple]) -> None:
    """NeMo RL keys we accept only at the value we implement: anything else is an error that
    says why (rule: a key is read or rejected, never silently ignored)."""
    for key, (implemented, reason) in rules.items():
        value = getattr(section, key)
        if value != implemented:
            raise ValueError(f"{prefix}.{key}={value!r} is not supported: {reason}")


class LoraConfig(Section):
    """``policy.dtensor_cfg.lora_cfg`` (NeMo RL's path and names): LoRA adapters on a frozen
    base (tempering/models/policy/lora.py, built on the peft library)."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    target_modules: list[str] = Field(
        [], description="linear layers to adapt, by name or last parts (q_proj, mlp.up_proj); "
        "needs match_all_linear=false"
    )  # fmt: skip
    exclude_modules: list[str] = Field([], description="linear layers never adapted")
    match_all_linear: bool = Field(
        True, description="adapt every linear layer of the decoder (not the output head)"
    )
    dim: int = Field(8, gt=0, description="the adapters' rank r")
    alpha: float = Field(32.0, gt=0, description="scale = alpha / dim")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")

    def worker_kwargs(self) -> dict | None:
        """`FSDP2PolicyWorker`'s ``lora`` argument: None when off."""
        if not self.enabled:
            return None
        return {
            "dim": self.dim, "alpha": self.alpha, "dropout": self.dropout,
            "target_modules": tuple(self.target_modules),
            "exclude_modules": tuple(self.exclude_modules),
            "match_all_linear": self.match_all_linear,
        }  # fmt: skip

    @model_validator(mode="after")
    def _one_selection(self) -> LoraConfig:
        if self.enabled and self.match_all_linear == bool(self.target_modules):
            raise ValueError(
                f"policy.dtensor_cfg.lora_cfg: match_all_linear={self.match_all_linear} with "
                f"target_modules={self.target_modules}: set exactly one (match_all_linear=false "
                "to adapt only target_modules; target_modules=[] to adapt every linear layer)"
            )
        return self


class DTensorConfig(Section):
    enabled: bool = Field(True, description="the DTensor/FSDP2 path (the only one)")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer in backward: less activation memory, "
        "about one more forward pass of compute"
    )  # fmt: skip
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks splitting each decoder layer (inside a node); DP = ranks / TP"
    )
    cpu_offload: bool = Field(False, description="not implemented; only false")
    sequence_parallel: bool = Field(False, description="not implemented; only false")
    lora_cfg: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _implemented(self) -> DTensorConfig:
        _refuse_unimplemented(self, "policy.dtensor_cfg", {
            "enabled": (True, "tempering trains through DTensor/FSDP2 only (it has no Megatron "
                        "path); remove the key or set it true"),
            "cpu_offload": (False, "FSDP2 CPU offload is not wired in (on CPU machines the "
                            "weights are already in host memory); set it false"),
            "sequence_parallel": (False, "sequence parallelism (splitting norms and dropout "
                                  "along the sequence between TP layers) is not implemented; "
                                  "tensor parallelism works without it: set it false"),
        })  # fmt: skip
        return self


class DynamicBatchingConfig(Section):
    enabled: bool = Field(
        False, description="micro-batches cut by padded-token budget (train_mb_tokens, "
        "logprob_mb_tokens) instead of a fixed number of rows"
    )  # fmt: skip
    train_mb_tokens: int = Field(
        4096, ge=1, description="padded-token budget per train micro-batch"
    )
    logprob_mb_tokens: int = Field(
        8192, ge=1, description="padded-token budget per log-prob micro-batch (when enabled)"
    )
    sequence_length_round: int = Field(1, description="only 1 (no rounding) is implemented")

    @model_validator(mode="after")
    def _implemented(self) -> DynamicBatchingConfig:
        _refuse_unimplemented(self, "policy.dynamic_batching", {
            "sequence_length_round": (1, "micro-batches are padded to their longest row, not "
                                      "to a multiple (that helps GPU kernels, not these CPU "
                                      "ones); set it to 1"),
        })  # fmt: skip
        return self


class SequencePackingConfig(Section):
    enabled: bool = Field(
        False, description="pack sequences without padding (train and log-prob passes)"
    )
    train_mb_tokens: int = Field(
        4096, ge=1, description="tokens per packed bin; must hold the longest sequence"
    )
    algorithm: Literal["first_fit_decreasing"] = Field(
        "first_fit_decreasing", description="how sequences fill the bins (the one implemented)"
    )


class OptimizerKwargs(Section):
    lr: float = Field(5e-6, gt=0, description="peak learning rate (the scheduler scales it)")
    weight_decay: float = Field(0.0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates")
    eps: float = Field(1e-8, description="AdamW's denominator term")


class OptimizerConfig(Section):
    name: str = Field("torch.optim.AdamW", description="torch.optim.AdamW or torch.optim.SGD")
    kwargs: OptimizerKwargs = OptimizerKwargs()


class SchedulerConfig(Section):
    """Simpler than NeMo RL's list of schedulers: linear warmup, then one shape."""

    name: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warm-up: stay at lr, or decay to min_lr_ratio x lr by "
        "the run's last step along half a cosine or a line"
    )  # fmt: skip
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up to lr")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="the decay's end, as a fraction of lr (cosine, linear)"
    )


class PolicyConfig(Section):
    model_name: str = Field(
        "tiny-arith",
        description="a registry name (tiny-arith, smollm2-135m-instruct), a local HF folder or a hub id",
    )
    tokenizer: TokenizerConfig = TokenizerConfig()
    train_global_batch_size: int = Field(32, ge=1, description="samples per optimizer step")
    train_micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward")
    generation_batch_size: int | None = Field(
        None, description="not read: each generation worker batches its whole shard; only null"
    )
    logprob_batch_size: int = Field(
        32, ge=1, description="rows per log-prob micro-batch (the policy's and the reference's "
        "passes without a token budget)"
    )  # fmt: skip
    max_total_sequence_length: int = Field(
        512, ge=2, description="prompt + response tokens per sequence: longer training "
        "examples are cut (counted, logged); generation's prompt + new tokens must fit it"
    )  # fmt: skip
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="bfloat16: bf16 compute with fp32 master weights and fp32 gradient "
        "reductions (on CPU too, where it is slower than fp32); float16 is refused",
    )
    num_threads: int | None = Field(None, description="torch threads per worker (CPU)")
    dtensor_cfg: DTensorConfig = DTensorConfig()
    dynamic_batching: DynamicBatchingConfig = DynamicBatchingConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    shared_prefix: bool = Field(
        True, description="rows that start alike (a prompt's GRPO samples, a DPO pair) run "
        "their shared prefix once, with a tree attention mask (exact; "
        "tempering/models/policy/shared_prefix.py); false computes every row whole"
    )  # fmt: skip
    padding_free: bool = Field(
        True, description="a micro-batch whose padding costs more than its rows' own attention "
        "calls runs its rows, in order, as one packed row (exact; tempering/models/policy/"
        "microbatching.py: long rows of uneven length, e.g. SmolLM2 GSM8K SFT); false computes "
        "the padding"
    )  # fmt: skip
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="rows of logits computed at a time, reduced and dropped (each "
        "token's log-prob, the entropy; tempering/logits.py): null = ~64 MiB of them, and only "
        "where it costs nothing (log-prob and reference passes; training a frozen output "
        "projection, as LoRA does); a number also chunks a trained projection's logits "
        "(saves their memory, costs one more pass of the projection in backward)"
    )  # fmt: skip
    allocator: Literal["mimalloc", "system"] = Field(
        "mimalloc", description="the policy workers' malloc: mimalloc (preloaded from the "
        "cmeel-mimalloc wheel; a training step's resident peak ~0.6x glibc's, no slower) or "
        "system (glibc); tempering/utils/allocator.py"
    )  # fmt: skip
    max_grad_norm: float | None = Field(
        1.0, description="clip the global gradient norm to this before each update (null: "
        "no clipping); train/grad_norm is the norm before clipping"
    )  # fmt: skip
    max_consecutive_nonfinite_steps: int = Field(
        3, ge=1, description="a NaN/Inf loss or gradient skips the update (counted in "
        "train/num_nonfinite_skipped); this many in a row stop the run, naming what was non-finite"
    )  # fmt: skip
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    generation: GenerationConfig = GenerationConfig()

    @model_validator(mode="after")
    def _batch_sizes(self) -> PolicyConfig:
        _refuse_unimplemented(self, "policy", {
            "generation_batch_size": (None, "each generation worker generates its whole shard "
                                      "in one call (vLLM schedules its own batches inside "
                                      "it); remove the key"),
            "precision": (self.precision if self.precision != "float16" else "bfloat16",
                          "fp16 training needs loss scaling, which tempering does not "
                          "implement; use bfloat16 (same memory, fp32's range) or float32"),
        })  # fmt: skip
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} is not divisible "
                f"by policy.train_micro_batch_size={self.train_micro_batch_size}"
            )
        if self.generation.vllm_cfg.lora_adapter_refit and not (
            self.generation.backend == "vllm" and self.dtensor_cfg.lora_cfg.enabled
        ):
            raise ValueError(
                "policy.generation.vllm_cfg.lora_adapter_refit=true sends LoRA adapters to vLLM "
                f"engines, but policy.generation.backend={self.generation.backend!r} and "
                f"policy.dtensor_cfg.lora_cfg.enabled={self.dtensor_cfg.lora_cfg.enabled}: it "
                "needs backend=vllm and lora_cfg.enabled=true (other engines take merged "
                "weights); set it false otherwise"
            )
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(
                "policy.dynamic_batching.enabled=true and policy.sequence_packing.enabled=true "
                "cannot both be set (as in NeMo RL); disable one of them"
            )
        return self


# how many training examples a generated dataset (arithmetic, ...) makes when
# data.num_train_samples is null
GENERATED_TRAIN_SAMPLES = 20000


class DataConfig(Section):
    dataset_name: str = Field(
        "arithmetic",
        description="arithmetic | gsm8k | problems | nemo_gym (GRPO) | squad | messages | prompt_response | text | hf | preference | helpsteer3 | messages_preference | unpaired (KTO)",
    )
    train_data_path: str | None = Field(
        None, description="a data file (JSONL, JSON, Parquet or CSV) or HF dataset for "
        "dataset_name's loader; null: the built-in data"
    )  # fmt: skip
    val_data_path: str | None = Field(
        None, description="held-out rows in the same format (null: num_val_samples held out of "
        "the training rows)"
    )  # fmt: skip
    prompt_key: str = Field(
        "prompt",
        description="the prompt column (SFT prompt_response/hf; DPO/RM/KTO "
        "preference; KTO unpaired)",
    )
    response_key: str = Field(
        "response", description="the response column (SFT prompt_response/hf)"
    )
    text_key: str = Field(
        "text", description="the plain-text column (SFT text/hf: language modelling, every "
        "token trained on)"
    )  # fmt: skip
    split_long_texts: bool = Field(
        False, description="SFT text/hf: a text longer than policy.max_total_sequence_length "
        "becomes one example per consecutive window of that length (continued pretraining "
        "keeps every token); false: cut at the length, counted"
    )  # fmt: skip
    max_input_seq_length: int | None = Field(None, description="not read; only null")
    num_train_samples: int | None = Field(
        None,
        ge=1,
        description="training examples: the generated datasets make this many (null: 20000); "
        "any other uses its first N (null: all), logged when that differs from what it holds",
    )
    num_val_samples: int = Field(
        256, ge=1, description="held-out examples: generated, or split off the training rows "
        "when there is no val_data_path"
    )  # fmt: skip
    use_chat_template: bool = Field(
        False, description="format prompts with the tokenizer's chat template"
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="a malformed row stops the load naming it (error), or is skipped, "
        "counted and logged (skip)"
    )  # fmt: skip
    seed: int = Field(0, description="seed of the generated datasets and of the held-out split")
    reasoning_gym_tasks: list[str] = Field(
        default_factory=list,
        description="GRPO: also train on these reasoning-gym generators (e.g. basic_arithmetic), "
        "scored by the math environment",
    )
    reasoning_gym_samples: int = Field(1000, ge=1, description="problems per reasoning-gym task")
    problem_key: str = Field(
        "problem", description="GRPO/eval problems files: the problem column (OpenMathInstruct-2)"
    )
    answer_key: str = Field(
        "expected_answer", description="GRPO/eval problems files: the answer column"
    )
    train_split: str = Field("train", description="split of a Hugging Face dataset for training")
    val_split: str = Field("test", description="split of a Hugging Face dataset for validation")
    prompt_file: str | None = Field(
        None, description="GRPO: a prompt template file with one {} where the problem goes"
    )
    system_prompt_file: str | None = Field(
        None, description="GRPO: a system prompt file (with data.use_chat_template)"
    )
    blend: BlendList = Field(
        default_factory=list,
        description="GRPO: several datasets, each scored by its own environment, each step's "
        "prompts drawn by their weights (docs/guides/grpo.md, weighted blends); empty: data.dataset_name alone",
    )

    # --------------------------------------------------------------------- algorithms

    @model_validator(mode="after")
    def _implemented(self) -> DataConfig:
        _refuse_unimplemented(self, "data", {
            "max_input_seq_length": (None, "sequences are bounded by "
                                     "policy.max_total_sequence_length (longer SFT/DPO rows are "
                                     "cut and counted; a GRPO episode stops at it and is "
                                     "counted as truncated); remove the key"),
        })  # fmt: skip
        return self


# ---------------------------------------------------------------- master configs
class _Master(Section):
    # keys this algorithm refuses instead of reading -> why (see _UNREAD_KEYS)
    UNREAD_KEYS: ClassVar[dict[str, str]]
    policy: PolicyConfig = PolicyConfig()
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    data: DataConfig = DataConfig()
    deadlines: DeadlinesConfig = DeadlinesConfig()

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> _Master:
        """A decaying lr schedule needs steps after its warmup (the worker refused it, under a
        traceback, once Ray had started)."""
        sched = self.policy.scheduler
        name = next(n for n in MASTER_CONFIGS if hasattr(self, n))
        steps = getattr(self, name).max_num_steps
        if sched.name != "constant" and sched.warmup_steps >= steps:
            raise ValueError(
                f"policy.scheduler.warmup_steps={sched.warmup_steps} is not below "
                f"{name}.max_num_steps={steps}: the {sched.name} schedule decays after the "
                "warmup. Lower the warmup, raise the steps, or set policy.scheduler.name=constant"
            )
        return self


_GRPO_ONLY = "applies to GRPO problems only"
_GRPO_DATA_KEYS = (
    "problem_key", "answer_key", "train_split", "val_split", "prompt_file", "system_prompt_file",
    "reasoning_gym_tasks", "reasoning_gym_samples", "blend",
)  # fmt: skip
_PROBLEMS_COLUMNS = "GRPO problems files name their columns with data.problem_key / data.answer_key"
_NO_SAMPLES = "its validation generates no text to print"
_PREFERENCE_ROWS = "a preference row is a prompt and two responses, not plain text"
# Keys each algorithm never reads -> why: a value other than the default is refused, not
# ignored. tests/unit/test_config_keys.py takes these as the algorithm's answer for those keys
# and checks that each is refused.
_UNREAD_KEYS: dict[str, dict[str, str]] = {
    "SFT": {f"data.{k}": _GRPO_ONLY for k in _GRPO_DATA_KEYS},
    "DPO": {
        **{f"data.{k}": _GRPO_ONLY for k in _GRPO_DATA_KEYS},
        "data.response_key": "a preference row has two responses, read from its 'chosen' and "
        "'rejected' columns",
        "data.text_key": _PREFERENCE_ROWS,
        "data.split_long_texts": _PREFERENCE_ROWS,
        "logger.num_val_samples_to_print": _NO_SAMPLES + " (greedy accuracy is a metric)",
    },
    "GRPO": {
        "data.prompt_key": _PROBLEMS_COLUMNS,
        "data.response_key": _PROBLEMS_COLUMNS,
        "data.text_key": _PROBLEMS_COLUMNS,
        "data.split_long_texts": "GRPO problems are prompts, not plain text to train on",
    },  # fmt: skip
}
_UNREAD_KEYS["KTO"] = {
    **_UNREAD_KEYS["DPO"],
    "data.response_key": "a KTO row's response is read from its 'completion' column (a "
    "preference file's from 'chosen' and 'rejected')",
    "data.text_key": "a KTO row is a prompt, a response and its label, not plain text",
    "data.split_long_texts": "a KTO row is a prompt, a response and its label, not plain text",
}
_UNREAD_KEYS["RM"] = {
    **_UNREAD_KEYS["DPO"],
    "logger.num_val_samples_to_print": _NO_SAMPLES + " (it scores pairs)",
    "data.use_chat_template": "a reward model reads every pair through the chat template",
}
# Keys only some dataset formats read -> (those formats, what the others lack); set for any
# other format, refused.
_FORMAT_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "prompt_key": (("prompt_response", "hf", "preference", "unpaired"), "no such column"),
    "response_key": (("prompt_response", "hf"), "no such column"),
    "text_key": (("text", "hf"), "no such column"),
    "split_long_texts": (("text", "hf"), "no plain text to split"),
    "problem_key": (("problems",), "no such column"),
    "answer_key": (("problems",), "no such column"),
    "train_split": (("problems",), "no such column"),
    "val_split": (("problems",), "no such column"),
}


def _refuse_unread_keys(cfg: _Master, algorithm: str) -> None:
    """A key this algorithm (``cfg.UNREAD_KEYS``), or this dataset format, does not read is
    refused by name, with its value and the fix -- never silently ignored."""
    problems = []
    for key, why in cfg.UNREAD_KEYS.items():
        section_name, field = key.split(".")
        section = getattr(cfg, section_name)
        value = getattr(section, field)
        if value != getattr(type(section)(), field):
            problems.append(f"{key}={value!r}: {algorithm} does not read it ({why})")
    data, default = cfg.data, DataConfig()
    read_by = {data.dataset_name, *(e.dataset_name for e in data.blend)}  # a blend's entries too
    for k, (formats, lacks) in _FORMAT_KEYS.items():
        if f"data.{k}" in cfg.UNREAD_KEYS or read_by & set(formats):
            continue
        if getattr(data, k) != getattr(default, k):
            problems.append(
                f"data.{k}={getattr(data, k)!r}: data.dataset_name={data.dataset_name!r} has "
                f"{lacks} (only {', '.join(formats)} read data.{k})"
            )
    if problems:
        raise ValueError("; ".join(problems) + "; remove these keys")


# data.dataset_name values each algorithm reads (a test keeps them equal to the loaders').
GRPO_DATASETS = ("arithmetic", "gsm8k", "problems", "nemo_gym")
SFT_DATASETS = (
    "arithmetic", "arithmetic_calculator", "gsm8k", "squad", "messages", "prompt_response", "text",
    "hf",
)  # fmt: skip
PREFERENCE_DATASETS = (
    "arithmetic", "arithmetic_parity", "gsm8k", "preference", "helpsteer3", "messages_preference",
)  # fmt: skip
KTO_DATASETS = (*PREFERENCE_DATASETS, "unpaired")  # pairs are unpaired: two labelled rows
_BUILT_IN_DATASETS = ("arithmetic", "arithmetic_calculator", "arithmetic_parity", "gsm8k")


def _check_dataset(data: DataConfig, algorithm: str, names: tuple[str, ...]) -> None:
    """An unknown dataset name, or a file-based one without its file, fails at load."""
    if data.dataset_name not in names:
        raise ValueError(
            f"data.dataset_name={data.dataset_name!r} is not a {algorithm} dataset; use one of "
            f"{list(names)}"
        )
    for key in ("train_data_path", "val_data_path"):
        if data.dataset_name in _BUILT_IN_DATASETS and getattr(data, key):
            raise ValueError(
                f"data.dataset_name={data.dataset_name!r} is built in and reads no file, so "
                f"data.{key}={getattr(data, key)!r} would be ignored; to read the file set "
                "data.dataset_name to its format (e.g. problems), or remove the path"
            )
    if data.dataset_name not in _BUILT_IN_DATASETS and not data.train_data_path:
        raise ValueError(
            f"data.dataset_name={data.dataset_name!r} reads your file: it needs "
            "data.train_data_path=<file, folder or dataset id>"
        )


class _DatasetMaster(_Master):
    """SFT, DPO and RM: training rows come from a dataset of the algorithm's kind, and GRPO's
    prompt keys are refused."""

    ALGORITHM: ClassVar[str]
    DATASETS: ClassVar[tuple[str, ...]]

    @model_validator(mode="after")
    def _unread(self) -> _DatasetMaster:
        _check_dataset(self.data, self.ALGORITHM, self.DATASETS)
        _refuse_unread_keys(self, self.ALGORITHM)
        return self


class SFTMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "SFT"
    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["SFT"]
    DATASETS: ClassVar[tuple[str, ...]] = SFT_DATASETS
    sft: SFTConfig = SFTConfig()


class DPOMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "DPO"
    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["DPO"]
    DATASETS: ClassVar[tuple[str, ...]] = PREFERENCE_DATASETS
    dpo: DPOConfig = DPOConfig()


class KTOMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "KTO"
    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["KTO"]
    DATASETS: ClassVar[tuple[str, ...]] = KTO_DATASETS
    kto: KTOConfig = KTOConfig()


class RMMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "RM"
    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["RM"]
    DATASETS: ClassVar[tuple[str, ...]] = PREFERENCE_DATASETS
    rm: RMConfig = RMConfig()


class GRPOMasterConfig(_Master):
    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["GRPO"]
    grpo: GRPOConfig = GRPOConfig()
    critic: CriticConfig = CriticConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    loss_fn: LossFnConfig = LossFnConfig()
    env: EnvConfig = EnvConfig()

    @model_validator(mode="after")
    def _restarts_need_checkpoints(self) -> GRPOMasterConfig:
        if self.fault_tolerance.max_restarts and not self.checkpointing.enabled:
            raise ValueError(
                f"fault_tolerance.max_restarts={self.fault_tolerance.max_restarts} resumes from "
                "the last checkpoint: set checkpointing.enabled=true (or max_restarts=0)"
            )
        return self

    @model_validator(mode="after")
    def _rollout_batch(self) -> GRPOMasterConfig:
        _check_dataset(self.data, "GRPO", GRPO_DATASETS)
        _refuse_unread_keys(self, "GRPO")
        if self.grpo.use_leave_one_out_baseline and self.grpo.num_generations_per_prompt < 2:
            raise ValueError(
                "grpo.use_leave_one_out_baseline=true compares each sample with the others of "
                "its prompt, and grpo.num_generations_per_prompt=1 leaves none: raise "
                "num_generations_per_prompt (GRPO learns from differences within a group)"
            )
        n = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        gbs = self.policy.train_global_batch_size
        if n % gbs:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {n} is not a "
                f"multiple of policy.train_global_batch_size={gbs}"
            )
        if self.data.system_prompt_file and not self.data.use_chat_template:
            raise ValueError(
                "data.system_prompt_file needs data.use_chat_template=true (a system message "
                "exists only in the chat template)"
            )
        if self.grpo.rollout_transport == "http" and not self.policy.generation.http_server.enabled:
            raise ValueError(
                "grpo.rollout_transport=http needs policy.generation.http_server.enabled=true"
            )
        check_external(self)  # grpo.rollout_transport=external
        _check_async(self)
        _check_reward_shaping(self)
        problems = critic_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        if self.data.dataset_name == "nemo_gym" or self.env.task_name == "nemo_gym":
            gym = self.env.nemo_gym
            if bool(gym.head_server_url) == bool(gym.config_paths):
                raise ValueError(
                    "NeMo Gym needs exactly one of env.nemo_gym.head_server_url (attach to a "
                    "running Gym) and env.nemo_gym.config_paths (launch one)"
                )
            if not self.policy.generation.http_server.enabled:
                raise ValueError(
                    "NeMo Gym's agents call the trainer's generation server: set "
                    "policy.generation.http_server.enabled=true"
                )
            if self.grpo.max_rollout_turns != 1 or self.grpo.rollout_transport != "in_process":
                raise ValueError(
                    "grpo.max_rollout_turns and grpo.rollout_transport apply to tempering's own "
                    "rollout loop; NeMo Gym's agents run whole episodes (their step limit is "
                    "max_steps in the agent's Gym config): leave them at 1 and in_process"
                )
            if self.data.reasoning_gym_tasks:
                raise ValueError(
                    "data.reasoning_gym_tasks cannot join NeMo Gym rows (Gym runs whole "
                    "episodes); set data.reasoning_gym_tasks=[]"
                )
        return self


def overlong_limit(cfg: GRPOMasterConfig) -> int:
    """The generated tokens per episode DAPO's overlong penalty ends at:
    ``grpo.reward_shaping.max_response_length``, else one turn's ``max_new_tokens``."""
    return cfg.grpo.reward_shaping.max_response_length or cfg.policy.generation.max_new_tokens


def _check_reward_shaping(cfg: GRPOMasterConfig) -> None:
    """The overlong penalty's limit, where null or where no episode can reach its buffer."""
    rs = cfg.grpo.reward_shaping
    if not (rs.enabled and rs.overlong_buffer_length):
        return
    gym = "nemo_gym" in (cfg.data.dataset_name, cfg.env.task_name)  # agents run whole episodes
    turns = f"grpo.max_rollout_turns={cfg.grpo.max_rollout_turns}"
    if rs.max_response_length is None and (gym or cfg.grpo.max_rollout_turns > 1):
        raise ValueError(
            "grpo.reward_shaping.max_response_length=null stands for one turn's "
            f"policy.generation.max_new_tokens, and {'NeMo Gym' if gym else turns} episodes "
            "generate over several turns: set max_response_length to the episode's "
            "generated-token budget"
        )
    reachable = cfg.policy.max_total_sequence_length
    if not gym:
        reachable = min(
            reachable, cfg.policy.generation.max_new_tokens * cfg.grpo.max_rollout_turns
        )
    start = overlong_limit(cfg) - rs.overlong_buffer_length
    if start >= reachable:
        raise ValueError(
            f"grpo.reward_shaping penalizes episodes longer than max_response_length - "
            f"overlong_buffer_length = {start} generated tokens, and no episode can generate "
            f"more than {reachable} (policy.generation.max_new_tokens x grpo.max_rollout_turns, "
            "at most policy.max_total_sequence_length): the penalty would never apply; lower "
            "max_response_length or raise overlong_buffer_length"
        )


def _check_async(cfg: GRPOMasterConfig) -> None:
    """What asynchronous GRPO cannot do yet, refused at load with the reason."""
    a = cfg.grpo.async_grpo
    if a.in_flight_weight_updates and not a.enabled:
        raise ValueError(
            "grpo.async_grpo.in_flight_weight_updates=true loads new weights into a collector's "
            "batch in progress, which only asynchronous GRPO has: set "
            "grpo.async_grpo.enabled=true, or in_flight_weight_updates=false"
        )
    if a.in_flight_weight_updates and cfg.policy.generation.backend != "torch":
        raise ValueError(
            "grpo.async_grpo.in_flight_weight_updates=true is implemented for the torch "
            f"engine; policy.generation.backend={cfg.policy.generation.backend!r} refits "
            "between batches (drain-then-refit): set in_flight_weight_updates=false"
        )
    if not a.enabled:
        return
    if cfg.policy.generation.colocated.enabled:
        raise ValueError(
            "grpo.async_grpo.enabled=true generates while the policy trains, which needs "
            "generation workers of their own (colocated generation shares the policy's "
            "workers or GPUs): set policy.generation.colocated.enabled=false"
        )
    if cfg.grpo.use_dynamic_sampling:
        raise ValueError(
            "grpo.use_dynamic_sampling=true with grpo.async_grpo.enabled=true is not supported "
            "yet (the collector makes one batch per step); set one of them to false"
        )


class DistillationMasterConfig(_Master):
    """On-policy distillation: the student (``policy``) samples as GRPO does, the frozen
    ``teacher`` scores each sampled token with its top-k log-probs, the student trains on the
    KL (tempering/algorithms/distillation.py). GRPO's rules for the rollouts apply, under
    ``distillation.*`` names."""

    UNREAD_KEYS: ClassVar[dict[str, str]] = _UNREAD_KEYS["GRPO"]
    distillation: DistillationConfig = DistillationConfig()
    loss_fn: DistillationLossConfig = DistillationLossConfig()
    teacher: TeacherConfig = TeacherConfig()
    env: EnvConfig = EnvConfig()

    @model_validator(mode="after")
    def _rollouts_as_grpo(self) -> DistillationMasterConfig:
        self.grpo_view()
        return self

    def grpo_view(self) -> GRPOMasterConfig:
        """The GRPO config of this run's rollouts (`as_grpo_config`), validated by GRPO's
        rules; a problem is reported under its ``distillation.*`` name."""
        sections = {k: getattr(self, k) for k in ("cluster", "logger", "checkpointing", "data",
                                                  "deadlines", "env")}  # fmt: skip
        try:
            return GRPOMasterConfig(**as_grpo_config(self.distillation, self.policy, sections))
        except ValidationError as exc:
            msgs = [str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()]
            text = "; ".join(msgs).replace("grpo.", "distillation.")
            raise ValueError(text.replace("GRPO does not", "distillation does not")) from None


MASTER_CONFIGS: dict[str, type[_Master]] = {
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "kto": KTOMasterConfig,
    "rm": RMMasterConfig,
    "grpo": GRPOMasterConfig,
    "distillation": DistillationMasterConfig,
}
