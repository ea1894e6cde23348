"""Turn `policy.generation` into a generator the algorithm loop can call.

Three shapes, one small interface (`generate`, `refit`, `finish_generation`, `reseed`,
`shutdown`, and for the OpenAI-compatible server `num_replicas` + `generate_on`, which targets
one data-parallel replica so that all turns of a conversation land on the same engine):
- **Colocated torch** (`backend=torch`, `colocated.enabled=true`, the CPU default): each
  policy worker runs the torch engine on an unsharded copy of its own weights, over its DP
  shard of the prompts. Refit copies the trained (sharded) weights into that copy inside the
  worker: no tensor leaves the worker process.
- **Split** (`colocated.enabled=false`, torch or vLLM): generation workers on bundles of
  their own (the placement plan's generation group; a vLLM engine per `tensor_parallel_size`
  GPUs of one node). Refit streams the weights in layer-aligned, size-bounded buckets in the
  generator's dtype through Ray's object store (`refit.py`); the controller never holds them.
- **Colocated vLLM** (`backend=vllm`, `colocated.enabled=true`, the GPU default): vLLM
  engines on the policy's own GPUs (one per TP group of bundles). vLLM sleeps while the
  policy trains (`finish_generation`) and wakes for the refit, with the policy's optimizer
  state moved to host memory meanwhile. GPU only (the planner refuses it on CPU); not yet run
  on hardware.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tempering.config.schemas import ClusterConfig, PolicyConfig
from tempering.config.schemas import GenerationConfig as GenerationSection
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.interfaces import SamplingConfig

TORCH_WORKER_FQN = "tempering.models.generation.torch_worker.TorchGenerationWorker"
VLLM_WORKER_FQN = "tempering.models.generation.vllm_worker.VllmGenerationWorker"


def sampling_from_config(
    gen: GenerationSection, tokenizer: Any, seed: int | None = None
) -> SamplingConfig:
    return SamplingConfig(
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_new_tokens=gen.max_new_tokens,
        stop_token_ids=list(gen.stop_token_ids or []),
        stop_strings=list(gen.stop_strings or []),
        seed=seed,
    )


class _ReplicaGeneration:
    """What both shapes share: prompts sharded over a worker group's data-parallel replicas, or
    all of them sent to one replica. ``generate_method`` names the workers' method: the
    generation workers' ``"generate"``, or the policy workers' ``"generation.generate"``.

    One concrete level, no hooks to override: the two shapes below differ only in their refit
    life cycle (refit, reseed, finish_generation, shutdown), which each states in full."""

    worker_group: Any
    generate_method: str

    def generate(
        self, data: BatchedDataDict, greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> BatchedDataDict:
        return data_parallel_generate(
            self.worker_group, data, self.generate_method, greedy=greedy, sampling=sampling
        )

    @property
    def num_replicas(self) -> int:
        return int(self.worker_group.dp_size)

    def generate_on(
        self,
        replica: int,
        data: BatchedDataDict,
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
    ) -> BatchedDataDict:
        return replica_generate(
            self.worker_group, replica, data, greedy, sampling, self.generate_method
        )


class ColocatedGeneration(_ReplicaGeneration):
    """Generation inside the policy's own workers (torch engine); refit in place.

    Drives the policy workers' ``generation`` component
    (`tempering.models.policy.colocated_generation`) by its dotted method names."""

    generate_method = "generation.generate"

    def __init__(self, policy: Any, sampling: SamplingConfig, dtype: str = "float32") -> None:
        """``dtype``: the engines' sampling precision (`GenerationConfig.torch_dtype_name`)."""
        self.policy = policy
        self.worker_group = policy.worker_group
        self.sampling = sampling
        policy.init_colocated_generation(dataclasses.asdict(sampling), dtype)

    def refit(self, policy: Any, version: int | None = None) -> None:
        """Every policy worker copies its trained weights into its engine (``version`` is
        the chat service's to keep)."""
        _run_all(policy.worker_group, "generation.refit")

    def reseed(self, seed: int) -> None:
        """Every worker's sampling stream restarts from ``seed`` (offset by rank)."""
        _run_all(self.worker_group, "generation.reseed", seed)

    def finish_generation(self) -> None:
        """Nothing to free: the engine's copy lives in the policy worker."""

    def shutdown(self) -> None:
        """The engine lives and dies with the policy workers."""


