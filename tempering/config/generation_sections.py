"""The config sections of generation (``policy.generation``: the backend, its engine's
settings, colocation, the HTTP server). `tempering.config.schemas` re-exports them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tempering.config.section import Section


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
    tensor_parallel_size: int = Field(
        1,
        description="GPUs each vLLM engine spans (inside one node; must divide its generation GPUs)",
    )
    gpu_memory_utilization: float = Field(
        0.6, description="share of each GPU's memory vLLM takes for weights and KV cache (0-1)"
    )
    max_model_len: int | None = Field(
        None, description="vLLM's context length in tokens; null: the model's own"
    )
    enforce_eager: bool = Field(
        True, description="run vLLM in eager PyTorch, without CUDA graphs (as CPU engines must)"
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="vLLM's weight and compute dtype; refits send weights in it"
    )
    lora_adapter_refit: bool = Field(
        False, description="with policy.dtensor_cfg.lora_cfg.enabled: refit sends the adapters "
        "alone (the engine applies them as a LoRA request) instead of merged weights"
    )  # fmt: skip


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
    tool_parser: Literal["hermes", "llama3_json", "mistral", "auto"] = Field(
        "hermes", description="tool-call format; auto: the model family's, by end-of-turn token"
    )
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
    backend: Literal["torch", "vllm"] = Field(
        "torch", description="the generation engine: tempering's torch engine, or vLLM engines"
    )
    precision: Literal["float32", "bfloat16"] | None = Field(
        None, description="the torch engine's weights and compute while sampling (the trainer "
        "keeps policy.precision): null = float32; bfloat16 halves the engine's copy and its "
        "refit bytes, and the sampler/trainer mismatch is logged (train/token_mult_prob_error, "
        "train/gen_kl_error) and corrected by loss_fn.use_importance_sampling_correction. "
        "vLLM's is vllm_cfg.precision"
    )  # fmt: skip
    max_new_tokens: int = Field(
        256, ge=1, description="tokens generated per turn at most (finish reason 'length' there)"
    )
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature; RL log-probs are computed at it too"
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus sampling: likeliest tokens up to this mass (< 1: torch engine only)",
    )
    top_k: int | None = Field(
        None,
        description="sample from the k likeliest tokens only; null: all (set: torch engine only)",
    )
    stop_token_ids: list[int] | None = Field(
        None, description="token ids that end a turn (kept), besides the tokenizer's eos"
    )
    stop_strings: list[str] | None = Field(
        None, description="strings that end a turn once the generated text holds one (kept)"
    )
    colocated: ColocatedConfig = ColocatedConfig()
    vllm_cfg: VllmConfig = VllmConfig()
    http_server: HttpServerConfig = HttpServerConfig()

    @model_validator(mode="after")
    def _precision_for_torch(self) -> GenerationConfig:
        if self.backend == "vllm" and self.precision is not None:
            raise ValueError(
                f"policy.generation.precision={self.precision!r} sets the torch engine's dtype; "
                "vLLM's is policy.generation.vllm_cfg.precision: set that one and leave "
                "precision null"
            )
        return self

    @property
    def torch_dtype_name(self) -> str:
        """The torch engine's sampling dtype (``precision``, float32 when unset)."""
        return self.precision or "float32"
