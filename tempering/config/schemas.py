"""Typed configuration schemas: one default per field, validated before anything starts.

Key names follow NeMo RL's (`policy.model_name`, `grpo.num_prompts_per_step`, ...), so a
NeMo RL override line works unchanged. Builders turn these models into plain arguments;
library classes never receive a config object. Field descriptions double as ``--help``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class DTensorConfig(Section):
    enabled: bool = Field(True, description="the DTensor/FSDP2 path (the only one)")
    activation_checkpointing: bool = False
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks splitting each decoder layer (inside a node); DP = ranks / TP"
    )
    cpu_offload: bool = Field(False, description="not implemented; only false")
    sequence_parallel: bool = Field(False, description="not implemented; only false")

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
    enabled: bool = False
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
    algorithm: Literal["first_fit_decreasing"] = "first_fit_decreasing"


class OptimizerKwargs(Section):
    lr: float = Field(5e-6, gt=0)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


class OptimizerConfig(Section):
    name: str = Field("torch.optim.AdamW", description="torch.optim.AdamW or torch.optim.SGD")
    kwargs: OptimizerKwargs = OptimizerKwargs()


class SchedulerConfig(Section):
    """Simpler than NeMo RL's list of schedulers: linear warmup, then one shape."""

    name: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class GenerationResourcesConfig(Section):
    """What split generation takes from the cluster (NeMo RL's colocated.resources)."""

    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs per node for generation (the policy gets the rest)"
    )
    num_nodes: int | None = Field(
        None, ge=1, description="nodes for generation (several nodes: whole nodes of its own)"
    )


class ColocatedConfig(Section):
    enabled: bool = Field(
        True,
        description="generation shares the policy's workers (torch) or GPUs (vLLM sleeps "
        "while the policy trains); false: generation on resources of its own",
    )
    resources: GenerationResourcesConfig = GenerationResourcesConfig()


class VllmConfig(Section):
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    max_model_len: int | None = None
    enforce_eager: bool = True
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"


class HttpServerConfig(Section):
    """The OpenAI-compatible generation server (tempering/models/generation/openai_server.py)."""

    enabled: bool = Field(
        False, description="serve the generator over HTTP while training (NeMo Gym, HTTP rollouts)"
    )
    host: str = Field("127.0.0.1", description="bind address; anything but loopback needs a key")
    port: int = Field(0, ge=0, le=65535, description="0 = a free port chosen by the OS")
    api_key_env: str | None = Field(
        None, description="name of the environment variable holding the API key (never the key)"
    )
    model_name: str = Field("policy", description="the model name clients send")
    batch_wait_ms: float = Field(5.0, ge=0, description="collect concurrent requests this long")
    max_batch_size: int = Field(256, ge=1, description="requests per backend call at most")
    on_noncontiguous: Literal["error", "truncate"] = Field(
        "error", description="history whose token ids cannot be continued: 400, or fall back"
    )
    tool_parser: Literal["hermes"] = "hermes"
    eot_token: str | None = Field(
        None, description="the chat template's end-of-turn token; default: detected"
    )
    ssl_certfile: str | None = Field(
        None, description="PEM certificate: serve https (with ssl_keyfile; docs/security.md)"
    )
    ssl_keyfile: str | None = Field(
        None, description="the certificate's unencrypted PEM private key (with ssl_certfile)"
    )
    ssl_ca_file: str | None = Field(
        None, description="CA our clients (HTTP rollouts) trust; default: the certfile itself"
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="a bigger request body gets 413"
    )
    access_log: bool = Field(
        True, description="one JSONL row per request in <logger.log_dir>/http_access.jsonl"
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> HttpServerConfig:
        prefix = "policy.generation.http_server"
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            given = "ssl_certfile" if self.ssl_keyfile is None else "ssl_keyfile"
            raise ValueError(f"{prefix}.{given} is set alone: https needs both ssl_certfile "
                             "and ssl_keyfile (or neither, for http)")  # fmt: skip
        if self.ssl_ca_file is not None and self.ssl_certfile is None:
            raise ValueError(f"{prefix}.ssl_ca_file is set without ssl_certfile/ssl_keyfile: "
                             "there is no https to trust; remove it")  # fmt: skip
        return self


class GenerationConfig(Section):
    backend: Literal["torch", "vllm"] = "torch"
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    colocated: ColocatedConfig = ColocatedConfig()
    vllm_cfg: VllmConfig = VllmConfig()
    http_server: HttpServerConfig = HttpServerConfig()


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
    logprob_batch_size: int = Field(32, ge=1)
    max_total_sequence_length: int = Field(512, ge=2)
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
    max_grad_norm: float | None = 1.0
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
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(
                "policy.dynamic_batching.enabled=true and policy.sequence_packing.enabled=true "
                "cannot both be set (as in NeMo RL); disable one of them"
            )
        return self


# ---------------------------------------------------------------- cluster/logging
class ClusterConfig(Section):
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, description="0 = CPU workers")
    workers_per_node: int = Field(1, ge=1, description="workers per node when gpus_per_node=0")
    cpus_per_worker: int = Field(1, ge=1)
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="memory of one GPU, for the placement plan's fit check"
    )


