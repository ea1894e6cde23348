"""Reward model: a sequence-classification head (one score per sequence) trained with FSDP2.

Two pieces:

- `RewardModelWorker`: one data-parallel rank. It loads
  ``AutoModelForSequenceClassification.from_pretrained(<causal-LM folder>, num_labels=1)``
  (the transformer body comes from the causal LM; the ``score`` head is new), sets
  ``config.pad_token_id`` so HF pools the score at the last non-pad token, shards it with
  ``fully_shard`` per decoder layer and at the root, and trains it with the Bradley-Terry loss
  on interleaved chosen/rejected rows. Optimizer and LR schedule come from `optim.py`,
  micro-batch trimming from `fsdp2_worker.py`, both by import.
- `RewardModel`: the controller's facade over a `RayWorkerGroup` of those workers
  (`build_reward_model`), with `train`, `score`, checkpoints and `export_hf`.

    rm = build_reward_model(cluster, "tiny-arith", pad_token_id=0, train_global_batch_size=64,
                            train_micro_batch_size=32, learning_rate=1e-3)
    metrics = rm.train(batch)            # {"loss", "accuracy", "margin", "grad_norm", ...}
    scores = rm.score(batch)["scores"]   # [B]
    rm.export_hf("results/rm/final_hf")  # AutoModelForSequenceClassification loads it

Padding: rows are right-padded with ``pad_token_id``; HF takes the rightmost token that is
not ``pad_token_id``. When a tokenizer's pad token equals its EOS token, a trailing EOS is
treated as padding, so the score sits on the token before it, the same in training, here and
in `tempering.environments.reward_model`.
"""

from __future__ import annotations

import logging
import os
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
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tempering.algorithms.loss_functions import BradleyTerryLoss, count_valid_pairs
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.policy.fsdp2_worker import (
    SCHEDULER_FILE,
    _combine_steps,
    _dummy_batch,
    _free_port,
    _full,
    _trim,
)
from tempering.models.policy.optim import build_lr_scheduler, build_optimizer

logger = logging.getLogger(__name__)

REWARD_MODEL_WORKER_FQN = "tempering.models.policy.reward_model_worker.RewardModelWorker"


