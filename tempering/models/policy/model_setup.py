"""Setting up one policy rank: the process group, the device mesh, and the sharded model.

The part of `FSDP2PolicyWorker` that runs once, in its ``__init__`` (the worker's other
responsibilities are split out too; see `tempering.models.policy.fsdp2_worker`):

- `init_topology` joins ``torch.distributed`` (gloo on CPU; ``cpu:gloo,cuda:nccl`` on GPU) and
  returns this rank's `Topology`: rank, sizes, device, the ``dp`` (x ``tp``) device mesh and
  the collectives over the data-parallel ranks every step needs;
- `load_sharded` loads the HF model (`tempering.models.hf`: a registry name or a local folder)
  and shards it with ``fully_shard`` per decoder layer and at the root, after splitting each
  layer over the tensor-parallel ranks by its family's plan (`models.families.tp_plan_for`,
  by ``config.model_type``: the Llama-style split by default; a family whose layers cannot be
  split is refused before any weight is read). Memory-lean with several ranks: only rank 0
  reads the checkpoint, the others build the model on the meta device and receive their shards;
- `shared_prefix_ratio` decides whether rows that start alike may share their prefix's compute;
- `PolicyState` holds what set-up produced, shared by the worker's components.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tempering.models.export import AUTO_CLASSES
from tempering.models.families import tp_plan_for
from tempering.models.hf import decoder_layers
from tempering.models.policy.gated_mlp import use_lean_gated_mlp
from tempering.models.policy.lora import LoraAdapters, LoraSpec
from tempering.models.policy.microbatching import PaddingFree
from tempering.models.policy.norm_recompute import recompute_norm_outputs
from tempering.models.policy.packed_attention import PACKED_SDPA, use_packed_sdpa
from tempering.models.policy.shared_prefix import BOOL_MASK_ATTENTION, attention_cost_ratio

logger = logging.getLogger(__name__)

PRECISIONS = ("float32", "bfloat16")
# The activation savers (`gated_mlp`, `norm_recompute`) drop what they save in a layer where it
# comes to at least this much and keep it where less: each pays fixed costs per call (hooks, a
# recompute pass) that a few MiB do not repay. Measured 2026-11-29 (2 EPYC cores, fp32,
# in-process, 15 interleaved blocks of 10 steps): tiny-arith's SFT step (two norm outputs 1.4
# MiB, the MLP's activation 2.8 MiB a layer) ~5% faster without them; SmolLM2-135M's (8 GSM8K
# rows: 6.6-10 and 9-14 MiB a layer, ~0.6 GiB a step) within noise either way (10.4-12.3 s a
# step), so it keeps the savings, as does the 4 x 384 LoRA micro-batch of README "LoRA" (6.75
# and 9 MiB a layer).
LEAN_MIN_BYTES = 4 << 20
# What the model ends in: next-token logits (a policy), one score per sequence (a reward
# model: AutoModelForSequenceClassification with one label, trained with BradleyTerryLoss), or
# one value per token (a PPO critic: AutoModelForTokenClassification with one label, trained
# with ValueLoss).
HEADS = tuple(AUTO_CLASSES)  # causal_lm, score (a reward model), value (a PPO critic)


def check_options(precision: str, head: str, pad_token_id: int | None) -> None:
    """Refuse an unknown precision or head before anything is loaded."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; use one of {PRECISIONS}")
    if head not in HEADS or (head == "score" and pad_token_id is None):
        raise ValueError(
            f"head={head!r} (pad_token_id={pad_token_id}): use one of {HEADS}; 'score' "
            "needs the tokenizer's pad_token_id (the score is read at the last real token)"
        )


