"""FSDP2 training worker: one data-parallel rank of the policy.

A plain class. A Ray worker group builds one per bundle by its FQN
``tempering.models.policy.fsdp2_worker.FSDP2PolicyWorker`` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT come from the environment); a test may also construct it directly in its own
process (without those variables it runs as a single rank on a free local port).

What it does:
- joins ``torch.distributed`` (gloo on CPU; ``cpu:gloo,cuda:nccl`` on GPU), loads the HF causal
  LM (`tempering.models.hf.load_causal_lm`: a registry name or a local folder), and shards it
  with ``fully_shard`` per decoder layer and at the root (bf16 `MixedPrecisionPolicy` when
  ``precision="bfloat16"``, on CPU as on GPU: fp32 master weights and reductions); a single
  fp32 rank keeps the plain module (nothing to shard; FSDP2's hooks cost ~20% of a tiny step);
- `train`: for each global batch in its shard, all-reduces the valid token/sequence counts
  BEFORE any micro-batch runs, so the micro-batch losses (each divided by the global counts
  and multiplied by the DP size, because FSDP2 averages gradients) add up to one big batch's
  gradient; clips, steps AdamW and the LR schedule once per global batch;
- `get_logprobs` / `get_reference_policy_logprobs` in the contract layout (docs/CONTRACTS.md);
  the reference model is a second FSDP-sharded copy of the initial weights, without optimizer
  (``init_reference_model=True``);
- `save_checkpoint` / `load_checkpoint`: sharded model + optimizer state with
  ``torch.distributed.checkpoint`` (DCP), scheduler state beside it;
- `export_hf` (a folder that ``from_pretrained`` loads) and `state_dict_for_refit` (full
  gathered CPU tensors on rank 0, for the generation workers).

Micro-batches come in three kinds: a fixed number of rows (``micro_batch_size``), dynamic
ones under a padded-token budget (``max_tokens_per_microbatch``), or packed ones
(``max_tokens_per_microbatch`` + ``pack_sequences=True``): first-fit-decreasing bins of
unpadded sequences, each bin one row whose ``position_ids`` restart at 0 per sequence, so
transformers' attention mask keeps the sequences apart (no padding computed at all). The packed
logits are unpacked to the padded layout before the loss, so every loss works unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tempering.distributed.batched_data_dict import BatchedDataDict, PackedBin
from tempering.losses import LossFunction, count_valid_pairs, token_logprobs
from tempering.models.policy.optim import build_lr_scheduler, build_optimizer
from tempering.models.policy.packed_attention import use_packed_sdpa
from tempering.models.policy.shared_prefix import (
    BOOL_MASK_ATTENTION,
    SharedPrefixPlan,
    attention_cost_ratio,
    plan_shared_prefix,
)
from tempering.utils import faults

logger = logging.getLogger(__name__)

PRECISIONS = ("float32", "bfloat16")
# What the model ends in: next-token logits (a policy), or one score per sequence (a reward
# model: AutoModelForSequenceClassification with one label, trained with BradleyTerryLoss).
HEADS = ("causal_lm", "score")
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_rank{rank}.pt"
# Loss metrics that are already divided by the global count: summed over micro-batches/ranks.
_GLOBALLY_NORMALISED = ("loss", "kl_penalty")
# How a micro-batch runs through the model: packed into one row, as shared-prefix groups, or
# (None) as its padded rows.
Layout = PackedBin | SharedPrefixPlan | None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# Megatron-style split of a Llama/Qwen2/Mistral decoder layer: q/k/v and gate/up by output
# columns, o/down by input rows, so each layer needs one all-reduce in attention and one in
# the MLP. Embeddings, norms and lm_head stay whole on every TP rank (FSDP2 shards them).
TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}  # fmt: skip


def _tensor_parallel(layer: torch.nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = {n for n, _ in layer.named_modules()}
    missing = sorted(set(TP_PLAN) - names)
    if missing:
        raise ValueError(
            f"tensor parallelism: {type(layer).__name__} has no {missing}; the TP plan covers "
            "Llama/Qwen2/Mistral-style layers (set policy.dtensor_cfg.tensor_parallel_size=1)"
        )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(layer, tp_mesh, {n: styles[kind]() for n, kind in TP_PLAN.items()})


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


class FSDP2PolicyWorker:
    """One rank of an FSDP2-sharded causal LM with optimizer, schedule and reference copy.

    Args:
        model_path: registry name or local HF folder (`tempering.models.registry`).
        learning_rate, weight_decay, betas, eps: AdamW (``optimizer="sgd"`` for plain SGD).
        max_grad_norm: clip the global gradient norm to this; None = no clipping.
        lr_schedule, warmup_steps, total_steps, min_lr_ratio: see `optim.build_lr_scheduler`.
        precision: "float32" or "bfloat16" (bf16 compute with fp32 master weights and reductions).
        activation_checkpointing: recompute each decoder layer in backward.
        init_optimizer: False for an inference-only policy.
        init_reference_model: keep a frozen, sharded copy of the initial weights.
        seed: torch seed on every rank.
        num_threads: ``torch.set_num_threads`` (CPU tests use 1).
        head: "causal_lm" (a policy) or "score" (a reward model: `forward` gives ``[B]``
            scores, pooled at the last non-pad token, so ``pad_token_id`` is required).
        pad_token_id: the tokenizer's pad id (for ``head="score"``).
        tensor_parallel_size: ranks that split each decoder layer (attention heads and MLP
            columns, torch's DTensor colwise/rowwise styles); consecutive ranks form a TP
            group, FSDP2 shards over the data-parallel groups (a 2-D ``dp x tp`` mesh).
        lean_loading: with several ranks only rank 0 reads the weights (see `_load_sharded`);
            False: every rank reads them (kept to measure the difference).
        shared_prefix: rows of a micro-batch that start alike run their shared prefix once
            (`tempering.models.policy.shared_prefix`; exact, counted in num_computed_tokens).
        max_consecutive_nonfinite: a step whose loss or gradient norm is NaN/Inf is skipped
            (no update, counted as ``num_nonfinite_skipped``); this many in a row raise
            `NonFiniteTrainingError` naming what was non-finite.
    """

    def __init__(
        self,
        model_path: str,
        *,
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        optimizer: str = "adamw",
        max_grad_norm: float | None = 1.0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        precision: str = "float32",
        activation_checkpointing: bool = False,
        init_optimizer: bool = True,
        init_reference_model: bool = False,
        seed: int = 42,
        num_threads: int | None = None,
        max_consecutive_nonfinite: int = 3,
        head: str = "causal_lm",
        pad_token_id: int | None = None,
        tensor_parallel_size: int = 1,
        lean_loading: bool = True,
        shared_prefix: bool = True,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is unknown; use one of {PRECISIONS}")
        if head not in HEADS or (head == "score" and pad_token_id is None):
            raise ValueError(
                f"head={head!r} (pad_token_id={pad_token_id}): use one of {HEADS}; 'score' "
                "needs the tokenizer's pad_token_id (the score is read at the last real token)"
            )
        self.head = head
        self.pad_token_id = pad_token_id
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.export_dtype = getattr(torch, precision)  # final_hf keeps the configured precision
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self._nonfinite_streak = 0
        self.tp_size = tensor_parallel_size
        self.lean_loading = lean_loading
        self._init_distributed()

        # bf16: parameters cast to bf16 for forward/backward, fp32 master weights and
        # optimizer state, gradients reduced in fp32 (FSDP2's MixedPrecisionPolicy)
        self.mp_policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bfloat16"
            else MixedPrecisionPolicy()
        )
        from tempering.utils.resources import current_rss_gb, process_usage

        rss_before = current_rss_gb()
        self.model = self._load_sharded(activation_checkpointing)
        # what loading cost this rank at its peak (lean loading: a shard plus one tensor)
        self._load_peak_gb = process_usage()["peak_rss_gb"] - rss_before
        self.shared_prefix = self._shared_prefix_ratio() if shared_prefix else None
        self.reference_model = None
        if init_reference_model:
            self.reference_model = self._load_sharded(False)
            self.reference_model.requires_grad_(False)
            self.reference_model.eval()

        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if init_optimizer:
            self.optimizer = build_optimizer(
                self.model.parameters(),
                name=optimizer,
                lr=learning_rate,
                weight_decay=weight_decay,
                betas=tuple(betas),
                eps=eps,
            )
            self.scheduler = build_lr_scheduler(
                self.optimizer,
                schedule=lr_schedule,
                warmup_steps=warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=min_lr_ratio,
            )
        self._optimizer_offloaded = False

    # ------------------------------------------------------------------ set-up
    def _init_distributed(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            index = local_rank if torch.cuda.device_count() > local_rank else 0
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                init_method=self._init_method(),
                rank=self.rank,
                world_size=self.world_size,
            )
        # A group started earlier in this process (e.g. by a test) is reused as it is.
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} must divide the {self.world_size} ranks"
            )
        self.dp_size = self.world_size // self.tp_size
        if self.tp_size == 1:
            self.mesh = init_device_mesh(
                self.device.type, (self.world_size,), mesh_dim_names=("dp",)
            )
            self.dp_mesh, self.tp_mesh, self.dp_group = self.mesh, None, None
        else:  # rank = dp_rank * tp + tp_rank: a TP group is consecutive ranks (one node)
            self.mesh = init_device_mesh(
                self.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp")
            )
            self.dp_mesh, self.tp_mesh = self.mesh["dp"], self.mesh["tp"]
            self.dp_group = self.dp_mesh.get_group()  # counts and metrics: once per DP rank

    def _init_method(self) -> str:
        """The worker group's (``TEMPERING_DIST_INIT_METHOD``: a private file store on one
        node), else MASTER_ADDR/MASTER_PORT, else a free loopback port for a lone rank."""
        if os.environ.get("TEMPERING_DIST_INIT_METHOD"):
            return os.environ["TEMPERING_DIST_INIT_METHOD"]
        port = os.environ.get("MASTER_PORT")
        if port is None:
            if self.world_size != 1:
                raise RuntimeError(
                    f"FSDP2PolicyWorker: WORLD_SIZE={self.world_size} but MASTER_PORT is not "
                    "set; start workers through a RayWorkerGroup or set MASTER_ADDR/MASTER_PORT"
                )
            port = str(_free_port())
        return f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"

    def _load_sharded(self, activation_checkpointing: bool) -> torch.nn.Module:
        """The model, sharded (a single fp32 rank: the plain module, see below). Memory-lean
        with several ranks: only rank 0 reads the checkpoint; the others build the model on
        the meta device (no memory), shard it, and receive their shards from rank 0
        (`_fill_from_rank0`)."""
        lean = self.lean_loading and self.world_size > 1
        full_state = None
        if lean:  # every rank shards the same empty model (TP and FSDP2 then need no data)
            model = self._empty_model()
            if self.rank == 0:  # broadcast below: the weights, and the buffers they imply
                read = self._read_model()
                full_state = {
                    "state": dict(read.state_dict()),
                    "buffers": dict(read.named_buffers()),
                }
        else:
            model = self._read_model()
        use_packed_sdpa(model)  # packed micro-batches cost their sequences, not their bins
        self.hf_config = model.config
        if activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        layer_names = set(getattr(model, "_no_split_modules", None) or [])
        layers = [m for m in model.modules() if type(m).__name__ in layer_names]
        if not layers:
            raise ValueError(
                f"FSDP2PolicyWorker: found no decoder layers in {type(model).__name__} "
                f"(_no_split_modules={sorted(layer_names)}); this model class is not supported"
            )
        if self.world_size == 1 and self.mp_policy.param_dtype is None:
            # One fp32 rank has nothing to shard, gather or reduce: FSDP2's per-layer hooks
            # and DTensor dispatch cost ~20% of a tiny-arith step (bench/bench_floor.py).
            # Checkpoints stay DCP, so they load into any layout.
            return model.to(self.device)
        if self.tp_mesh is not None:
            for layer in layers:
                _tensor_parallel(layer, self.tp_mesh)
        for layer in layers:
            fully_shard(layer, mesh=self.dp_mesh, mp_policy=self.mp_policy)
        fully_shard(model, mesh=self.dp_mesh, mp_policy=self.mp_policy)
        if lean:
            self._fill_from_rank0(model, full_state)
        return model

    def _shared_prefix_ratio(self) -> float | None:
        """The cost ratio `plan_shared_prefix` weighs groups with; None (rows computed apart,
        logged) where the attention cannot take the tree mask; None for a score head (a
        sequence's score reads its last token, which a shared prefix does not change)."""
        if self.head != "causal_lm":
            return None
        attention = getattr(self.hf_config, "_attn_implementation", None)
        if attention not in BOOL_MASK_ATTENTION:
            logger.warning(
                "policy.shared_prefix: off for this model (attention=%s); shared prefixes "
                "need one of %s, so every row is computed whole",
                attention, BOOL_MASK_ATTENTION,
            )  # fmt: skip
            return None
        params = sum(p.numel() for p in self.model.parameters())
        return attention_cost_ratio(self.hf_config, params)

    def load_peak_gb(self) -> float:
        """Peak resident memory that loading the policy added to this rank, in GiB."""
        return self._load_peak_gb

    def _read_model(self) -> torch.nn.Module:
        from tempering.models.hf import load_causal_lm, load_sequence_classifier

        if self.head == "score":
            assert self.pad_token_id is not None
            return load_sequence_classifier(self.model_path, self.pad_token_id)
        return load_causal_lm(self.model_path, dtype=torch.float32)

    def _empty_model(self) -> torch.nn.Module:
        """The model's architecture on the meta device: no weights read, no memory used."""
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
        )

        from tempering.models.registry import hub_offline, resolve_model_path

        config = AutoConfig.from_pretrained(
            resolve_model_path(self.model_path), local_files_only=hub_offline()
        )
        auto = AutoModelForCausalLM
        if self.head == "score":
            config.num_labels, config.pad_token_id = 1, self.pad_token_id
            auto = AutoModelForSequenceClassification
        with torch.device("meta"):
            return auto.from_config(config, dtype=torch.float32).eval()

    def _fill_from_rank0(self, model: torch.nn.Module, full_state: dict[str, Any] | None) -> None:
        """Rank 0 broadcasts the file's tensors; each rank keeps its shard. Buffers that are
        not in the state dict (e.g. rotary frequencies) are recomputed by rank 0's read model
        and broadcast whole. Collective."""
        model.to_empty(device=self.device)
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_state["state"] if full_state else {}, options=opts)
        for name, buffer in model.named_buffers():
            if full_state:
                buffer.copy_(full_state["buffers"][name])
            dist.broadcast(buffer, src=0)

    # ------------------------------------------------------------ collectives
    def _all_reduce(
        self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> list[float]:
        """Over the data-parallel ranks (the ranks of a TP group hold the same data)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.dp_group)  # gloo: CPU tensors in both backends
        return t.tolist()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every data-parallel rank."""
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, obj, group=self.dp_group)
        return gathered

    # ------------------------------------------------------------- forward
    def _forward_logits(
        self, model: torch.nn.Module, mb: BatchedDataDict, layout: Layout = None
    ) -> torch.Tensor:
        """``[B, S, V]`` float logits of micro-batch ``mb``, computed in its ``layout`` (see
        `_microbatches`; None: the padded rows); ``[B]`` scores for ``head="score"``."""
        if isinstance(layout, SharedPrefixPlan):
            return layout.forward(model)  # [B, S, V], each row as if computed alone
        packed = layout
        if self.head == "score":
            if packed is not None:
                raise ValueError("a reward model (head='score') does not take packed batches")
            ids = mb["input_ids"]
            seq = torch.arange(ids.shape[1], device=ids.device)
            attention_mask = (seq[None, :] < mb["input_lengths"][:, None]).long()
            return model(input_ids=ids, attention_mask=attention_mask).logits.float()[:, 0]
        if packed is not None:
            # One row holding every sequence; transformers builds a block-diagonal causal mask
            # from position_ids that restart at 0 when attention_mask is None.
            cu = packed.cu_seqlens.to(self.device)
            out = model(
                input_ids=packed.input_ids[None].to(self.device),
                position_ids=packed.position_ids[None].to(self.device),
                use_cache=False,
                # sequence bounds for varlen attention (packed_attention.py, flash-attention)
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=packed.max_seqlen,
                max_length_k=packed.max_seqlen,
            )
            return packed.unpack(out.logits[0].float())  # [n, max_seqlen, V] == mb's layout
        input_ids = mb["input_ids"]
        seq = torch.arange(input_ids.shape[1], device=input_ids.device)
        attention_mask = (seq[None, :] < mb["input_lengths"][:, None]).long()  # [B, S]
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits.float()  # [B, S, V]

    def _microbatches(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        max_tokens: int | None,
        pack: bool = False,
    ) -> tuple[list[BatchedDataDict], list[Layout], torch.Tensor | None]:
        """Micro-batches trimmed to their longest sequence, each one's layout for the forward
        (its packed bin when packing; else its shared-prefix plan, or None: the padded rows),
        and the row permutation (None when rows keep their order). A layout is decided once
        per micro-batch, so a reference forward and the policy's share it."""
        if pack:
            if max_tokens is None:
                raise ValueError(
                    "pack_sequences=True needs max_tokens_per_microbatch (the bin size); set "
                    "policy.sequence_packing.train_mb_tokens"
                )
            bins = data.pack_sequences(max_tokens, seq_keys=["input_ids"])
            mbs = [_trim(data.select_indices(b.indices)) for b in bins]
            return mbs, list(bins), torch.cat([b.indices for b in bins])
        if max_tokens is not None:
            mbs, perm = data.make_microbatches_by_tokens(max_tokens)
        else:
            mbs = [
                _trim(mb) for mb in data.make_microbatches(micro_batch_size or max(1, data.size))
            ]
            perm = None
        return mbs, [self._plan(mb) for mb in mbs], perm

    def _plan(self, mb: BatchedDataDict) -> SharedPrefixPlan | None:
        if self.shared_prefix is None:
            return None
        return plan_shared_prefix(
            mb["input_ids"], mb["input_lengths"], self.shared_prefix, self.pad_token_id or 0
        )

    def _equalise(self, count: int) -> int:
        """Every rank must run the same number of forward passes (FSDP2 collectives)."""
        return int(self._all_reduce([float(count)], op=dist.ReduceOp.MAX)[0])

    # ---------------------------------------------------------------- train
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        eval_mode: bool = False,
        pack_sequences: bool = False,
        with_reference: bool = False,
    ) -> dict[str, float]:
        """Train on this rank's shard: one optimizer step per global batch it holds.

        ``with_reference``: each micro-batch's ``reference_policy_logprobs`` come from the
        reference model right before its policy forward (DPO: one call, not a log-prob call
        and a train call, and no [B, S] log-probs shipped through the controller).

        ``global_batch_size`` is the size over ALL ranks (None: the whole shard is one global
        batch); the shard is walked in local steps of ``global_batch_size // dp_size``
        (the layout of `BatchedDataDict.shard_by_batch_size`). Returns global metrics
        (identical on every rank): loss, grad_norm, lr, num_tokens, num_valid_tokens,
        tokens_per_s, num_steps, and the loss function's metrics.
        """
        faults.maybe_fault("policy", "train")
        if self.optimizer is None and not eval_mode:
            raise RuntimeError("FSDP2PolicyWorker.train: built with init_optimizer=False")
        local_gbs = self._local_batch_size(data.size, global_batch_size)
        pairwise = loss_fn.pairwise
        if pairwise and micro_batch_size is not None and micro_batch_size % 2:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} must be even for {type(loss_fn).__name__}: "
                "its batches interleave chosen/rejected pairs"
            )
        if pairwise and max_tokens_per_microbatch is not None:
            raise ValueError(
                f"{type(loss_fn).__name__} needs chosen/rejected pairs kept together; dynamic "
                "or packed micro-batches (max_tokens_per_microbatch) reorder rows: use "
                "micro_batch_size"
            )
        if with_reference and self.reference_model is None:
            raise RuntimeError(
                "FSDP2PolicyWorker.train(with_reference=True): this worker has no reference "
                "model; build the policy with init_reference_model=True"
            )
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)
        self.model.train(not eval_mode)
        steps: list[dict[str, float]] = []
        for start in range(0, data.size, local_gbs):
            batch = data.slice(start, start + local_gbs)
            with torch.set_grad_enabled(not eval_mode):
                steps.append(
                    self._run_global_batch(
                        batch, loss_fn, pairwise, batching, not eval_mode, with_reference
                    )
                )
        return _combine_steps(steps)

    def _local_batch_size(self, shard_size: int, global_batch_size: int | None) -> int:
        if global_batch_size is None:
            if shard_size == 0:
                raise ValueError("FSDP2PolicyWorker.train got an empty batch")
            return shard_size
        if global_batch_size % self.dp_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the data-parallel "
                f"size {self.dp_size}; pick a multiple of {self.dp_size}"
            )
        local = global_batch_size // self.dp_size
        if shard_size == 0 or shard_size % local:
            raise ValueError(
                f"this rank got {shard_size} samples, not a positive multiple of "
                f"global_batch_size/dp_size={local}; the data size must be a multiple of "
                f"global_batch_size={global_batch_size}"
            )
        return local

    def _run_global_batch(
        self,
        batch: BatchedDataDict,
        loss_fn: LossFunction,
        pairwise: bool,
        batching: tuple[int | None, int | None, bool],
        do_step: bool,
        with_reference: bool,
    ) -> dict[str, float]:
        """One global batch: micro-batches by ``batching`` = (micro_batch_size,
        max_tokens_per_microbatch, pack_sequences); an optimizer step when ``do_step``; the
        reference's log-probs per micro-batch when ``with_reference``."""
        t0 = time.perf_counter()
        sample_mask = batch.get("sample_mask")
        if sample_mask is None:
            sample_mask = torch.ones(batch.size)
        if "token_mask" not in batch:
            raise KeyError(f"train data needs 'token_mask' [B, S]; it has {sorted(batch)}")
        if "sample_mask" not in batch:
            batch["sample_mask"] = sample_mask
        sample_mask = sample_mask.float()
        valid_toks = float((batch["token_mask"].float() * sample_mask[:, None]).sum())
        valid_seqs = float(count_valid_pairs(sample_mask) if pairwise else sample_mask.sum())
        num_tokens = float(batch["input_lengths"].sum())
        g_toks, g_seqs, g_tokens = self._all_reduce([valid_toks, valid_seqs, num_tokens])
        global_valid_toks = torch.tensor(g_toks, device=self.device)
        global_valid_seqs = torch.tensor(g_seqs, device=self.device)

        mbs, layouts, _ = self._microbatches(batch, *batching)
        n_mbs = self._equalise(len(mbs))
        computed = float(
            sum(_computed_tokens(mb, lay) for mb, lay in zip(mbs, layouts, strict=True))
        )
        loss_sum = 0.0
        mb_metrics: list[dict[str, float]] = []
        for i in range(n_mbs):
            if i < len(mbs):
                mb = mbs[i].to(self.device)
                if with_reference:
                    with torch.no_grad():
                        ref = self._forward_logits(self.reference_model, mb, layouts[i])
                        mb["reference_policy_logprobs"] = token_logprobs(ref, mb["input_ids"])
                logits = self._forward_logits(self.model, mb, layouts[i])
                loss, metrics = loss_fn(logits, mb, global_valid_toks, global_valid_seqs)
                loss_sum += float(loss.detach())
                mb_metrics.append(metrics)
            else:  # padding pass so every rank joins the same FSDP2 collectives
                loss = self._forward_logits(self.model, _dummy_batch(self.device)).sum() * 0.0
            if do_step:
                # FSDP2 averages gradients over DP ranks; the loss is already a global sum.
                (loss * self.dp_size).backward()

        global_loss, g_computed = self._all_reduce([loss_sum, computed])
        result: dict[str, float] = {}
        if do_step:
            assert self.optimizer is not None and self.scheduler is not None
            max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
            result["grad_norm"] = self._clip_grad_norm(max_norm)
            result["lr"] = float(self.optimizer.param_groups[0]["lr"])
            # Numerics guard: the same decision on every rank (global loss, global norm).
            finite = math.isfinite(global_loss) and math.isfinite(result["grad_norm"])
            result["num_nonfinite_skipped"] = 0.0 if finite else 1.0
            if finite:
                self.optimizer.step()
                self.scheduler.step()
                self._nonfinite_streak = 0
            else:
                self._skip_nonfinite_step(global_loss, result["grad_norm"])
            self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        (elapsed,) = self._all_reduce([elapsed], op=dist.ReduceOp.MAX)
        result.update(self._aggregate_loss_metrics(mb_metrics))
        result.update(
            loss=global_loss,
            num_tokens=g_tokens,
            num_valid_tokens=g_toks,
            num_computed_tokens=g_computed,  # < num_tokens when shared prefixes ran once
            tokens_per_s=g_tokens / max(elapsed, 1e-9),
            step_time_s=elapsed,
        )
        return result

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        With TP the parameters live on two meshes (TP-split layers on ``dp x tp``, the rest on
        ``dp``), which torch's clip_grad_norm_ cannot combine: each rank adds the squares of
        its local shards, divided by how many ranks hold the same shard, and one all-reduce
        over every rank sums them."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tp_mesh is None:
            return float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            g = p.grad
            copies = self.world_size / g.device_mesh.size()  # ranks outside its mesh
            for dim, placement in enumerate(g.placements):
                copies *= g.device_mesh.size(dim) if placement.is_replicate() else 1
            total += _local(g).double().pow(2).sum().cpu() / copies
        dist.all_reduce(total)
        norm = float(total.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _skip_nonfinite_step(self, loss: float, grad_norm: float) -> None:
        """Leave weights, optimizer state and schedule as they were; count the step; raise
        NonFiniteTrainingError after ``max_consecutive_nonfinite`` in a row. Collective."""
        self._nonfinite_streak += 1
        bad = [
            name
            for name, p in self.model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
        ]
        names = sorted({n for rank_names in self._all_gather_object(bad[:5]) for n in rank_names})
        what = (
            f"loss={loss}, grad_norm={grad_norm}; non-finite gradients in {names or 'none'}"
            f"{' (first 5 per rank)' if len(names) >= 5 else ''}"
        )
        logger.warning(
            "non-finite training step skipped (%d in a row, limit %d): %s",
            self._nonfinite_streak, self.max_consecutive_nonfinite, what,
        )  # fmt: skip
        if self._nonfinite_streak >= self.max_consecutive_nonfinite:
            raise NonFiniteTrainingError(
                f"{self._nonfinite_streak} consecutive optimizer steps were non-finite and "
                f"skipped (policy.max_consecutive_nonfinite_steps="
                f"{self.max_consecutive_nonfinite}); the last had {what}. Lower the learning "
                "rate, clip gradients (policy.max_grad_norm), or check the data and rewards "
                "for inf/NaN; the last checkpoint holds the weights before this."
            )

    def _aggregate_loss_metrics(self, mb_metrics: list[dict[str, float]]) -> dict[str, float]:
        """Loss metrics over micro-batches and ranks, following tempering.losses' conventions:
        ``loss``/``kl_penalty``/``*_loss`` are globally normalised (summed), ``num_*`` are counts
        (summed), the rest are per-micro-batch means (weighted by num_valid_tokens/pairs)."""
        all_mbs = [m for rank_mbs in self._all_gather_object(mb_metrics) for m in rank_mbs]
        keys = sorted({k for m in all_mbs for k in m})
        out: dict[str, float] = {}
        for key in keys:
            rows = [m for m in all_mbs if key in m]
            if key in _GLOBALLY_NORMALISED or key.endswith("_loss") or key.startswith("num_"):
                out[key] = float(sum(m[key] for m in rows))
                continue
            weights = [
                float(m.get("num_valid_tokens", m.get("num_valid_pairs", 1.0))) for m in rows
            ]
            total = sum(weights)
            if total > 0:
                out[key] = sum(w * m[key] for w, m in zip(weights, rows, strict=True)) / total
            else:
                out[key] = sum(m[key] for m in rows) / len(rows)
        return out

    # ------------------------------------------------------------- logprobs
    def get_logprobs(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        temperature: float = 1.0,
        pack_sequences: bool = False,
    ) -> BatchedDataDict:
        """``{"logprobs": [B, S]}`` (CPU float32) in the contract layout; 0 at t=0 and padding."""
        faults.maybe_fault("policy", "logprobs")
        self._require_head("causal_lm", "get_logprobs")
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)
        return BatchedDataDict(logprobs=self._logprobs(self.model, data, batching, temperature))

    def get_reference_policy_logprobs(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        temperature: float = 1.0,
        pack_sequences: bool = False,
    ) -> BatchedDataDict:
        """``{"reference_policy_logprobs": [B, S]}`` from the frozen initial weights."""
        faults.maybe_fault("policy", "logprobs")
        if self.reference_model is None:
            raise RuntimeError(
                "get_reference_policy_logprobs: the worker was built without a reference model; "
                "pass init_reference_model=True"
            )
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)
        return BatchedDataDict(
            reference_policy_logprobs=self._logprobs(
                self.reference_model, data, batching, temperature
            )
        )

    @torch.no_grad()
    def score(self, data: BatchedDataDict, micro_batch_size: int) -> BatchedDataDict:
        """``{"scores": [B]}`` (CPU float32) of a reward model (``head="score"``), in order."""
        self._require_head("score", "score")
        self.model.eval()
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        mbs, _, _ = (
            self._microbatches(view, micro_batch_size, None) if view.size else ([], [], None)
        )
        out = [torch.zeros(0)]
        for i in range(self._equalise(len(mbs))):
            if i < len(mbs):
                out.append(self._forward_logits(self.model, mbs[i].to(self.device)).cpu())
            else:  # padding pass, result dropped
                self._forward_logits(self.model, _dummy_batch(self.device))
        return BatchedDataDict(scores=torch.cat(out))

    def _require_head(self, head: str, method: str) -> None:
        if self.head != head:
            raise RuntimeError(
                f"{method} needs a worker built with head={head!r}, not {self.head!r}"
            )

    @torch.no_grad()
    def _logprobs(
        self,
        model: torch.nn.Module,
        data: BatchedDataDict,
        batching: tuple[int | None, int | None, bool],
        temperature: float,
    ) -> torch.Tensor:
        was_training = model.training
        model.eval()
        full_len = data["input_ids"].shape[1]
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        mbs, layouts, perm = self._microbatches(view, *batching) if view.size else ([], [], None)
        n_mbs = self._equalise(len(mbs))
        pieces: list[torch.Tensor] = []
        for i in range(n_mbs):
            if i >= len(mbs):  # padding pass, result dropped
                self._forward_logits(model, _dummy_batch(self.device))
                continue
            mb = mbs[i].to(self.device)
            logits = self._forward_logits(model, mb, layouts[i])
            if temperature != 1.0:
                logits = logits / temperature
            lp = token_logprobs(logits, mb["input_ids"])  # [b, s]
            seq = torch.arange(lp.shape[1], device=lp.device)
            lp = lp * (seq[None, :] < mb["input_lengths"][:, None])
            pieces.append(torch.nn.functional.pad(lp.cpu(), (0, full_len - lp.shape[1])))
        model.train(was_training)
        if not pieces:
            return torch.zeros(0, full_len)
        out = torch.cat(pieces)
        if perm is not None:
            out = out[torch.argsort(perm)]
        return out

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer state (DCP) under `path`, scheduler state beside it."""
        faults.maybe_fault("policy", "checkpoint")
        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state: dict[str, Any] = {}
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        dcp.save(state, checkpoint_id=path)
        if self.rank == 0 and self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), Path(path) / SCHEDULER_FILE)
        # This rank's torch RNG (dropout and other training-side draws), for exact resume.
        torch.save({"torch": torch.get_rng_state()}, Path(path) / RNG_FILE.format(rank=self.rank))
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint(path)` wrote (same or another DP size)."""
        if not (Path(path) / ".metadata").exists():
            raise FileNotFoundError(
                f"load_checkpoint: {path} holds no DCP checkpoint (.metadata missing); pass the "
                "'policy' folder of a complete step_N checkpoint"
            )
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        else:
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(self.model, state["model"])
        sched_file = Path(path) / SCHEDULER_FILE
        if self.scheduler is not None and sched_file.exists():
            self.scheduler.load_state_dict(torch.load(sched_file, weights_only=True))
        rng_file = Path(path) / RNG_FILE.format(rank=self.rank)
        if rng_file.exists():
            torch.set_rng_state(torch.load(rng_file, weights_only=True)["torch"])
        else:  # saved with another world size: this rank's stream starts afresh
            logger.warning("%s missing: rank %d keeps its own RNG state", rng_file, self.rank)
        dist.barrier()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered full parameters on rank 0 (CPU); empty on the other ranks. Collective."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def state_dict_for_refit(self, dtype: str | None = None) -> dict[str, torch.Tensor] | None:
        """Full CPU tensors by HF name on rank 0 (None elsewhere), optionally cast to `dtype`."""
        sd = self._full_state_dict()
        if self.rank != 0:
            return None
        return {k: _in_dtype(v, dtype) for k, v in sd.items()}

    def export_hf(self, path: str) -> None:
        """Write an HF folder atomically (weights in `precision`, config, generation config,
        tokenizer with its chat template); see `tempering.models.export`. Collective."""
        sd = self._full_state_dict()
        if self.rank == 0:
            from tempering.models.export import save_hf_folder

            save_hf_folder(
                path, sd, self.hf_config, self.model_path, self.export_dtype, head=self.head
            )
        dist.barrier()

    # ------------------------------------------------- colocation with generation
    def prepare_for_generation(self) -> None:
        """On GPU, move optimizer state to CPU to make room for a colocated generator."""
        if self.device.type == "cuda" and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            self._optimizer_offloaded = True
            torch.cuda.empty_cache()

    def prepare_for_training(self) -> None:
        """Undo `prepare_for_generation`."""
        if self._optimizer_offloaded and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, self.device)
            self._optimizer_offloaded = False

    # ------------------------------------------- colocated generation (torch engine)
    def init_colocated_generation(self, sampling: dict[str, Any]) -> None:
        """Build a torch generation engine on an unsharded copy of this policy's weights.

        Each rank generates for its own DP shard of the prompts; `refit_colocated_generation`
        copies the trained weights into the copy in place, so no tensor leaves this process.
        """
        from tempering.models.generation.interfaces import SamplingConfig
        from tempering.models.generation.torch_engine import (
            TorchGenerationEngine,
            optimize_for_cpu_inference,
        )
        from tempering.models.hf import load_causal_lm, load_tokenizer

        self._require_head("causal_lm", "init_colocated_generation")
        args = dict(sampling)
        if args.get("seed") is None:  # distinct, reproducible streams per rank
            args["seed"] = int(torch.initial_seed()) + 1000 * self.rank
        model = load_causal_lm(self.model_path).to(self.device).eval()
        optimize_for_cpu_inference(model)  # this copy only generates
        tokenizer = load_tokenizer(self.model_path)
        self._gen_engine = TorchGenerationEngine(model, tokenizer, SamplingConfig(**args))
        self.refit_colocated_generation()

    def reseed_generation(self, seed: int) -> None:
        """Restart the colocated engine's sampling stream from the controller's step seed."""
        if not hasattr(self, "_gen_engine"):
            raise RuntimeError("reseed_generation: call init_colocated_generation first")
        self._gen_engine.reseed(seed + 1000 * self.rank)

    def refit_colocated_generation(self) -> None:
        """Copy the current (sharded) policy weights into the generation copy. Collective."""
        faults.maybe_fault("generation", "refit")
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False, broadcast_from_rank0=False)
        full = get_model_state_dict(self.model, options=opts)
        self._gen_engine.update_weights(full)

    def generate(
        self, data: BatchedDataDict, greedy: bool = False, sampling: Any = None
    ) -> BatchedDataDict:
        """Generate for this rank's prompts with the colocated engine (contract layout);
        `sampling` (a SamplingConfig) overrides the engine's settings for this call."""
        faults.maybe_fault("generation", "generation")
        if not hasattr(self, "_gen_engine"):
            raise RuntimeError(
                "FSDP2PolicyWorker.generate: call init_colocated_generation first "
                "(policy.generation.colocated.enabled=true builds it)"
            )
        return self._gen_engine.generate(data.to(self.device), greedy, sampling).to("cpu")

    def refit_buckets(self, bucket_bytes: int) -> list[list[str]]:
        """State-dict names in buckets of at most ``bucket_bytes`` (fp32 size), cut only
        between decoder layers (`refit.py`); the same on every rank."""
        buckets: list[list[str]] = []
        current: list[str] = []
        size, layer = 0, None
        # A tied lm_head is sent too: vLLM on CPU repacks it apart from embed_tokens, so
        # loading embed_tokens alone left it stale (log-probs off by 3e-3, test_grpo).
        for name, tensor in self.model.state_dict().items():
            this_layer = _layer_of(name)
            nbytes = tensor.numel() * 4
            if current and this_layer != layer and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
            layer = this_layer
        return buckets + ([current] if current else [])

    def refit_bucket(self, names: list[str], dtype: str | None) -> tuple[Any, int] | None:
        """Gather the full tensors of ``names`` (collective), cast to ``dtype``; rank 0 puts
        them into Ray's object store and returns ``(ref, bytes)``, the others None."""
        state = self.model.state_dict()
        out: dict[str, torch.Tensor] = {}
        for name in names:
            full = _full(state[name])  # every rank joins each all-gather, in the same order
            if self.rank == 0:
                out[name] = _in_dtype(full.detach().to("cpu", copy=True), dtype)
        if self.rank != 0:
            return None
        import ray

        return ray.put(out), sum(t.numel() * t.element_size() for t in out.values())

    # ------------------------------------------------------------------ misc
    def get_rank_info(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device),
                "dp_size": self.dp_size, "tp_size": self.tp_size}  # fmt: skip

    def shutdown(self) -> None:
        """Leave the process group (for workers built directly in a test process)."""
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------- helpers
def _computed_tokens(mb: BatchedDataDict, layout: Layout) -> int:
    """Tokens one forward of ``mb`` computes in ``layout`` (padding not counted)."""
    if isinstance(layout, PackedBin):
        return layout.num_tokens
    if isinstance(layout, SharedPrefixPlan):
        return layout.tokens
    return int(mb["input_lengths"].sum())