class SplitGeneration(_ReplicaGeneration):
    """A worker group of generation workers fed new weights through the object store.

    ``sleeps``: colocated vLLM (GPU): the engines sleep after generating and the refit wakes
    them, with the policy's optimizer state off the GPU in between (see module docstring).
    ``in_flight``: the torch engines take a refit while they generate (async GRPO's
    ``in_flight_weight_updates``): the buckets are staged, and ``commit_weights(version)``
    makes each engine load them between two decode steps. ``adapter_refit``: vLLM engines
    built with a LoRA slot take the policy's adapters alone (`update_adapter`), their base
    weights never changing (``vllm_cfg.lora_adapter_refit``)."""

    generate_method = "generate"

    def __init__(
        self,
        worker_group: Any,
        cluster: Any,
        sleeps: bool = False,
        refit_dtype: str | None = None,
        in_flight: bool = False,
        adapter_refit: bool = False,
    ) -> None:
        self.worker_group = worker_group
        self.adapter_refit = adapter_refit
        self.cluster = cluster  # None when it shares the policy's (colocated)
        self.sleeps = sleeps
        self.refit_dtype = refit_dtype
        self.in_flight = in_flight
        self.version = 0  # the weight version the engines hold (in-flight: their tokens')
        self.last_refit_bytes = 0  # what the last refit put into the object store
        self._policy: Any = None

    def reseed(self, seed: int) -> None:
        """Every worker's sampling stream restarts from ``seed`` (offset by rank)."""
        _run_all(self.worker_group, "reseed", seed)

    def refit(self, policy: Any, version: int | None = None) -> None:
        """The policy's current weights into every engine (`refit.stream_weights`) as
        ``version`` (default: the next)."""
        from tempering.models.generation.refit import stream_weights

        self.version = self.version + 1 if version is None else version
        if self.sleeps:  # colocated: optimizer state off the GPU, engines awake to load
            self._policy = policy
            policy.prepare_for_generation()
            _run_all(self.worker_group, "prepare_for_generation")
        if self.adapter_refit:
            ref, self.last_refit_bytes = policy.refit.adapter()
            _run_all(self.worker_group, "update_adapter", ref)
            return
        if not self.in_flight:
            self.last_refit_bytes = stream_weights(policy, self.worker_group, self.refit_dtype)
            return
        self.last_refit_bytes = stream_weights(
            policy, self.worker_group, self.refit_dtype, method="stage_weights"
        )
        _run_all(self.worker_group, "commit_weights", self.version)

    def finish_generation(self) -> None:
        """Colocated vLLM: the engines sleep, the policy's optimizer state comes back."""
        if self.sleeps:
            _run_all(self.worker_group, "finish_generation")
            if self._policy is not None:
                self._policy.prepare_for_training()

    def shutdown(self) -> None:
        self.worker_group.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


def _run_all(worker_group: Any, method: str, *args: Any) -> None:
    futures = worker_group.run_all_workers_single_data(method, *args)
    worker_group.get_all_worker_results(futures)


_GENERATE_KEYS = ("input_ids", "input_lengths", "max_new_tokens")


def _generate_view(data: BatchedDataDict) -> BatchedDataDict:
    return BatchedDataDict({k: data[k] for k in _GENERATE_KEYS if k in data})


def replica_generate(
    worker_group: Any,
    replica: int,
    data: BatchedDataDict,
    greedy: bool,
    sampling: SamplingConfig | None,
    method: str = "generate",
) -> BatchedDataDict:
    """All of `data` on one worker (rank `replica`), by its ``method``."""
    future = worker_group.run_single_worker(
        replica, method, _generate_view(data), greedy=greedy, sampling=sampling
    )
    return worker_group.get_all_worker_results([future])[0]


def data_parallel_generate(
    worker_group: Any, data: BatchedDataDict, method: str = "generate", **kw: Any
) -> BatchedDataDict:
    """Shard prompts over the workers (padding to equal shards), gather in order."""
    n, dp = data.size, worker_group.dp_size
    view = _generate_view(data)
    pad = (-n) % dp
    if pad:
        view = BatchedDataDict.from_batches([view, view.select_indices([0] * pad)])
    futures = worker_group.run_all_workers_sharded_data(method, view, **kw)
    out = BatchedDataDict.from_batches(worker_group.get_dp_results(futures))
    return out.slice(0, n) if pad else out