def load_sequence_classifier(model_path: str, pad_token_id: int) -> torch.nn.Module:
    """``AutoModelForSequenceClassification`` with one label from an HF folder (fp32, CPU).

    From a causal-LM folder the score head is freshly initialised (transformers says so).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from tempering.models.registry import hub_offline, resolve_model_path

    path = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(path, local_files_only=hub_offline())
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    return AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=hub_offline()
    )


class RewardModelWorker:
    """One rank of an FSDP2-sharded reward model (see the module docstring).

    Args:
        model_path: registry name or local HF folder (causal LM or an exported reward model).
        pad_token_id: the tokenizer's pad id (the pooling position depends on it).
        learning_rate, weight_decay, betas, eps, optimizer: `optim.build_optimizer`.
        max_grad_norm: clip the global gradient norm; None = no clipping.
        lr_schedule, warmup_steps, total_steps, min_lr_ratio: `optim.build_lr_scheduler`.
        seed: torch seed (also initialises the new score head identically on every rank).
        num_threads: ``torch.set_num_threads`` (CPU).
    """

    def __init__(
        self,
        model_path: str,
        *,
        pad_token_id: int,
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
        seed: int = 42,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model_path = str(model_path)
        self.max_grad_norm = max_grad_norm
        self.loss_fn = BradleyTerryLoss()
        self._init_distributed()
        model = load_sequence_classifier(self.model_path, pad_token_id)
        self.hf_config = model.config
        layer_names = set(getattr(model, "_no_split_modules", None) or [])
        for layer in [m for m in model.modules() if type(m).__name__ in layer_names]:
            fully_shard(layer, mesh=self.mesh)
        self.model = fully_shard(model.to(self.device), mesh=self.mesh)
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

    def _init_distributed(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        cuda = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if cuda
            else (torch.device("cpu"))
        )
        if cuda:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            port = os.environ.get("MASTER_PORT")
            if port is None and self.world_size != 1:
                raise RuntimeError(
                    f"RewardModelWorker: WORLD_SIZE={self.world_size} but MASTER_PORT is not set; "
                    "start workers through build_reward_model (a RayWorkerGroup)"
                )
            dist.init_process_group(
                backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
                init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                f"{port or _free_port()}",
                rank=self.rank,
                world_size=self.world_size,
            )
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))

    def _sum(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _scores(self, mb: BatchedDataDict) -> torch.Tensor:
        ids = mb["input_ids"]
        seq = torch.arange(ids.shape[1], device=ids.device)
        attention_mask = (seq[None, :] < mb["input_lengths"][:, None]).long()
        return self.model(input_ids=ids, attention_mask=attention_mask).logits.float()[:, 0]

    def _microbatches(
        self, data: BatchedDataDict, micro_batch_size: int
    ) -> tuple[list[BatchedDataDict], int]:
        """Trimmed micro-batches and how many passes every rank runs (FSDP2 collectives must
        match: a rank with fewer runs padding passes on a dummy batch)."""
        mbs = [_trim(mb) for mb in data.make_microbatches(micro_batch_size)] if data.size else []
        return mbs, int(self._sum([float(len(mbs))], op=dist.ReduceOp.MAX)[0])

    # ---------------------------------------------------------------- train
    def train(
        self,
        data: BatchedDataDict,
        global_batch_size: int,
        micro_batch_size: int,
        eval_mode: bool = False,
    ) -> dict[str, float]:
        """Bradley-Terry steps over this rank's shard, one optimizer step per global batch
        (``global_batch_size`` rows over all ranks; chosen ``2i``, rejected ``2i+1``).
        ``eval_mode`` computes the same metrics without gradients or updates."""
        local = global_batch_size // self.world_size
        if global_batch_size % self.world_size or local % 2 or micro_batch_size % 2:
            raise ValueError(
                f"global_batch_size={global_batch_size} / world_size={self.world_size} and "
                f"micro_batch_size={micro_batch_size} must be even numbers of rows: batches "
                "interleave chosen/rejected pairs"
            )
        if data.size % local:
            raise ValueError(f"shard of {data.size} rows is not a multiple of {local}")
        self.model.train(not eval_mode)
        steps = []
        for start in range(0, data.size, local):
            with torch.set_grad_enabled(not eval_mode):
                steps.append(
                    self._global_batch(
                        data.slice(start, start + local), micro_batch_size, eval_mode
                    )
                )
        return _combine_steps(steps)

    def _global_batch(self, batch: BatchedDataDict, mbs_size: int, eval_mode: bool) -> dict:
        t0 = time.perf_counter()
        if "sample_mask" not in batch:
            batch["sample_mask"] = torch.ones(batch.size)
        pairs, tokens = self._sum(
            [
                float(count_valid_pairs(batch["sample_mask"].float())),
                float(batch["input_lengths"].sum()),
            ]
        )
        global_pairs = torch.tensor(pairs, device=self.device)
        loss_sum, metrics = 0.0, []
        mbs, passes = self._microbatches(batch, mbs_size)
        for i in range(passes):
            if i < len(mbs):
                mb = mbs[i].to(self.device)
                loss, m = self.loss_fn(self._scores(mb), mb, global_pairs, global_pairs)
                loss_sum += float(loss.detach())
                metrics.append(m)
            else:  # padding pass
                loss = self._scores(_dummy_batch(self.device)).sum() * 0.0
            if not eval_mode:
                (loss * self.world_size).backward()  # FSDP2 averages gradients over ranks
        result: dict[str, float] = {}
        if not eval_mode:
            max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            result["grad_norm"] = float(_full(grad_norm))
            result["lr"] = float(self.optimizer.param_groups[0]["lr"])
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        rows = [m for rank_rows in gathered for m in rank_rows]
        n = sum(m["num_valid_pairs"] for m in rows)
        for key in ("accuracy", "margin"):
            result[key] = sum(m[key] * m["num_valid_pairs"] for m in rows) / max(n, 1.0)
        (loss_total,) = self._sum([loss_sum])
        (elapsed,) = self._sum([time.perf_counter() - t0], op=dist.ReduceOp.MAX)
        result.update(
            loss=loss_total,
            num_valid_pairs=n,
            num_tokens=tokens,
            num_valid_tokens=tokens,
            step_time_s=elapsed,
            tokens_per_s=tokens / max(elapsed, 1e-9),
        )
        return result

    # ---------------------------------------------------------------- score
    @torch.no_grad()
    def score(self, data: BatchedDataDict, micro_batch_size: int) -> BatchedDataDict:
        """``{"scores": [B]}`` (CPU float32) for this rank's rows, in order."""
        self.model.eval()
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        mbs, passes = self._microbatches(view, micro_batch_size)
        out = [torch.zeros(0)]
        for i in range(passes):
            if i < len(mbs):
                out.append(self._scores(mbs[i].to(self.device)).cpu())
            else:  # padding pass, result dropped
                self._scores(_dummy_batch(self.device))
        return BatchedDataDict(scores=torch.cat(out))

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer (DCP) under `path`, scheduler beside it."""
        Path(path).mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(path) / SCHEDULER_FILE)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        if not (Path(path) / ".metadata").exists():
            raise FileNotFoundError(
                f"RewardModelWorker.load_checkpoint: {path} holds no DCP checkpoint "
                "(.metadata missing); pass the 'policy' folder of a complete step_N checkpoint"
            )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        sched = Path(path) / SCHEDULER_FILE
        if sched.exists():
            self.scheduler.load_state_dict(torch.load(sched, weights_only=True))
        dist.barrier()

    def export_hf(self, path: str) -> None:
        """An HF folder (config with num_labels=1 and pad_token_id, weights, tokenizer) that
        ``AutoModelForSequenceClassification.from_pretrained`` loads."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self.model, options=opts)
        if self.rank == 0:
            from transformers import AutoModelForSequenceClassification

            from tempering.models.hf import load_tokenizer
            from tempering.utils.atomic import atomic_directory

            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(self.hf_config)
            model.load_state_dict(sd, assign=True, strict=True)
            with atomic_directory(path, overwrite=True) as tmp:  # no half-written folder
                model.save_pretrained(tmp)
                load_tokenizer(self.model_path).save_pretrained(tmp)
        dist.barrier()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RewardModel:
    """The controller's handle on a data-parallel `RewardModelWorker` group."""

    def __init__(
        self, worker_group: Any, *, train_global_batch_size: int, train_micro_batch_size: int
    ) -> None:
        self.worker_group = worker_group
        self.train_global_batch_size = train_global_batch_size
        self.train_micro_batch_size = train_micro_batch_size

    def train(
        self,
        data: BatchedDataDict,
        *,
        eval_mode: bool = False,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """Bradley-Terry optimizer steps (or, with ``eval_mode``, metrics only) on `data`."""
        gbs = global_batch_size or self.train_global_batch_size
        if data.size % gbs:
            raise ValueError(
                f"RewardModel.train got {data.size} rows, not a multiple of the global batch "
                f"size {gbs}; drop the remainder"
            )
        futures = self.worker_group.run_all_workers_sharded_data(
            "train",
            data,
            batch_size=gbs,
            global_batch_size=gbs,
            micro_batch_size=micro_batch_size or self.train_micro_batch_size,
            eval_mode=eval_mode,
        )
        return self.worker_group.get_all_worker_results(futures)[0]

    def score(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """``{"scores": [B]}`` in the order of `data`."""
        n, dp = data.size, self.worker_group.dp_size
        view = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        if n % dp:
            view = BatchedDataDict.from_batches([view, view.select_indices([0] * (dp - n % dp))])
        futures = self.worker_group.run_all_workers_sharded_data(
            "score", view, micro_batch_size=micro_batch_size or self.train_micro_batch_size
        )
        scores = torch.cat([r["scores"] for r in self.worker_group.get_all_worker_results(futures)])
        return BatchedDataDict(scores=scores[:n])

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", str(path))

    def export_hf(self, path: str) -> None:
        self._all("export_hf", str(path))

    def shutdown(self) -> None:
        self.worker_group.shutdown()

    def _all(self, method: str, *args: Any) -> list[Any]:
        futures = self.worker_group.run_all_workers_single_data(method, *args)
        return self.worker_group.get_all_worker_results(futures)


def build_reward_model(
    cluster: Any,
    model_path: str,
    *,
    pad_token_id: int,
    train_global_batch_size: int,
    train_micro_batch_size: int,
    name_prefix: str = "reward_model",
    **worker_kwargs: Any,
) -> RewardModel:
    """One `RewardModelWorker` per bundle of `cluster` (kwargs: see `RewardModelWorker`)."""
    from tempering.distributed.actor_environments import PY_EXECUTABLES
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

    dp = sum(cluster.bundle_ct_per_node_list)
    if train_global_batch_size % (2 * dp) or train_micro_batch_size % 2:
        raise ValueError(
            f"policy.train_global_batch_size={train_global_batch_size} must be a multiple of "
            f"2 x data-parallel size ({2 * dp}) and policy.train_micro_batch_size="
            f"{train_micro_batch_size} even: reward-model batches are chosen/rejected pairs"
        )
    builder = RayWorkerBuilder(
        REWARD_MODEL_WORKER_FQN,
        model_path,
        pad_token_id=pad_token_id,
        py_executable=PY_EXECUTABLES.SYSTEM,
        **worker_kwargs,
    )
    group = RayWorkerGroup(cluster, builder, name_prefix=name_prefix)
    return RewardModel(
        group,
        train_global_batch_size=train_global_batch_size,
        train_micro_batch_size=train_micro_batch_size,
    )


__all__ = ["RewardModel", "RewardModelWorker", "build_reward_model", "load_sequence_classifier"]
