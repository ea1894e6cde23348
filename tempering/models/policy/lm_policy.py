"""`Policy`: the controller's handle on a causal LM trained by a Ray worker group.

It implements `PolicyInterface` (plus the optional `ColocatablePolicy`, `RefittablePolicy`
and `HFExportablePolicy`) over a `RayWorkerGroup` of `FSDP2PolicyWorker`s, one per bundle of a
`RayVirtualCluster`. Each call names the worker method and how the data is split, and gathers
results in rank order. Like the worker, the facade keeps a small surface: the weights for
generation engines are a handle of their own (``policy.refit``: `PolicyWeights`, over the
workers' ``refit`` component), and colocated generation is driven by
`tempering.models.generation.builders.ColocatedGeneration` over the workers' ``generation``
component once `init_colocated_generation` has built it:

    cluster = RayVirtualCluster([2], num_cpus_per_bundle=1)
    policy = build_policy(cluster, "tiny-arith", train_global_batch_size=32,
                          train_micro_batch_size=8, learning_rate=3e-3)
    metrics = policy.train(batch, NLLLoss())          # {"loss", "grad_norm", "lr", ...}
    lp = policy.get_logprobs(batch)["logprobs"]       # [B, S], contract layout
    policy.save_checkpoint("ckpt/step_10/policy")
    policy.shutdown()
"""

from __future__ import annotations

import inspect
from typing import Any

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
from tempering.losses import LossFunction
from tempering.models.policy.interfaces import PolicyInterface
from tempering.utils.allocator import allocator_env
from tempering.utils.threads import governed_openmp_env

POLICY_WORKER_FQN = "tempering.models.policy.fsdp2_worker.FSDP2PolicyWorker"
_LOGPROB_KEYS = ("input_ids", "input_lengths")