def needs_policy_workers(policy_cfg: PolicyConfig, plan: Any) -> bool:
    """Whether `build_generation` needs the policy's workers up: a colocated torch engine
    lives in them, and colocated vLLM engines share their GPUs. Any other generator starts
    on workers of its own, at the same time as the policy's (`common.build_beside`)."""
    gen = policy_cfg.generation
    colocated_torch = gen.backend == "torch" and gen.colocated.enabled
    return colocated_torch or bool(plan.generation and plan.generation.colocated_with)


def build_generation(
    policy_cfg: PolicyConfig,
    policy: Any,
    model_path: str,
    tokenizer: Any,
    plan: Any,
    cluster_cfg: ClusterConfig,
    in_flight_weight_updates: bool = False,
) -> ColocatedGeneration | SplitGeneration:
    """The generator ``policy.generation`` and the placement ``plan`` describe (see the module
    docstring); ``in_flight_weight_updates`` (split torch workers only; the config refuses the
    rest): refits reach workers while they generate. ``policy``: None where
    `needs_policy_workers` is false (it is not read then)."""
    gen = policy_cfg.generation
    sampling = sampling_from_config(gen, tokenizer)
    tokenizer_path = tokenizer.name_or_path  # the run's (`policy.tokenizer.name`), resolved
    if gen.backend == "torch" and gen.colocated.enabled:
        return ColocatedGeneration(policy, sampling, gen.torch_dtype_name)
    from tempering.distributed.virtual_cluster import cluster_for_group
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    group_plan = plan.generation
    on_gpus = cluster_cfg.gpus_per_node > 0
    adapter_refit = gen.backend == "vllm" and gen.vllm_cfg.lora_adapter_refit
    if gen.backend == "torch":
        builder = RayWorkerBuilder(
            TORCH_WORKER_FQN, model_path, dataclasses.asdict(sampling),
            in_flight=in_flight_weight_updates, dtype=gen.torch_dtype_name,
            tokenizer_path=tokenizer_path,
        )  # fmt: skip
        refit_dtype = gen.precision  # weights travel in the engine's dtype (null: as trained)
    else:
        if not on_gpus:
            from transformers import AutoConfig

            from tempering.models.families import check_vllm_cpu_refit
            from tempering.models.registry import hub_offline

            config = AutoConfig.from_pretrained(model_path, local_files_only=hub_offline())
            check_vllm_cpu_refit(config.model_type)
        v = gen.vllm_cfg
        builder = RayWorkerBuilder(
            VLLM_WORKER_FQN,
            model_path,
            sampling,
            dtype=v.precision,
            gpu_memory_utilization=v.gpu_memory_utilization,
            tensor_parallel_size=group_plan.tp,
            max_model_len=v.max_model_len,
            enforce_eager=v.enforce_eager,
            enable_sleep_mode=gen.colocated.enabled,
            # CPU engines need an explicit KV-cache size (GPU ones size it from utilization).
            kv_cache_memory_bytes=None if on_gpus else 256 * 2**20,
            lora_rank=policy_cfg.dtensor_cfg.lora_cfg.dim if adapter_refit else None,
            tokenizer_path=tokenizer_path,
        )
        refit_dtype = v.precision  # weights travel in the engine's dtype
    if group_plan.colocated_with:  # vLLM on the policy's GPUs (GPU only; not yet run on hardware)
        group = start_colocated_engines(policy, group_plan, builder, plan.gpu_share)
        generation = SplitGeneration(
            group, None, sleeps=True, refit_dtype=refit_dtype, adapter_refit=adapter_refit
        )
    else:
        cluster = cluster_for_group(group_plan, cluster_cfg.cpus_per_worker, "generation")
        group = RayWorkerGroup(
            cluster, builder, name_prefix=f"gen-{gen.backend}",
            max_concurrency=2 if in_flight_weight_updates else 1,
        )  # fmt: skip
        generation = SplitGeneration(
            group, cluster, refit_dtype=refit_dtype, in_flight=in_flight_weight_updates,
            adapter_refit=adapter_refit,
        )  # fmt: skip
    return generation  # loaded from the model files: `start_generation` gives it the policy's