def _in_dtype(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``t`` cast to ``dtype`` (a torch dtype name) if it is floating point; None keeps it."""
    return t.to(getattr(torch, dtype)) if dtype and t.is_floating_point() else t


def _layer_of(name: str) -> str:
    """``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``; the name itself otherwise."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name


def _trim(mb: BatchedDataDict) -> BatchedDataDict:
    """Cut sequence keys (dim 1 == input_ids' dim 1) to the micro-batch's longest sequence."""
    width = mb["input_ids"].shape[1]
    keep = int(mb["input_lengths"].max()) if mb.size else width
    if keep >= width:
        return mb
    return BatchedDataDict(
        {
            k: v[:, :keep]
            if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == width
            else v
            for k, v in mb.items()
        }
    )


def _dummy_batch(device: torch.device) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
        input_lengths=torch.ones(1, dtype=torch.long, device=device),
    )


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def _combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One dict for a call that ran several global batches: means of per-step values, except
    token counts (summed), tokens_per_s (total tokens / total time) and lr (the last step's)."""
    if len(steps) == 1:
        return {**steps[0], "num_steps": 1.0}
    out: dict[str, float] = {}
    for key in steps[0]:
        values = [s[key] for s in steps if key in s]
        if key in ("num_tokens", "num_valid_tokens", "step_time_s") or key.startswith("num_"):
            out[key] = float(sum(values))
        elif key == "lr":
            out[key] = values[-1]
        else:
            out[key] = float(sum(values) / len(values))
    out["tokens_per_s"] = out["num_tokens"] / max(out["step_time_s"], 1e-9)
    out["num_steps"] = float(len(steps))
    return out


__all__ = ["FSDP2PolicyWorker"]