class Policy(PolicyInterface):
    """A data-parallel policy over `worker_group` (built by `build_policy`).

    Args:
        worker_group: a group of `FSDP2PolicyWorker`s.
        train_global_batch_size: samples per optimizer step, over all DP ranks.
        train_micro_batch_size: samples per forward/backward pass on one rank.
        logprob_micro_batch_size: samples per forward pass in `get_logprobs` (default: the
            train micro-batch size).
        max_tokens_per_microbatch: dynamic micro-batches under this padded-token budget
            instead of a fixed micro-batch size (train and log-probs); None = fixed size.
        logprob_max_tokens_per_microbatch: the budget for log-prob passes (no gradients, so
            usually larger; default: ``max_tokens_per_microbatch``).
        sequence_packing: pack sequences (no padding) into bins of
            ``max_tokens_per_microbatch`` tokens instead (see `FSDP2PolicyWorker`).
    """

    def __init__(
        self,
        worker_group: RayWorkerGroup,
        *,
        train_global_batch_size: int,
        train_micro_batch_size: int,
        logprob_micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        sequence_packing: bool = False,
        logprob_max_tokens_per_microbatch: int | None = None,
        cluster: RayVirtualCluster | None = None,
    ) -> None:
        if sequence_packing and max_tokens_per_microbatch is None:
            raise ValueError(
                "sequence packing needs a bin size: pass max_tokens_per_microbatch "
                "(policy.sequence_packing.train_mb_tokens)"
            )
        dp = worker_group.dp_size
        if train_global_batch_size % dp:
            raise ValueError(
                f"policy.train_global_batch_size={train_global_batch_size} is not divisible by "
                f"the data-parallel size {dp}; use a multiple of {dp}"
            )
        self.worker_group = worker_group
        self.cluster = cluster  # its bundles (colocated generation places engines on them)
        self.train_global_batch_size = train_global_batch_size
        self.train_micro_batch_size = train_micro_batch_size
        self.logprob_micro_batch_size = logprob_micro_batch_size or train_micro_batch_size
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.logprob_max_tokens_per_microbatch = (
            logprob_max_tokens_per_microbatch or max_tokens_per_microbatch
        )
        self.sequence_packing = sequence_packing
        self.refit = PolicyWeights(worker_group)  # the weights, whole or in refit buckets

    @property
    def dp_size(self) -> int:
        return self.worker_group.dp_size

    # ------------------------------------------------------------------ train
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        *,
        eval_mode: bool = False,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        with_reference: bool = False,
    ) -> dict[str, float]:
        """One optimizer step per `global_batch_size` samples of `data` (default: the
        policy's train_global_batch_size); returns global metrics (see FSDP2PolicyWorker.train).
        ``with_reference``: the workers compute ``reference_policy_logprobs`` per micro-batch
        (DPO; GRPO with KL), instead of a `get_reference_policy_logprobs` call before this one."""
        gbs = global_batch_size or self.train_global_batch_size
        if data.size % gbs:
            raise ValueError(
                f"Policy.train got {data.size} samples, not a multiple of the global batch size "
                f"{gbs}; drop or pad the remainder (set sample_mask=0 on padding rows)"
            )
        futures = self.worker_group.run_all_workers_sharded_data(
            "train",
            data,
            batch_size=gbs,
            loss_fn=loss_fn,
            global_batch_size=gbs,
            micro_batch_size=micro_batch_size or self.train_micro_batch_size,
            max_tokens_per_microbatch=self.max_tokens_per_microbatch,
            pack_sequences=self.sequence_packing,
            eval_mode=eval_mode,
            with_reference=with_reference,
        )
        results = self.worker_group.get_all_worker_results(futures)
        return results[0]  # all-reduced inside the workers: every rank returns the same

    # --------------------------------------------------------------- log-probs
    def get_logprobs(self, data: BatchedDataDict, temperature: float = 1.0) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` in the contract layout, rows in the order of `data`."""
        return self._sharded_logprobs("get_logprobs", data, temperature)

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, temperature: float = 1.0
    ) -> BatchedDataDict:
        """``{"reference_policy_logprobs": [B, S]}`` from the frozen initial weights
        (needs ``init_reference_model=True`` in `build_policy`)."""
        return self._sharded_logprobs("get_reference_policy_logprobs", data, temperature)

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0
    ) -> BatchedDataDict:
        """A teacher's ``{"teacher_topk_logprobs", "teacher_topk_indices"}`` ``[B, S, k]``
        (on-policy distillation), each data-parallel rank scoring its shard of the rows."""
        return self._sharded_logprobs("get_topk_logprobs", data, temperature, k=k)

    def _sharded_logprobs(
        self, method: str, data: BatchedDataDict, temperature: float, **extra: Any
    ) -> BatchedDataDict:
        return sharded(
            self,
            method,
            BatchedDataDict({k: data[k] for k in _LOGPROB_KEYS}),
            micro_batch_size=self.logprob_micro_batch_size,
            max_tokens_per_microbatch=self.logprob_max_tokens_per_microbatch,
            pack_sequences=self.sequence_packing,
            temperature=temperature,
            **extra,
        )

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Every worker writes its shard of model + optimizer state under `path` (DCP)."""
        _run_all(self.worker_group, "checkpoint.save", str(path))

    def load_checkpoint(self, path: str) -> None:
        _run_all(self.worker_group, "checkpoint.load", str(path))

    def export_hf(self, path: str, adapter: bool = False) -> None:
        """Gather the full weights and write an HF folder (rank 0) that ``from_pretrained``
        loads (LoRA: the adapters merged in). ``adapter``: the LoRA adapters alone instead, in
        PEFT's format (``PeftModel.from_pretrained(base, path)`` loads them)."""
        method = "checkpoint.export_adapter" if adapter else "checkpoint.export_hf"
        _run_all(self.worker_group, method, str(path))

    # ------------------------------------------------- colocated generation
    def init_colocated_generation(self, sampling: dict[str, Any], dtype: str = "float32") -> None:
        """Give every worker a torch generation engine over its own weights, sampling in
        ``dtype``; then `tempering.models.generation.builders.ColocatedGeneration` drives them."""
        _run_all(self.worker_group, "generation.init", sampling, dtype)

    # ---------------------------------------------------------- colocation
    def prepare_for_generation(self) -> None:
        _run_all(self.worker_group, "prepare_for_generation")

    def prepare_for_training(self) -> None:
        _run_all(self.worker_group, "prepare_for_training")

    def shutdown(self) -> None:
        self.worker_group.shutdown()


class PolicyWeights:
    """`Policy.refit`: the policy's weights for generation engines, from the workers' ``refit``
    component (`tempering.models.policy.weight_streaming`). A handle of its own, so the
    facade keeps a small surface and the refit calls read ``policy.refit.bucket(...)``."""

    def __init__(self, worker_group: RayWorkerGroup) -> None:
        self.worker_group = worker_group

    def state_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """Full (gathered) CPU tensors by HF parameter name, for the generation workers."""
        return _run_all(self.worker_group, "refit.state_dict", dtype)[0]

    def buckets(self, bucket_bytes: int) -> list[list[str]]:
        """State-dict names in layer-aligned buckets (see `tempering.models.generation.refit`)."""
        return _run_all(self.worker_group, "refit.buckets", bucket_bytes)[0]

    def bucket(self, names: list[str], dtype: str | None) -> tuple[Any, int]:
        """``(object ref, bytes)`` of one bucket in ``dtype``, put by rank 0 (never fetched here)."""
        return _run_all(self.worker_group, "refit.bucket", names, dtype)[0]

    def adapter(self) -> tuple[Any, int]:
        """``(object ref, bytes)`` of the LoRA adapters alone, put by rank 0 (PEFT's names)."""
        return _run_all(self.worker_group, "refit.adapter")[0]


def _run_all(worker_group: RayWorkerGroup, method: str, *args: Any) -> list[Any]:
    """``method`` (a worker's, or ``"component.method"``) on every worker, in rank order."""
    futures = worker_group.run_all_workers_single_data(method, *args)
    return worker_group.get_all_worker_results(futures)


def sharded(policy: Policy, method: str, view: BatchedDataDict, **kwargs: Any) -> BatchedDataDict:
    """The workers' ``method(shard, **kwargs)``, each data-parallel rank of ``policy`` on its
    shard of ``view``'s rows, merged in the order of ``view`` (log-probs, a reward model's
    scores, a critic's values)."""
    n = view.size
    pad = (-n) % policy.dp_size
    if pad:  # shards must be equal: repeat row 0, drop the extra results below
        view = BatchedDataDict.from_batches([view, view.select_indices([0] * pad)])
    futures = policy.worker_group.run_all_workers_sharded_data(method, view, **kwargs)
    merged = BatchedDataDict.from_batches(policy.worker_group.get_dp_results(futures))
    return merged.slice(0, n) if pad else merged


def build_policy(
    cluster: RayVirtualCluster,
    model_path: str,
    *,
    name_prefix: str = "policy",
    env_vars: dict[str, str] | None = None,
    tensor_parallel_size: int = 1,
    gpu_share: float | None = None,
    cpu_share: float | None = None,
    allocator: str = "mimalloc",
    **kwargs: Any,
) -> Policy:
    """Start one `FSDP2PolicyWorker` per bundle of `cluster` and wrap them in a `Policy`.

    Plain arguments only (the algorithm's builder reads them from the config). ``kwargs`` are
    `Policy`'s batch settings (``train_global_batch_size`` and ``train_micro_batch_size``
    required, ``logprob_micro_batch_size``, ``max_tokens_per_microbatch``,
    ``sequence_packing``, ``logprob_max_tokens_per_microbatch``) and, all the others,
    `FSDP2PolicyWorker`'s keyword arguments (``learning_rate``, ``precision``, ``head``, ...),
    each documented and defaulted once, where it is used. ``gpu_share``: the share of its
    bundle's GPU each worker takes in Ray's accounting (colocated vLLM takes the rest);
    ``cpu_share``: its CPUs (None: all; 0 for a group on bundles another group holds).
    ``allocator``: the workers' malloc, "mimalloc" (preloaded) or "system"
    (`tempering.utils.allocator`).
    """
    policy_kwargs = {k: kwargs.pop(k) for k in _POLICY_ARGS if k in kwargs}
    inspect.signature(Policy).bind(None, **policy_kwargs)  # a missing batch size: TypeError
    dp = sum(cluster.bundle_ct_per_node_list) // tensor_parallel_size
    _check_divisible(policy_kwargs["train_global_batch_size"], dp, tensor_parallel_size)
    builder = RayWorkerBuilder(
        POLICY_WORKER_FQN, model_path, tensor_parallel_size=tensor_parallel_size, **kwargs
    )
    cpu_openmp = {} if gpu_share else governed_openmp_env()  # CPU: threads follow free cores
    group = RayWorkerGroup(
        cluster, builder, name_prefix=name_prefix,
        env_vars={**allocator_env(allocator), **cpu_openmp, **(env_vars or {})},
        tensor_parallel_size=tensor_parallel_size, num_gpus_per_worker=gpu_share,
        num_cpus_per_worker=cpu_share,
    )  # fmt: skip
    try:
        return Policy(group, cluster=cluster, **policy_kwargs)
    except BaseException:
        group.shutdown()
        raise


# `Policy`'s keyword arguments, which `build_policy` keeps from those it hands the workers.
_POLICY_ARGS = tuple(
    name
    for name, param in inspect.signature(Policy).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY and name != "cluster"
)


def _check_divisible(train_global_batch_size: int, dp: int, tensor_parallel_size: int) -> None:
    if train_global_batch_size % dp:
        raise ValueError(
            f"policy.train_global_batch_size={train_global_batch_size} is not divisible by "
            f"the data-parallel size {dp} (one worker per bundle, {tensor_parallel_size} per "
            f"tensor-parallel group); use a multiple of {dp}"
        )