class WandbConfig(Section):
    project: str = "tempering"
    name: str | None = None


class TensorboardConfig(Section):
    log_dir: str | None = None


class MlflowConfig(Section):
    experiment_name: str = "tempering"
    tracking_uri: str | None = None


class LoggerConfig(Section):
    log_dir: str = "logs/run"
    wandb_enabled: bool = False
    tensorboard_enabled: bool = True
    mlflow_enabled: bool = False
    monitor_gpus: bool = Field(
        True, description="per-role CPU, memory and GPU use in metrics.jsonl (resources/*)"
    )
    num_val_samples_to_print: int = Field(3, ge=0)
    wandb: WandbConfig = WandbConfig()
    tensorboard: TensorboardConfig = TensorboardConfig()
    mlflow: MlflowConfig = MlflowConfig()


class DeadlinesConfig(Section):
    """Seconds each phase may wait on its workers before the run stops with the phase, the
    ranks that did not answer and their Python stacks (tempering/distributed/deadlines.py)."""

    startup_s: float = Field(
        1800.0, gt=0, description="a worker group starting (imports, venv build, model load)"
    )
    generation_s: float = Field(1800.0, gt=0, description="a generation call")
    refit_s: float = Field(1800.0, gt=0, description="moving weights to the generator")
    train_s: float = Field(1800.0, gt=0, description="one training call (a whole step)")
    logprobs_s: float = Field(1800.0, gt=0, description="a log-prob pass (policy or reference)")
    environment_s: float = Field(1800.0, gt=0, description="an environment actor's step()")
    checkpoint_s: float = Field(1800.0, gt=0, description="saving/loading/exporting weights")
    call_s: float = Field(1800.0, gt=0, description="any other worker call")

    def as_phases(self) -> dict[str, float]:
        return {name.removesuffix("_s"): value for name, value in self.model_dump().items()}


class CheckpointingConfig(Section):
    enabled: bool = True
    checkpoint_dir: str = "results/run"
    metric_name: str | None = Field(None, description="e.g. val/accuracy; keep_top_k ranks by it")
    higher_is_better: bool = True
    keep_top_k: int | None = Field(3, ge=1)
    save_period: int = Field(10, ge=1)


class DataConfig(Section):
    dataset_name: str = Field(
        "arithmetic",
        description="arithmetic | gsm8k | problems | nemo_gym (GRPO) | squad | messages | prompt_response | hf | preference | helpsteer3",
    )
    train_data_path: str | None = None
    val_data_path: str | None = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    max_input_seq_length: int | None = Field(None, description="not read; only null")
    num_train_samples: int = Field(20000, ge=1, description="generated datasets: how many")
    num_val_samples: int = Field(256, ge=1)
    use_chat_template: bool = Field(
        False, description="format prompts with the tokenizer's chat template"
    )
    on_bad_row: Literal["error", "skip"] = "error"
    seed: int = 0
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


class SFTConfig(Section):
    max_num_steps: int = Field(300, ge=1)
    max_num_epochs: int = Field(100, ge=1)
    val_period: int = Field(50, ge=0, description="0 = no validation")
    val_batches: int = Field(4, ge=1)
    val_global_batch_size: int = Field(64, ge=1)
    val_micro_batch_size: int = Field(32, ge=1)
    val_at_start: bool = True
    seed: int = 42
    stop_val_accuracy_range: tuple[float, float] | None = Field(
        None, description="stop when greedy val accuracy falls inside [lo, hi] (tiny-arith recipe)"
    )
    arithmetic_problems_per_sample: int = Field(
        1,
        ge=1,
        description="arithmetic data: chain this many problems into one training conversation "
        "(user/assistant turns), so the model answers in context (tiny-arith-chat)",
    )


class PreferenceLoopConfig(Section):
    """The keys of the preference-training loop DPO and the reward model share
    (`tempering.algorithms.preference.train_loop`)."""

    max_num_steps: int = Field(100, ge=1)
    max_num_epochs: int = Field(100, ge=1)
    val_period: int = Field(20, ge=0)
    val_batches: int = Field(4, ge=1)
    val_global_batch_size: int = Field(32, ge=2)
    val_micro_batch_size: int = Field(16, ge=2)
    val_at_start: bool = True
    seed: int = 42