def require_head(head: str, wanted: str, method: str) -> None:
    """A method that only one kind of head answers (log-probs, scores, generation)."""
    if head != wanted:
        raise RuntimeError(f"{method} needs a worker built with head={wanted!r}, not {head!r}")


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: parameters cast to bf16 for forward/backward, fp32 master weights and optimizer
    state, gradients reduced in fp32 (FSDP2's MixedPrecisionPolicy)."""
    if precision == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather when ``t`` is a sharded DTensor; collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------ topology
@dataclass
class Topology:
    """Where this rank sits: ``rank = dp_rank * tp_size + tp_rank``; ``dp_group`` is None
    without TP (the default group is the data-parallel one)."""

    rank: int
    world_size: int
    dp_size: int
    tp_size: int
    device: torch.device
    mesh: Any
    dp_mesh: Any
    tp_mesh: Any
    dp_group: Any

    def all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        """Over the data-parallel ranks (the ranks of a TP group hold the same data)."""
        if self.dp_size == 1:  # the values themselves, without a collective's round trip
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.dp_group)  # gloo: CPU tensors in both backends
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every data-parallel rank."""
        if self.dp_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, obj, group=self.dp_group)
        return gathered

    def equalise(self, count: int) -> int:
        """Every rank must run the same number of forward passes (FSDP2 collectives)."""
        return int(self.all_reduce([float(count)], op=dist.ReduceOp.MAX)[0])

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "dp_size": self.dp_size, "tp_size": self.tp_size}  # fmt: skip


STANDIN_GPUS_ENV = "TEMPERING_STANDIN_GPUS"  # "1": CPU-only Ray nodes stand in for GPU ones


def cuda_unusable_reason() -> str:
    """Why torch sees no GPU here, and the fix."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build; install the CUDA build "
            "(uv sync --no-group cpu --group gpu: README, 'Environments: CPU and GPU from one lock')"
        )
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: a driver "
        f"missing or older than CUDA {torch.version.cuda} needs, or CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}; see nvidia-smi"
    )


def check_assigned_gpus() -> None:
    """A worker Ray gave GPUs must see them: else it would train on the CPU, silently, many
    times slower. ``TEMPERING_STANDIN_GPUS=1`` allows it, logged (the tests' CPU-only Ray nodes
    that declare GPUs)."""
    if torch.cuda.is_available():
        return
    # A Ray worker has Ray loaded before it runs our code; a process without it (a test, or
    # tools/gpu_check.py on a machine with no Ray) was given no GPUs by Ray.
    ray = sys.modules.get("ray")
    ids = ray.get_gpu_ids() if ray is not None and ray.is_initialized() else []
    if not ids:
        return
    where = f"worker on {socket.gethostname()} given GPU(s) {ids} (cluster.gpus_per_node > 0)"
    if os.environ.get(STANDIN_GPUS_ENV) == "1":
        logger.warning("%s computes on CPU: %s=1", where, STANDIN_GPUS_ENV)
        return
    raise RuntimeError(
        f"{where}, but {cuda_unusable_reason()}; or set cluster.gpus_per_node=0 to train on CPUs"
    )


