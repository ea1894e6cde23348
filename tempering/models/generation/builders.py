"""Turn `policy.generation` into a generator the algorithm loop can call.

Two shapes, one small interface (`generate`, `refit`, `shutdown`, and for the OpenAI-compatible
server `num_replicas` + `generate_on`, which targets one data-parallel replica so that all
turns of a conversation land on the same engine):
- **Colocated** (torch backend, `colocated.enabled=true`, the CPU default): each policy
  worker runs the torch engine on an unsharded copy of its own weights, over its DP shard of
  the prompts. Refit copies the trained (sharded) weights into that copy inside the worker:
  no tensor leaves the worker process.
- **Split** (vLLM, or torch with `colocated.enabled=false`): a separate worker group of
  generation workers. Refit: policy rank 0 puts its full state dict into Ray's object store
  and returns only the ref; each generation worker fetches the tensors itself, so they never
  pass through the controller.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tempering.config.schemas import ClusterConfig
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


class ColocatedGeneration:
    """Generation inside the policy's own workers (torch engine); refit in place."""

    def __init__(self, policy: Any, sampling: SamplingConfig) -> None:
        self.policy = policy
        self.sampling = sampling
        policy.init_colocated_generation(dataclasses.asdict(sampling))

    def generate(
        self, data: BatchedDataDict, greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> BatchedDataDict:
        return self.policy.generate(data, greedy=greedy, sampling=sampling)

    @property
    def num_replicas(self) -> int:
        return int(self.policy.worker_group.dp_size)

    def generate_on(
        self,
        replica: int,
        data: BatchedDataDict,
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
    ) -> BatchedDataDict:
        return replica_generate(self.policy.worker_group, replica, data, greedy, sampling)

    def refit(self, policy: Any) -> None:
        policy.refit_colocated_generation()

    def reseed(self, seed: int) -> None:
        """Every worker's sampling stream restarts from ``seed`` (offset by rank)."""
        self.policy.reseed_generation(seed)

    def shutdown(self) -> None:
        """The engine lives and dies with the policy workers."""


class SplitGeneration:
    """A worker group of generation workers fed new weights through the object store."""

    def __init__(self, worker_group: Any, cluster: Any) -> None:
        self.worker_group = worker_group
        self.cluster = cluster

    def generate(
        self, data: BatchedDataDict, greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> BatchedDataDict:
        return data_parallel_generate(self.worker_group, data, greedy=greedy, sampling=sampling)

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
        return replica_generate(self.worker_group, replica, data, greedy, sampling)

    def reseed(self, seed: int) -> None:
        """Every worker's sampling stream restarts from ``seed`` (offset by rank)."""
        futures = self.worker_group.run_all_workers_single_data("reseed", seed)
        self.worker_group.get_all_worker_results(futures)

    def refit(self, policy: Any) -> None:
        ref = policy.state_dict_ref_for_refit()
        futures = self.worker_group.run_all_workers_single_data("update_weights", ref)
        self.worker_group.get_all_worker_results(futures)

    def shutdown(self) -> None:
        self.worker_group.shutdown()
        self.cluster.shutdown()


_GENERATE_KEYS = ("input_ids", "input_lengths", "max_new_tokens")


def _generate_view(data: BatchedDataDict) -> BatchedDataDict:
    return BatchedDataDict({k: data[k] for k in _GENERATE_KEYS if k in data})


def replica_generate(
    worker_group: Any,
    replica: int,
    data: BatchedDataDict,
    greedy: bool,
    sampling: SamplingConfig | None,
) -> BatchedDataDict:
    """All of `data` on one worker (rank `replica`)."""
    future = worker_group.run_single_worker(
        replica, "generate", _generate_view(data), greedy=greedy, sampling=sampling
    )
    return worker_group.get_all_worker_results([future])[0]


def data_parallel_generate(worker_group: Any, data: BatchedDataDict, **kw: Any) -> BatchedDataDict:
    """Shard prompts over the workers (padding to equal shards), gather in order."""
    n, dp = data.size, worker_group.dp_size
    view = _generate_view(data)
    pad = (-n) % dp
    if pad:
        view = BatchedDataDict.from_batches([view, view.select_indices([0] * pad)])
    futures = worker_group.run_all_workers_sharded_data("generate", view, **kw)
    out = BatchedDataDict.from_batches(worker_group.get_dp_results(futures))
    return out.slice(0, n) if pad else out


def build_generation(
    gen: GenerationSection, policy: Any, model_path: str, tokenizer: Any, cluster_cfg: ClusterConfig
) -> ColocatedGeneration | SplitGeneration:
    sampling = sampling_from_config(gen, tokenizer)
    if gen.backend == "torch" and gen.colocated.enabled:
        return ColocatedGeneration(policy, sampling)
    from tempering.distributed.virtual_cluster import cluster_from_config
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    cluster = cluster_from_config(
        cluster_cfg.num_nodes,
        cluster_cfg.gpus_per_node,
        workers_per_node=cluster_cfg.workers_per_node,
        cpus_per_worker=cluster_cfg.cpus_per_worker,
        name="generation",
    )
    if gen.backend == "torch":
        builder = RayWorkerBuilder(TORCH_WORKER_FQN, model_path, dataclasses.asdict(sampling))
    else:
        v = gen.vllm_cfg
        builder = RayWorkerBuilder(
            VLLM_WORKER_FQN,
            model_path,
            sampling,
            dtype=v.precision,
            gpu_memory_utilization=v.gpu_memory_utilization,
            tensor_parallel_size=v.tensor_parallel_size,
            max_model_len=v.max_model_len,
            enforce_eager=v.enforce_eager,
            # CPU engines need an explicit KV-cache size (GPU ones size it from utilization).
            kv_cache_memory_bytes=None if cluster_cfg.gpus_per_node else 256 * 2**20,
        )
    group = RayWorkerGroup(cluster, builder, name_prefix=f"gen-{gen.backend}")
    generation = SplitGeneration(group, cluster)
    generation.refit(policy)  # start from the policy's current weights
    return generation


def build_chat_service(
    gen: GenerationSection,
    generation: Any,
    tokenizer: Any,
    max_model_len: int,
    chat_template: str | None = None,
) -> Any:
    """The chat service (prompts, batching, refit lock) over `generation`; HTTP or not."""
    from tempering.models.generation.openai_server import ChatCompletionService, ServerSettings

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


def start_http_server(gen: GenerationSection, service: Any) -> Any:
    """Start the OpenAI-compatible server when `policy.generation.http_server.enabled`."""
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
    return OpenAIServer(service, srv.host, srv.port, api_key).start()