class DPOConfig(PreferenceLoopConfig):
    reference_policy_kl_penalty: float = Field(0.1, gt=0, description="beta")
    preference_average_log_probs: bool = Field(
        False, description="mean instead of sum of token log-probs per sequence"
    )
    sft_loss_weight: float = Field(0.0, ge=0, description="weight of NLL on the chosen response")
    val_greedy_accuracy: bool = Field(
        True, description="arithmetic data: also report tiny-arith greedy accuracy at validation"
    )


class RMConfig(PreferenceLoopConfig):
    export_dir: str | None = Field(
        None, description="HF folder for the final reward model; default <checkpoint_dir>/final_hf"
    )


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(16, ge=1)
    num_generations_per_prompt: int = Field(8, ge=1)
    max_num_steps: int = Field(60, ge=1)
    max_num_epochs: int = Field(100, ge=1)
    max_rollout_turns: int = Field(
        1, ge=1, description="turns per episode at most (generate -> environment -> observe)"
    )
    rollout_transport: Literal["in_process", "http"] = Field(
        "in_process",
        description="rollouts call the chat service directly, or over HTTP through "
        "policy.generation.http_server (which must be enabled)",
    )
    normalize_rewards: bool = Field(True, description="divide advantages by the group std")
    use_leave_one_out_baseline: bool = True
    val_period: int = Field(10, ge=0)
    val_at_start: bool = True
    max_val_samples: int = Field(256, ge=1)
    val_batch_size: int = Field(256, ge=1)
    val_pass_at_k: int = Field(0, ge=0, description="k samples per val prompt for pass@k; 0 = off")
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(4, ge=1)
    overlong_filtering: bool = False
    max_wall_time_s: float | None = Field(None, description="stop after this many seconds")
    seed: int = 42


class LossFnConfig(Section):
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    ratio_clip_min: float = Field(0.2, ge=0)
    ratio_clip_max: float = Field(0.2, ge=0, description="> ratio_clip_min = DAPO clip-higher")
    ratio_clip_c: float | None = Field(None, gt=1, description="dual-clip constant (> 1)")
    token_level_loss: bool = True
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: float | None = 2.0


class MathEnvConfig(Section):
    num_workers: int = Field(2, ge=1)
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per answer checked")
    memory_limit_mb: int = Field(
        1024, ge=64, description="address space of each sandboxed verifier process"
    )
    cpu_limit_s: int = Field(
        300, ge=1, description="CPU seconds a verifier process may use before it is replaced"
    )
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="stop the run when more of one step's answers than this make the verifier "
        "raise (a broken verifier scores everything 0); model text that attacks the verifier "
        "counts too",
    )


class ArithmeticRetryEnvConfig(Section):
    max_attempts: int = Field(3, ge=1, description="answers per episode before it fails")
    discount: float = Field(0.5, gt=0, le=1, description="a correct attempt n earns discount^(n-1)")


class CalculatorEnvConfig(Section):
    max_tool_calls: int = Field(4, ge=0, description="calls per episode before it ends unscored")


class NemoGymConfig(Section):
    """NeMo Gym (tempering/environments/nemo_gym.py): attach to a running Gym, or launch one."""

    head_server_url: str | None = Field(
        None, description="attach mode: a running Gym head server, e.g. http://127.0.0.1:11000"
    )
    config_paths: list[str] = Field(
        default_factory=list,
        description="launch mode: Gym config files (e.g. resources_servers/math_with_judge/"
        "configs/math_with_judge.yaml); tempering starts Gym in its own venv, pointed at the "
        "trainer's generation server",
    )
    head_server_port: int = Field(11000, ge=1, le=65535, description="launch mode: Gym's head port")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="launch mode: more keys for Gym's global config (dotted keys are not split)",
    )
    prebuilt_server_venvs: bool = Field(
        True,
        description="launch mode: every Gym server runs in the one Gym venv tempering builds "
        "(false: Gym builds a venv per server with uv, its supported route on Python 3.13)",
    )
    default_route: str | None = Field(
        None, description="agent or environment-server instance for rows without routing fields"
    )
    concurrency: int = Field(64, ge=1, description="/run requests in flight at most")
    request_timeout_s: float = Field(600.0, gt=0, description="per /run request")
    max_retries: int = Field(3, ge=0, description="retries on connection errors, timeouts, 5xx")
    retry_backoff_s: float = Field(0.5, ge=0, description="first retry delay (then doubled)")
    startup_timeout_s: float = Field(600.0, gt=0, description="launch mode: Gym start-up limit")
    on_noncontiguous: Literal["error", "truncate"] = Field(
        "error", description="a rollout whose model calls do not extend each other"
    )


