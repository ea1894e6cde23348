"""FSDP2 training worker: one data-parallel rank of the policy.

A plain class. A Ray worker group builds one per bundle by its FQN
``tempering.models.policy.fsdp2_worker.FSDP2PolicyWorker`` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT come from the environment); a test may also construct it directly in its own
process (without those variables it runs as a single rank on a free local port).

What it does, and where each part lives (composition, no mixins: the worker and its small
components share one `model_setup.PolicyState` holding the model, its reference copy, the
optimizer and the rank's topology):
- set-up (`model_setup`): joins ``torch.distributed`` (gloo on CPU; ``cpu:gloo,cuda:nccl`` on
  GPU), loads the HF causal LM (a registry name or a local folder), and shards it with
  ``fully_shard`` per decoder layer and at the root (bf16 `MixedPrecisionPolicy` when
  ``precision="bfloat16"``, on CPU as on GPU: fp32 master weights and reductions); a single
  fp32 rank keeps the plain module (nothing to shard; FSDP2's hooks cost ~20% of a tiny step);
- the training core (this module): `train`, for each global batch in its shard, all-reduces
  the valid token/sequence counts BEFORE any micro-batch runs, so the micro-batch losses (each
  divided by the global counts and multiplied by the DP size, because FSDP2 averages
  gradients) add up to one big batch's gradient; then one optimizer step per global batch
  (`training.OptimizerStep`: clipping, AdamW, the LR schedule, the non-finite guard);
  `get_logprobs` / `get_reference_policy_logprobs` in the contract layout (docs/CONTRACTS.md)
  and `score` (a reward model). The reference model is a second FSDP-sharded copy of the
  initial weights, without optimizer (``init_reference_model=True``) -- or, with LoRA
  (`lora.py`), the model itself with its adapters off, no second copy. Micro-batches (fixed,
  token-budgeted or packed) and the forward pass are `microbatching.ForwardPass`'s;
- components the controller reaches by a dotted method name (the worker group's ``execute``
  resolves ``"checkpoint.save"`` to ``worker.checkpoint.save``), so this class keeps a small
  surface and every remote call still names its target:
  ``checkpoint`` (`checkpoint_io.CheckpointIO`: DCP save/load, HF export),
  ``refit`` (`weight_streaming.WeightStreamer`: full or bucketed weights for generation
  engines) and ``generation`` (`colocated_generation.ColocatedGenerationView`: a torch engine
  inside this worker).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.logits import needed_rows
from tempering.losses import LossFunction, token_logprobs, topk_logprobs
from tempering.models.policy.checkpoint_io import CheckpointIO
from tempering.models.policy.colocated_generation import ColocatedGenerationView
from tempering.models.policy.lora import LoraSpec
from tempering.models.policy.microbatching import ForwardPass, Layout, computed_tokens
from tempering.models.policy.model_setup import (
    ModelSource,
    PolicyState,
    Topology,
    check_options,
    init_topology,
    load_sharded,
    logprob_chunk_rows,
    mixed_precision,
    padding_free_costs,
    require_head,
    shared_prefix_ratio,
)
from tempering.models.policy.moe import MoERouting
from tempering.models.policy.optim import build_lr_scheduler, build_optimizer
from tempering.models.policy.packed_attention import attends_over_rows
from tempering.models.policy.training import (
    NonFiniteTrainingError,
    OptimizerStep,
    aggregate_loss_metrics,
    check_pairwise_batching,
    combine_steps,
    local_batch_size,
)
from tempering.models.policy.weight_streaming import WeightStreamer
from tempering.preference_losses import count_valid_pairs
from tempering.utils import faults, threads

# (micro_batch_size, max_tokens_per_microbatch, pack_sequences): how a call cuts its batch
Batching = tuple[int | None, int | None, bool]


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
        head: "causal_lm" (a policy), "value" (a PPO critic: ``[B, S]`` values, `values`) or
            "score" (a reward model: `forward` gives ``[B]``
            scores, pooled at the last non-pad token, so ``pad_token_id`` is required).
        pad_token_id: the tokenizer's pad id (for ``head="score"``).
        tokenizer_path, chat_template: the run's tokenizer (default: the model's) and the
            template replacing its own, for colocated generation and exported models.
        tensor_parallel_size: ranks that split each decoder layer (attention heads and MLP
            columns, torch's DTensor colwise/rowwise styles); consecutive ranks form a TP
            group, FSDP2 shards over the data-parallel groups (a 2-D ``dp x tp`` mesh).
        lean_loading: with several ranks only rank 0 reads the weights
            (`model_setup.load_sharded`); False: every rank reads them (kept to measure the
            difference).
        shared_prefix: rows of a micro-batch that start alike run their shared prefix once
            (`tempering.models.policy.shared_prefix`; exact, counted in num_computed_tokens).
        padding_free: a micro-batch whose padding costs more than packing its rows runs them
            as one packed row, in order (`microbatching.PaddingFree`; exact).
        lora: `LoraSpec`'s fields (``dim``, ``alpha``, ``dropout``, ``target_modules``,
            ``exclude_modules``, ``match_all_linear``) to train LoRA adapters on a frozen base
            (`tempering.models.policy.lora`); None trains every weight.
        logprob_chunk_size: rows of logits computed at a time by the chunked log-prob path
            (`tempering.logits`); None: ~64 MiB of them, and only where it costs nothing
            (no-grad passes, a frozen output projection); a number: that many rows, a
            trained projection too (one more projection pass in backward, for memory).
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
        tokenizer_path: str | None = None,
        chat_template: str | None = None,
        tensor_parallel_size: int = 1,
        lean_loading: bool = True,
        shared_prefix: bool = True,
        padding_free: bool = True,
        lora: dict[str, Any] | None = None,
        logprob_chunk_size: int | None = None,
    ) -> None:
        check_options(precision, head, pad_token_id)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        source = ModelSource(str(model_path), head, pad_token_id, tokenizer_path, chat_template)
        topo = init_topology(tensor_parallel_size)
        mp_policy = mixed_precision(precision)
        self.state = self._load_models(
            source, topo, mp_policy, activation_checkpointing, lean_loading, init_reference_model,
            LoraSpec(**lora) if lora is not None else None,
        )  # fmt: skip
        self.forward_pass = ForwardPass(
            head,
            topo.device,
            shared_prefix_ratio(self.state.model, head) if shared_prefix else None,
            pad_token_id,
            logprob_chunk_rows(self.state.model, head, logprob_chunk_size),
            fuse_trained_head=logprob_chunk_size is not None,
            padding_free=(
                padding_free_costs(self.state.model, head, topo.device) if padding_free else None
            ),
            over_rows=attends_over_rows(self.state.model),
            # a recomputed layer would run its whole MLP; TP splits it (read_rows.py)
            read_rows=not activation_checkpointing and tensor_parallel_size == 1,
        )
        self.moe = MoERouting.of(self.state.model)  # a router's load-balancing loss (moe.py)
        self.optimizer_step: OptimizerStep | None = None
        if init_optimizer:
            self.state.optimizer = build_optimizer(
                self.state.model.parameters(), name=optimizer, lr=learning_rate,
                weight_decay=weight_decay, betas=tuple(betas), eps=eps,
            )  # fmt: skip
            self.state.scheduler = build_lr_scheduler(
                self.state.optimizer, schedule=lr_schedule, warmup_steps=warmup_steps,
                total_steps=total_steps, min_lr_ratio=min_lr_ratio,
            )  # fmt: skip
            self.optimizer_step = OptimizerStep(
                self.state, max_grad_norm, max_consecutive_nonfinite
            )
        self._optimizer_offloaded = False
        # the parts the controller calls by dotted name (see the module docstring)
        self.checkpoint = CheckpointIO(self.state, export_dtype=getattr(torch, precision))
        self.refit = WeightStreamer(self.state)
        self.generation = ColocatedGenerationView(self.state)

    def _load_models(
        self,
        source: ModelSource,
        topo: Topology,
        mp_policy: Any,
        activation_checkpointing: bool,
        lean_loading: bool,
        init_reference_model: bool,
        lora: LoraSpec | None,
    ) -> PolicyState:
        """The policy (measuring what loading it cost this rank) and its frozen reference
        (with LoRA: none to load, the base model is it)."""
        from tempering.utils.resources import current_rss_gb, process_usage

        rss_before = current_rss_gb()
        model, adapters = load_sharded(
            source, topo, mp_policy, activation_checkpointing=activation_checkpointing,
            lean_loading=lean_loading, lora=lora,
        )  # fmt: skip
        # what loading cost this rank at its peak (lean loading: a shard plus one tensor)
        self._load_peak_gb = process_usage()["peak_rss_gb"] - rss_before
        reference_model = None
        if init_reference_model and adapters is None:
            reference_model, _ = load_sharded(
                source, topo, mp_policy, activation_checkpointing=False, lean_loading=lean_loading
            )
            reference_model.requires_grad_(False)
            reference_model.eval()
        return PolicyState(topo, source, model, reference_model, lora=adapters)

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
        if self.state.optimizer is None and not eval_mode:
            raise RuntimeError("FSDP2PolicyWorker.train: built with init_optimizer=False")
        local_gbs = local_batch_size(data.size, global_batch_size, self.state.topo.dp_size)
        check_pairwise_batching(loss_fn, micro_batch_size, max_tokens_per_microbatch)
        if with_reference and not self.state.has_reference:
            raise RuntimeError(
                "FSDP2PolicyWorker.train(with_reference=True): this worker has no reference "
                "model; build the policy with init_reference_model=True"
            )
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)
        self.state.model.train(not eval_mode)
        steps: list[dict[str, float]] = []
        for start in range(0, data.size, local_gbs):
            batch = data.slice(start, start + local_gbs)
            with torch.set_grad_enabled(not eval_mode):
                steps.append(
                    self._run_global_batch(batch, loss_fn, batching, not eval_mode, with_reference)
                )
        return combine_steps(steps)

    def _run_global_batch(
        self,
        batch: BatchedDataDict,
        loss_fn: LossFunction,
        batching: Batching,
        do_step: bool,
        with_reference: bool,
    ) -> dict[str, float]:
        """One global batch: the global counts, the micro-batches by ``batching``, an optimizer
        step when ``do_step``, and the batch's global metrics."""
        topo = self.state.topo
        t0 = time.perf_counter()
        g_toks, g_seqs, g_tokens = self._global_counts(batch, loss_fn.pairwise)
        mbs, layouts, _ = self.forward_pass.split(batch, *batching)
        computed = float(
            sum(computed_tokens(mb, lay) for mb, lay in zip(mbs, layouts, strict=True))
        )
        normalisers = (
            torch.tensor(g_toks, device=topo.device),
            torch.tensor(g_seqs, device=topo.device),
        )
        loss_sum, mb_metrics = self._forward_backward(
            mbs, layouts, loss_fn, normalisers, do_step, with_reference
        )
        global_loss, g_computed = topo.all_reduce([loss_sum, computed])
        result: dict[str, float] = {}
        if do_step:
            assert self.optimizer_step is not None
            result.update(self.optimizer_step(global_loss))
        elapsed = time.perf_counter() - t0
        (elapsed,) = topo.all_reduce([elapsed], op=dist.ReduceOp.MAX)
        gathered = topo.all_gather_object(mb_metrics)
        result.update(aggregate_loss_metrics([m for rank_mbs in gathered for m in rank_mbs]))
        result.update(
            loss=global_loss,
            num_tokens=g_tokens,
            num_valid_tokens=g_toks,
            num_computed_tokens=g_computed,  # < num_tokens when shared prefixes ran once
            tokens_per_s=g_tokens / max(elapsed, 1e-9),
            step_time_s=elapsed,
        )
        return result

    def _global_counts(self, batch: BatchedDataDict, pairwise: bool) -> list[float]:
        """Valid tokens, valid sequences (pairs for a pairwise loss) and all tokens, summed
        over the DP ranks before any micro-batch runs (the losses divide by them)."""
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
        return self.state.topo.all_reduce([valid_toks, valid_seqs, num_tokens])

    def _forward_backward(
        self,
        mbs: list[BatchedDataDict],
        layouts: list[Layout],
        loss_fn: LossFunction,
        normalisers: tuple[torch.Tensor, torch.Tensor],
        do_step: bool,
        with_reference: bool,
    ) -> tuple[float, list[dict[str, float]]]:
        """Every micro-batch's loss (and its backward when ``do_step``); ranks with fewer
        micro-batches run padding passes. Returns the loss sum and per-micro-batch metrics."""
        model, topo = self.state.model, self.state.topo
        temperature = float(getattr(loss_fn, "temperature", 1.0))  # the LossFunction protocol
        reads_mask_only = bool(getattr(loss_fn, "reads_token_mask_only", False))
        loss_sum = 0.0
        mb_metrics: list[dict[str, float]] = []
        for i in range(topo.equalise(len(mbs))):
            threads.tick()  # torch threads follow the free cores (utils/threads.py)
            if i < len(mbs):
                mb = mbs[i].to(topo.device)
                reads = needed_rows(mb["token_mask"])  # the rows a token-mask read needs
                if with_reference:
                    with torch.no_grad(), self.state.reference() as reference:
                        ref = self.forward_pass.logits(reference, mb, layouts[i], reads=reads)
                        mb["reference_policy_logprobs"] = token_logprobs(
                            _at(ref, temperature), mb["input_ids"], mb.get("token_mask")
                        )  # read by the loss at its token mask only
                router: list[Any] | None = [] if self.moe is not None else None
                logits = self.forward_pass.logits(
                    model, mb, layouts[i], router, reads if reads_mask_only else None
                )
                logits = _at(logits, temperature)
                loss, metrics = loss_fn(logits, mb, *normalisers)
                loss_sum += float(loss.detach())
                if router is not None:
                    loss, metrics = self._add_router_loss(loss, metrics, router, mb, normalisers)
                mb_metrics.append(metrics)
            else:  # padding pass so every rank joins the same FSDP2 collectives
                loss = self.forward_pass.padding(model).sum() * 0.0
            if do_step:
                # FSDP2 averages gradients over DP ranks; the loss is already a global sum.
                (loss * topo.dp_size).backward()
        return loss_sum, mb_metrics

    def _add_router_loss(
        self,
        loss: torch.Tensor,
        metrics: dict[str, float],
        router: list[Any],
        mb: BatchedDataDict,
        normalisers: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """A mixture-of-experts micro-batch: its load-balancing term joins the loss (`moe.py`)."""
        assert self.moe is not None and router, "MoE models run whole rows (no shared prefix)"
        aux, router_logits, mask = router[0]
        valid = (mb["token_mask"].float() * mb["sample_mask"].float()[:, None]).sum()
        share = valid / normalisers[0].clamp(min=1.0)
        term, moe_metrics = self.moe.loss_and_metrics(aux, router_logits, mask, share)
        return loss + term, {**metrics, **moe_metrics}

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
        require_head(self.state.source.head, "causal_lm", "get_logprobs")
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)
        return BatchedDataDict(
            logprobs=self._logprobs(self.state.model, data, batching, temperature)
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict, *args: Any, **kwargs: Any
    ) -> BatchedDataDict:
        """``{"reference_policy_logprobs": [B, S]}`` from the frozen initial weights; the same
        arguments as `get_logprobs`."""
        faults.maybe_fault("policy", "logprobs")
        batching, temperature = _logprob_args(*args, **kwargs)
        with self.state.reference() as reference:
            return BatchedDataDict(
                reference_policy_logprobs=self._logprobs(reference, data, batching, temperature)
            )

    def score(self, data: BatchedDataDict, micro_batch_size: int) -> BatchedDataDict:
        """``{"scores": [B]}`` (CPU float32) of a reward model (``head="score"``), in order."""
        require_head(self.state.source.head, "score", "score")
        return BatchedDataDict(
            scores=torch.cat([torch.zeros(0), *self._head(data, micro_batch_size)])
        )

    def values(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        pack_sequences: bool = False,
    ) -> BatchedDataDict:
        """``{"values": [B, S]}`` (CPU float32) of a PPO critic (``head="value"``), in order,
        in the log-probs' layout (token t's value is read at t - 1; 0 at t = 0 and from each
        row's end on), batched as `get_logprobs` is (padded, token budgets or packed)."""
        require_head(self.state.source.head, "value", "values")
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)

        def head(values: torch.Tensor, mb: BatchedDataDict) -> tuple[torch.Tensor]:
            return (values * _valid_positions(values, mb),)

        return BatchedDataDict(
            values=self._per_token(self.state.model, data, batching, head, ((),))[0]
        )

    @torch.no_grad()
    def _head(self, data: BatchedDataDict, micro_batch_size: int) -> list[torch.Tensor]:
        """The head's outputs (CPU) micro-batch by micro-batch, in order (each trimmed to its
        longest row), every rank joining the same number of passes."""
        model, topo = self.state.model, self.state.topo
        model.eval()
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        mbs, layouts, _ = (
            self.forward_pass.split(view, micro_batch_size, None) if view.size else ([], [], None)
        )
        out = []
        for i in range(topo.equalise(len(mbs))):
            if i < len(mbs):
                out.append(
                    self.forward_pass.logits(model, mbs[i].to(topo.device), layouts[i]).cpu()
                )
            else:  # padding pass, result dropped
                self.forward_pass.padding(model)
        return out

    def get_topk_logprobs(
        self,
        data: BatchedDataDict,
        k: int,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        temperature: float = 1.0,
        pack_sequences: bool = False,
    ) -> BatchedDataDict:
        """A teacher's ``{"teacher_topk_logprobs", "teacher_topk_indices"}`` ``[B, S, k]``
        (`tempering.losses.topk_logprobs`' layout; 0 at t=0 and padding): only these travel."""
        faults.maybe_fault("policy", "logprobs")
        require_head(self.state.source.head, "causal_lm", "get_topk_logprobs")
        batching = (micro_batch_size, max_tokens_per_microbatch, pack_sequences)

        def head(logits: torch.Tensor, mb: BatchedDataDict) -> tuple[torch.Tensor, ...]:
            values, indices = topk_logprobs(_at(logits, temperature), k)
            valid = _valid_positions(values, mb)[..., None]
            # token ids as int32 (any vocabulary fits; half int64's bytes on the wire)
            return values * valid, (indices * valid.long()).to(torch.int32)

        values, indices = self._per_token(self.state.model, data, batching, head, ((k,), (k,)))
        return BatchedDataDict(teacher_topk_logprobs=values, teacher_topk_indices=indices)

    def _logprobs(
        self,
        model: torch.nn.Module,
        data: BatchedDataDict,
        batching: Batching,
        temperature: float,
    ) -> torch.Tensor:
        def head(logits: torch.Tensor, mb: BatchedDataDict) -> tuple[torch.Tensor]:
            logits = _at(logits, temperature)
            real = _valid_positions(mb["input_ids"], mb)
            return (token_logprobs(logits, mb["input_ids"], real),)  # [b, s], 0 at padding

        return self._per_token(model, data, batching, head, ((),))[0]

    @torch.no_grad()
    def _per_token(
        self,
        model: torch.nn.Module,
        data: BatchedDataDict,
        batching: Batching,
        head: Any,
        trailing: tuple[tuple[int, ...], ...],
    ) -> list[torch.Tensor]:
        """``head(logits, micro_batch)``'s tensors (``[b, s, *trailing[j]]`` each) for every
        row of `data`, padded to its width, in its row order (eval mode, no gradients)."""
        was_training = model.training
        model.eval()
        full_len = data["input_ids"].shape[1]
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        mbs, layouts, perm = (
            self.forward_pass.split(view, *batching) if view.size else ([], [], None)
        )
        pieces: list[tuple[torch.Tensor, ...]] = []
        for i in range(self.state.topo.equalise(len(mbs))):
            threads.tick()
            if i >= len(mbs):  # padding pass, result dropped
                self.forward_pass.padding(model)
                continue
            mb = mbs[i].to(self.state.topo.device)
            outs = head(self.forward_pass.logits(model, mb, layouts[i]), mb)
            pieces.append(tuple(
                torch.nn.functional.pad(o.cpu(), (*[0, 0] * len(t), 0, full_len - o.shape[1]))
                for o, t in zip(outs, trailing, strict=True)
            ))  # fmt: skip
        model.train(was_training)
        if not pieces:
            return [torch.zeros(0, full_len, *t) for t in trailing]
        out = [torch.cat(parts) for parts in zip(*pieces, strict=True)]
        if perm is not None:
            order = torch.argsort(perm)
            out = [o[order] for o in out]
        return out

    # ------------------------------------------------- colocation with generation
    def prepare_for_generation(self) -> None:
        """On GPU, move optimizer state to CPU to make room for a colocated generator."""
        optimizer = self.state.optimizer
        if self.state.topo.device.type == "cuda" and optimizer is not None:
            _move_optimizer_state(optimizer, torch.device("cpu"))
            self._optimizer_offloaded = True
            torch.cuda.empty_cache()

    def prepare_for_training(self) -> None:
        """Undo `prepare_for_generation`."""
        optimizer = self.state.optimizer
        if self._optimizer_offloaded and optimizer is not None:
            _move_optimizer_state(optimizer, self.state.topo.device)
            self._optimizer_offloaded = False

    # ------------------------------------------------------------------ misc
    def load_peak_gb(self) -> float:
        """Peak resident memory that loading the policy added to this rank, in GiB."""
        return self._load_peak_gb

    def get_rank_info(self) -> dict[str, Any]:
        return self.state.topo.info()

    def shutdown(self) -> None:
        """Leave the process group (for workers built directly in a test process)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _at(logits: Any, temperature: float) -> Any:
    """``logits`` at the sampling temperature (a tensor or `HiddenLogits`; 1.0: unchanged)."""
    return logits if temperature == 1.0 else logits / temperature


def _logprob_args(
    micro_batch_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    temperature: float = 1.0,
    pack_sequences: bool = False,
) -> tuple[Batching, float]:
    """`get_logprobs`' keyword arguments as ``(batching, temperature)``."""
    return (micro_batch_size, max_tokens_per_microbatch, pack_sequences), temperature


def _valid_positions(like: torch.Tensor, mb: BatchedDataDict) -> torch.Tensor:
    """``[b, s]`` 1 where a position holds a real token of its row (in `like`'s dtype)."""
    seq = torch.arange(like.shape[1], device=like.device)
    return (seq[None, :] < mb["input_lengths"][:, None]).to(like.dtype)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


__all__ = ["FSDP2PolicyWorker", "NonFiniteTrainingError"]