def init_topology(tp_size: int) -> Topology:
    """Join the process group (RANK, WORLD_SIZE, LOCAL_RANK from the environment) and build the
    ``dp`` (x ``tp``) device mesh. A group started earlier in this process is reused."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_assigned_gpus()
    if torch.cuda.is_available():
        index = local_rank if torch.cuda.device_count() > local_rank else 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size,
            **rendezvous(_init_method(world_size), rank, world_size),
        )  # fmt: skip
    # A group started earlier in this process (e.g. by a test) is reused as it is.
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the {world_size} ranks")
    dp_size = world_size // tp_size
    if tp_size == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
        return Topology(rank, world_size, dp_size, tp_size, device, mesh, mesh, None, None)
    # rank = dp_rank * tp + tp_rank: a TP group is consecutive ranks (one node)
    mesh = init_device_mesh(device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"]
    dp_group = dp_mesh.get_group()  # counts and metrics: once per DP rank
    return Topology(rank, world_size, dp_size, tp_size, device, mesh, dp_mesh, mesh["tp"], dp_group)


def _init_method(world_size: int) -> str:
    """The worker group's (``TEMPERING_DIST_INIT_METHOD``: a private file store on one
    node), else MASTER_ADDR/MASTER_PORT, else a free loopback port for a lone rank."""
    if os.environ.get("TEMPERING_DIST_INIT_METHOD"):
        return os.environ["TEMPERING_DIST_INIT_METHOD"]
    port = os.environ.get("MASTER_PORT")
    if port is None:
        if world_size != 1:
            raise RuntimeError(
                f"FSDP2PolicyWorker: WORLD_SIZE={world_size} but MASTER_PORT is not "
                "set; start workers through a RayWorkerGroup or set MASTER_ADDR/MASTER_PORT"
            )
        port = str(_free_port())
    return f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"


def rendezvous(init_method: str, rank: int, world_size: int) -> dict[str, Any]:
    """``init_process_group`` arguments for `init_method`. ``file://`` (one node: the worker
    group's private folder) is passed on. ``tcp://HOST:PORT`` becomes a TCPStore that rank 0
    serves on HOST only -- the address Ray reported for its node, or loopback -- through a
    socket bound here (torch's own ``tcp://`` store listens on every interface). The store
    has no authentication: whoever reaches HOST:PORT during start-up can join or disturb the
    rendezvous (docs/cluster.md)."""
    if not init_method.startswith("tcp://"):
        return {"init_method": init_method}
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return {"store": tcp_store(host.strip("[]"), int(port), rank, world_size)}


def tcp_store(host: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens on `host`:`port` (that address only), the others
    connect to it."""
    from torch.distributed.constants import default_pg_timeout

    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, default_pg_timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    # detach: the store owns the descriptor from here (a GC'd socket object would close it)
    return dist.TCPStore(host, port, world_size, True, default_pg_timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelSource:
    """Which model to build: a registry name or HF folder, and its head; and the run's
    tokenizer (``tokenizer_path``, default the model's; ``chat_template`` replacing its
    template), which colocated generation decodes with and exports ship."""

    model_path: str
    head: str = "causal_lm"
    pad_token_id: int | None = None
    tokenizer_path: str | None = None
    chat_template: str | None = None

    def tokenizer(self) -> Any:
        from tempering.models.hf import load_tokenizer

        return load_tokenizer(self.tokenizer_path or self.model_path, self.chat_template)

    def read(self) -> torch.nn.Module:
        """The model with its weights, read from disk (fp32)."""
        from tempering.models.hf import (
            load_causal_lm,
            load_sequence_classifier,
            load_token_classifier,
        )

        if self.head == "score":
            assert self.pad_token_id is not None
            return load_sequence_classifier(self.model_path, self.pad_token_id)
        if self.head == "value":
            return load_token_classifier(self.model_path)
        return load_causal_lm(self.model_path, dtype=torch.float32)

    def config(self) -> Any:
        """The model's transformers config (config.json only: no weights read)."""
        from transformers import AutoConfig

        from tempering.models.registry import hub_offline, resolve_model_path

        return AutoConfig.from_pretrained(
            resolve_model_path(self.model_path), local_files_only=hub_offline()
        )

    def empty(self) -> torch.nn.Module:
        """The model's architecture on the meta device: no weights read, no memory used."""
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoModelForTokenClassification,
        )

        from tempering.models.hf import value_head_config

        config = self.config()
        auto = AutoModelForCausalLM
        if self.head == "score":
            config.num_labels, config.pad_token_id = 1, self.pad_token_id
            auto = AutoModelForSequenceClassification
        elif self.head == "value":
            config, auto = value_head_config(config), AutoModelForTokenClassification
        with torch.device("meta"):
            return auto.from_config(config, dtype=torch.float32).eval()


@dataclass
class PolicyState:
    """What the worker and its components share (one holder, built once by
    `FSDP2PolicyWorker.__init__`): this rank's place, the model, its frozen reference copy,
    its LoRA adapters, and the optimizer with its LR schedule (None for an inference-only
    policy)."""

    topo: Topology
    source: ModelSource
    model: torch.nn.Module
    reference_model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    lora: LoraAdapters | None = None

    @property
    def has_reference(self) -> bool:
        """A frozen reference exists: a second copy, or the LoRA model's own base."""
        return self.reference_model is not None or self.lora is not None

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The frozen initial policy to run forwards on: the reference copy, or (LoRA) the
        model itself with its adapters off -- no second copy of the weights."""
        if self.reference_model is not None:
            yield self.reference_model
        elif self.lora is not None:
            with self.lora.disabled():
                yield self.model
        else:
            raise RuntimeError(
                "this policy worker has no reference model; build it with "
                "init_reference_model=True (or with LoRA, whose base model is the reference)"
            )

    def hf_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors as the model's own names and weights (LoRA: adapters merged in)."""
        return self.lora.merge(state) if self.lora is not None else state


def load_sharded(
    source: ModelSource,
    topo: Topology,
    mp_policy: MixedPrecisionPolicy,
    *,
    activation_checkpointing: bool,
    lean_loading: bool,
    lora: LoraSpec | None = None,
) -> tuple[torch.nn.Module, LoraAdapters | None]:
    """The model, sharded (a single fp32 rank: the plain module, see below), and its LoRA
    adapters (`lora.py`; attached before the model is split). Memory-lean with several ranks
    (``lean_loading``): only rank 0 reads the checkpoint; the others build the model on the
    meta device (no memory), shard it, and receive their shards from rank 0
    (`_fill_from_rank0`)."""
    # Refuse a family whose layers cannot be split before any weight is read.
    tp_plan = tp_plan_for(source.config().model_type) if topo.tp_size > 1 else None
    lean = lean_loading and topo.world_size > 1
    full_state = None
    if lean:  # every rank shards the same empty model (TP and FSDP2 then need no data)
        model = source.empty()
        if topo.rank == 0:  # broadcast below: the weights, and the buffers they imply
            read = source.read()
            if lora is not None:  # the same names; rank 0's initial adapters for every rank
                LoraAdapters.attach(read, lora, source.head)
            full_state = {
                "state": dict(read.state_dict()),
                "buffers": dict(read.named_buffers()),
            }
    else:
        model = source.read()
    adapters = LoraAdapters.attach(model, lora, source.head) if lora is not None else None
    if adapters is not None and mp_policy.param_dtype is not None:
        adapters.freeze_base_in(model, mp_policy.param_dtype)  # bf16: half the base's memory
    use_packed_sdpa(model)  # packed micro-batches cost their sequences, not their bins
    use_lean_gated_mlp(model, LEAN_MIN_BYTES)  # act(gate(x)) recomputed in backward, not saved
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = _decoder_layers(model)
    if not activation_checkpointing:  # (it recomputes whole layers already)
        recompute_norm_outputs(layers, LEAN_MIN_BYTES)  # norm outputs recomputed, not saved
    if topo.world_size == 1 and mp_policy.param_dtype is None:
        # One fp32 rank has nothing to shard, gather or reduce: FSDP2's per-layer hooks
        # and DTensor dispatch cost ~20% of a tiny-arith step (bench/bench_floor.py).
        # Checkpoints stay DCP, so they load into any layout.
        return model.to(topo.device), adapters
    if topo.tp_mesh is not None and tp_plan is not None:
        for layer in layers:
            plan = adapters.tp_plan(layer, tp_plan) if adapters is not None else tp_plan
            _tensor_parallel(layer, topo.tp_mesh, plan)
    for layer in layers:
        fully_shard(layer, mesh=topo.dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=topo.dp_mesh, mp_policy=mp_policy)
    if lean:
        _fill_from_rank0(model, full_state, topo.device)
    return model, adapters


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = decoder_layers(model)
    if not layers:
        names = sorted(getattr(model, "_no_split_modules", None) or [])
        raise ValueError(
            f"FSDP2PolicyWorker: found no decoder layers in {type(model).__name__} "
            f"(_no_split_modules={names}); this model class is not supported"
        )
    return layers


def _tensor_parallel(layer: torch.nn.Module, tp_mesh: Any, plan: dict[str, str]) -> None:
    """Split one decoder layer over the TP ranks by `plan` (module name -> colwise/rowwise)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = {n for n, _ in layer.named_modules()}
    missing = sorted(set(plan) - names)
    if missing:
        raise ValueError(
            f"tensor parallelism: {type(layer).__name__} has no {missing}; its TP plan (from "
            "tempering.models.families, by config.model_type) does not fit this layer. Fix: set "
            "policy.dtensor_cfg.tensor_parallel_size=1, or register the family with its plan"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(layer, tp_mesh, {n: styles[kind]() for n, kind in plan.items()})


def _fill_from_rank0(
    model: torch.nn.Module, full_state: dict[str, Any] | None, device: torch.device
) -> None:
    """Rank 0 broadcasts the file's tensors; each rank keeps its shard. Buffers that are
    not in the state dict (e.g. rotary frequencies) are recomputed by rank 0's read model
    and broadcast whole. Collective."""
    model.to_empty(device=device)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state["state"] if full_state else {}, options=opts)
    for name, buffer in model.named_buffers():
        if full_state:
            buffer.copy_(full_state["buffers"][name])
        dist.broadcast(buffer, src=0)


def shared_prefix_ratio(model: torch.nn.Module, head: str) -> float | None:
    """The cost ratio `plan_shared_prefix` weighs groups with; None (rows computed apart,
    logged) where the attention cannot take the tree mask or the model routes to experts;
    None for a score head (a
    sequence's score reads its last token, which a shared prefix does not change); a value
    head reads every token, as logits are read."""
    if head == "score":
        return None
    from tempering.models.policy.moe import MoERouting

    if MoERouting.of(model) is not None:
        logger.warning(
            "policy.shared_prefix: off for this mixture-of-experts model: its training adds "
            "the router's load-balancing loss, read from a whole-row forward (moe.py)"
        )
        return None
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in BOOL_MASK_ATTENTION:
        logger.warning(
            "policy.shared_prefix: off for this model (attention=%s); shared prefixes "
            "need one of %s, so every row is computed whole",
            attention, BOOL_MASK_ATTENTION,
        )  # fmt: skip
        return None
    params = sum(p.numel() for p in model.parameters())
    return attention_cost_ratio(model.config, params)


# One sequence's fixed cost in a padding-free micro-batch, per decoder layer, in matmul FLOPs:
# its own attention calls (forward and backward) and its share of the packing, measured on the
# 2-core CPU (tiny-arith: 128 rows of ~12 tokens, 2 layers, ran 0.12 s slower padding-free
# than padded, ~0.9 ms a row at ~10 us per token of 1.2 MFLOP).
SEQUENCE_LAYER_FLOPS = 5e7
VARLEN_ATTENTION = (PACKED_SDPA, "flash_attention_2", "flash_attention_3")


def padding_free_costs(
    model: torch.nn.Module, head: str, device: torch.device
) -> PaddingFree | None:
    """`PaddingFree`'s cost model for ``model`` (None: never padding-free -- a score head,
    whose rows are taken whole; an attention without varlen support; tempering's
    per-sequence SDPA on a GPU, where each sequence's kernel launches were not measured)."""
    attention = getattr(model.config, "_attn_implementation", None)
    if head != "causal_lm" or attention not in VARLEN_ATTENTION:
        return None
    per_layer = SEQUENCE_LAYER_FLOPS
    if attention.startswith("flash_attention"):
        per_layer = 0.0  # one varlen kernel for every sequence
    elif device.type != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    per_sequence = model.config.num_hidden_layers * per_layer / (2 * max(params, 1))
    return PaddingFree(attention_cost_ratio(model.config, params), per_sequence)


def logprob_chunk_rows(model: torch.nn.Module, head: str, configured: int | None) -> int | None:
    """Rows of logits `HiddenLogits` computes at a time (`configured`, else ~64 MiB of them);
    None (logits materialised whole, logged) for a score head and for an output projection
    the chunked path does not compute: not a bias-free ``nn.Linear`` (e.g. a LoRA-wrapped
    lm_head) or logits soft-capped after it (Gemma 2)."""
    if head != "causal_lm":
        if configured is not None:
            raise ValueError(
                f"policy.logprob_chunk_size={configured} applies to a causal LM's logits; a "
                f"{head!r} head computes scores: set it to null"
            )
        return None
    from tempering.logits import default_chunk_rows

    proj = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if type(proj) is not torch.nn.Linear or proj.bias is not None or softcap is not None:
        logger.warning(
            "policy.logprob_chunk_size: this model's logits are materialised whole (output "
            "projection %s, bias %s, final_logit_softcapping %s): chunks need a bias-free "
            "nn.Linear whose output is the logits",
            type(proj).__name__, getattr(proj, "bias", None) is not None, softcap,
        )  # fmt: skip
        if configured is not None:
            raise ValueError(
                f"policy.logprob_chunk_size={configured} cannot apply to this model (see the "
                "warning above); set it to null"
            )
        return None
    return configured if configured is not None else default_chunk_rows(proj.weight.shape[0])