class EnvConfig(Section):
    task_name: str | None = Field(
        None,
        description="score every problem with this environment (e.g. arithmetic_retry, "
        "calculator) instead of the dataset's own (arithmetic, math)",
    )
    math: MathEnvConfig = MathEnvConfig()
    arithmetic_retry: ArithmeticRetryEnvConfig = ArithmeticRetryEnvConfig()
    calculator: CalculatorEnvConfig = CalculatorEnvConfig()
    nemo_gym: NemoGymConfig = NemoGymConfig()
    reward_fn: str | None = Field(None, description="dotted path 'pkg.mod:fn' to a custom reward")
    reward_model_path: str | None = Field(
        None, description="a trained RM folder (task reward_model)"
    )


# ---------------------------------------------------------------- master configs
class _Master(Section):
    policy: PolicyConfig = PolicyConfig()
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    data: DataConfig = DataConfig()
    deadlines: DeadlinesConfig = DeadlinesConfig()


_GRPO_ONLY_DATA_KEYS = (
    "problem_key",
    "answer_key",
    "train_split",
    "val_split",
    "prompt_file",
    "system_prompt_file",
    "reasoning_gym_tasks",
)


def _reject_grpo_data_keys(data: DataConfig, algorithm: str) -> None:
    """A key that no code reads is refused, not ignored (GRPO's data keys elsewhere)."""
    default = DataConfig()
    set_keys = [k for k in _GRPO_ONLY_DATA_KEYS if getattr(data, k) != getattr(default, k)]
    if set_keys:
        raise ValueError(
            f"data.{', data.'.join(set_keys)} apply to GRPO problems only; {algorithm} does not "
            "read them: remove them"
        )


# data.dataset_name values each algorithm reads (a test keeps them equal to the loaders').
GRPO_DATASETS = ("arithmetic", "gsm8k", "problems", "nemo_gym")
SFT_DATASETS = ("arithmetic", "gsm8k", "squad", "messages", "prompt_response", "hf")
PREFERENCE_DATASETS = (
    "arithmetic", "arithmetic_parity", "gsm8k", "preference", "helpsteer3", "messages_preference",
)  # fmt: skip
_BUILT_IN_DATASETS = ("arithmetic", "arithmetic_parity", "gsm8k")  # need no file


def _check_dataset(data: DataConfig, algorithm: str, names: tuple[str, ...]) -> None:
    """An unknown dataset name, or a file-based one without its file, fails at load."""
    if data.dataset_name not in names:
        raise ValueError(
            f"data.dataset_name={data.dataset_name!r} is not a {algorithm} dataset; use one of "
            f"{list(names)}"
        )
    if data.dataset_name in _BUILT_IN_DATASETS and data.train_data_path:
        raise ValueError(
            f"data.dataset_name={data.dataset_name!r} is built in and reads no file, so "
            f"data.train_data_path={data.train_data_path!r} would be ignored; to train on the "
            "file set data.dataset_name to its format (e.g. problems), or remove the path"
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
        _reject_grpo_data_keys(self.data, self.ALGORITHM)
        _check_dataset(self.data, self.ALGORITHM, self.DATASETS)
        return self


class SFTMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "SFT"
    DATASETS: ClassVar[tuple[str, ...]] = SFT_DATASETS
    sft: SFTConfig = SFTConfig()


class DPOMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "DPO"
    DATASETS: ClassVar[tuple[str, ...]] = PREFERENCE_DATASETS
    dpo: DPOConfig = DPOConfig()


class RMMasterConfig(_DatasetMaster):
    ALGORITHM: ClassVar[str] = "RM"
    DATASETS: ClassVar[tuple[str, ...]] = PREFERENCE_DATASETS
    rm: RMConfig = RMConfig()


class FaultToleranceConfig(Section):
    max_restarts: int = Field(
        0,
        ge=0,
        description="restart the worker groups and resume from the last checkpoint in the same "
        "process after a dead worker or an expired deadline, this many times (needs "
        "checkpointing.enabled)",
    )


class GRPOMasterConfig(_Master):
    grpo: GRPOConfig = GRPOConfig()
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


MASTER_CONFIGS: dict[str, type[_Master]] = {
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "rm": RMMasterConfig,
    "grpo": GRPOMasterConfig,
}