def start_generation(chat: Any, generation: Any, policy: Any, version: int) -> None:
    """The generator takes the policy's weights once, as ``version`` (the step a run resumed
    at, else 0), through the chat service (which keeps the version). Call it after the
    checkpoint is loaded: a resumed run then moves its weights once, not the model files'
    and then the checkpoint's. Split workers start from the model files, so they always take
    them; colocated torch engines start as copies of the policy's weights, so only a resume
    refits them."""
    if version or not isinstance(generation, ColocatedGeneration):
        chat.refit(lambda: generation.refit(policy, version=version), version=version)


# Colocated vLLM: the policy worker and the engine on a GPU each take this share of it in
# Ray's accounting (the memory is shared in time: vLLM sleeps while the policy trains); a
# distillation teacher on the same GPUs makes it a third (`Plan.gpu_share`).
COLOCATED_GPU_SHARE = 0.5


def start_colocated_engines(
    policy: Any, group_plan: Any, builder: Any, gpu_share: float | None = COLOCATED_GPU_SHARE
) -> Any:
    """One engine per TP group of the policy's bundles, sharing their GPUs (see below), each
    taking ``gpu_share`` of its GPU in Ray's books."""
    from tempering.distributed.worker_groups import RayWorkerGroup

    bundles, envs = colocated_engine_placement(group_plan, policy.worker_group.worker_info)
    return RayWorkerGroup(
        policy.cluster, builder, name_prefix="gen-vllm", num_gpus_per_worker=gpu_share,
        num_cpus_per_worker=0,  # the policy worker holds the bundle's CPUs
        bundle_indices=bundles, env_vars_per_rank=envs,
    )  # fmt: skip


def colocated_engine_placement(
    group_plan: Any, policy_workers: list[dict[str, Any]]
) -> tuple[list[int], list[dict[str, str]]]:
    """Where each colocated vLLM engine goes: the first bundle of its TP group of policy
    bundles, seeing that group's GPUs (the ids Ray gave the policy workers there). Ray would
    show an actor only its own bundle's GPU, hence RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    and CUDA_VISIBLE_DEVICES set from the policy workers' ids."""
    tp, bundles, envs = group_plan.tp, [], []
    for engine in range(group_plan.workers):
        first = engine * tp
        ids = [gpu for w in policy_workers[first : first + tp] for gpu in w["gpu_ids"]]
        bundles.append(first)
        envs.append({"CUDA_VISIBLE_DEVICES": ",".join(ids),
                     "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})  # fmt: skip
    return bundles, envs


def build_chat_service(
    gen: GenerationSection,
    generation: Any,
    tokenizer: Any,
    max_model_len: int,
    chat_template: str | None = None,
) -> Any:
    """The chat service (prompts, batching, refit lock) over `generation`; HTTP or not."""
    from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings

    srv = gen.http_server
    settings = ServerSettings(
        model_name=srv.model_name,
        max_model_len=max_model_len,
        default_sampling=sampling_from_config(gen, tokenizer),
        training_mode=True,
        batch_wait_ms=srv.batch_wait_ms,
        max_batch_size=srv.max_batch_size,
        on_noncontiguous=srv.on_noncontiguous,
        tool_parser=srv.tool_parser,
        chat_template=chat_template,
        eot_token=srv.eot_token,
    )
    return ChatCompletionService(generation, tokenizer, settings)


def start_http_server(gen: GenerationSection, service: Any, log_dir: str | None = None) -> Any:
    """Start the OpenAI-compatible server when `policy.generation.http_server.enabled`; its
    access log goes to ``<log_dir>/http_access.jsonl`` (``http_server.access_log``)."""
    import os

    from tempering.models.generation.openai_server import OpenAIServer

    srv = gen.http_server
    if not srv.enabled:
        return None
    api_key = None
    if srv.api_key_env:
        api_key = os.environ.get(srv.api_key_env)
        if not api_key:
            raise ValueError(
                f"policy.generation.http_server.api_key_env={srv.api_key_env!r} names an "
                "environment variable that is unset or empty; export it with the key"
            )
    if srv.access_log and not log_dir:
        raise ValueError(
            "policy.generation.http_server.access_log=true needs the run's log directory "
            "(logger.log_dir); set it, or access_log=false"
        )
    return OpenAIServer(
        service,
        srv.host,
        srv.port,
        api_key,
        ssl_certfile=srv.ssl_certfile,
        ssl_keyfile=srv.ssl_keyfile,
        ssl_ca_file=srv.ssl_ca_file,
        max_request_bytes=srv.max_request_bytes,
        access_log=os.path.join(log_dir, "http_access.jsonl") if srv.access_log else None,
    ).start()
