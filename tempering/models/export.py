"""Hugging Face folders from training: the model every run ends with, and `tempering export`.

    save_hf_folder("results/run/final_hf", state_dict, hf_config, tokenizer_source="tiny-arith")
    export_checkpoint("results/run/step_600", "exported/")       # any DP/TP layout (DCP)

A folder holds the weights (safetensors, in the run's `policy.precision` unless told otherwise), the
model config, its generation config, and the tokenizer with its chat template, so that
``AutoModelForCausalLM.from_pretrained`` and vLLM load it. It is built under a temporary name
and renamed when complete (`tempering.utils.atomic.atomic_directory`): a crash leaves no
half-written folder behind.

`export_checkpoint` reads a step checkpoint written by the policy workers (DCP, sharded over
any number of ranks) into one process: the run's ``config.yaml`` names the model (for its
architecture and tokenizer), `torch.distributed.checkpoint` reshards the weights into a plain
model. A checkpoint still under its temporary name, or without ``.metadata`` /
``training_info.json``, is refused: it was not finished.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tempering.utils.atomic import TMP_MARKER, atomic_directory
from tempering.utils.checkpoint import run_folder_hint

log = logging.getLogger(__name__)

__all__ = ["ExportTargetError", "PartialCheckpointError", "export_checkpoint", "save_hf_folder"]


# the transformers class that loads a folder, by the worker's head
AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "score": "AutoModelForSequenceClassification",
    "value": "AutoModelForTokenClassification",
}


class PartialCheckpointError(ValueError):
    """The folder is not a complete step checkpoint."""


class ExportTargetError(ValueError):
    """OUT_DIR is a checkpoint folder, holds the checkpoint, or is something other than a
    previous export (and ``overwrite`` was not given)."""


def save_hf_folder(
    path: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    tokenizer_source: str | None,
    dtype: torch.dtype | None = None,
    head: str = "causal_lm",
    *,
    chat_template: str | None = None,
    model_source: str | None = None,
) -> Path:
    """Write an HF folder atomically (replacing an existing one); returns its path.
    ``head="score"``: a reward model that ``AutoModelForSequenceClassification`` loads;
    ``head="value"``: a PPO critic that ``AutoModelForTokenClassification`` loads.
    The tokenizer comes from ``tokenizer_source`` with ``chat_template`` replacing its own
    (a run's `policy.tokenizer`), the generation config from ``model_source`` (default: the
    tokenizer's folder)."""
    import transformers
    from transformers import GenerationConfig

    from tempering.models.hf import load_tokenizer

    auto = getattr(transformers, AUTO_CLASSES[head])
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
          for k, v in state_dict.items()}  # fmt: skip
    missing, unexpected = model.load_state_dict(sd, assign=True, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not _tied(model, k)]
    if missing or unexpected:
        raise ValueError(
            f"the weights do not fit {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    if dtype is not None:
        model.config.dtype = dtype
    with atomic_directory(path, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        if head == "causal_lm":  # a reward model or a critic generates nothing
            try:  # sampling defaults from the source model when it has them
                GenerationConfig.from_pretrained(model_source or tokenizer_source).save_pretrained(
                    tmp
                )
            except (OSError, TypeError, ValueError):
                GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        if tokenizer_source is not None:
            try:
                load_tokenizer(tokenizer_source, chat_template).save_pretrained(tmp)
            except (OSError, ValueError) as err:
                log.warning(
                    "no tokenizer saved with %s (%s has none: %s)", path, tokenizer_source, err
                )
    return Path(path)


def _tied(model: Any, key: str) -> bool:
    """True for an output embedding tied to the input one (absent from some checkpoints)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    out = model.get_output_embeddings()
    return out is not None and key.endswith("lm_head.weight")


def _check_out_dir(out: Path, step: Path, overwrite: bool) -> None:
    """Refuse an export target whose replacement could lose a run's results."""
    out_r, step_r = out.resolve(), step.resolve()
    if out_r == step_r or out_r in step_r.parents:
        raise ExportTargetError(
            f"OUT_DIR {out} holds the checkpoint being exported ({step}): replacing it would "
            "delete the run's checkpoints; export to another folder"
        )
    if not out.exists():
        return
    if (
        (out / "training_info.json").exists()
        or (out / "policy").is_dir()
        or any(out.glob("step_*"))
    ):
        raise ExportTargetError(
            f"OUT_DIR {out} is a checkpoint folder; `tempering export` never replaces one "
            "(not even with --overwrite): export to another folder"
        )
    previous_export = (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    if not (previous_export or overwrite):
        raise ExportTargetError(
            f"OUT_DIR {out} exists and is not a previous export (no config.json with "
            "safetensors weights): pass --overwrite to replace it, or export to another folder"
        )


def _policy_dir(ckpt: Path) -> tuple[Path, Path]:
    """(step folder, its policy/ DCP folder) for a step folder or its policy/ subfolder."""
    step = ckpt.parent if ckpt.name == "policy" else ckpt
    policy = step / "policy"
    if TMP_MARKER in step.name:
        raise PartialCheckpointError(
            f"{step} is a checkpoint still being written (or left by a crash): its name has "
            f"{TMP_MARKER!r}; export a complete step_<N> folder"
        )
    problems = [
        f"no {name}" for name, p in (("policy/.metadata", policy / ".metadata"),
                                     ("training_info.json", step / "training_info.json"),
                                     ("config.yaml", step / "config.yaml")) if not p.is_file()
    ]  # fmt: skip
    if problems:
        hint = run_folder_hint(step)
        if hint:  # the run's checkpoint_dir, one level above its steps
            raise PartialCheckpointError(hint)
        raise PartialCheckpointError(
            f"{step} is not a complete step checkpoint ({', '.join(problems)}); pass a "
            "step_<N> folder that a run finished writing"
        )
    return step, policy


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    dtype: str | None = None,
    overwrite: bool = False,
    adapter: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """A step checkpoint (any data/tensor-parallel layout) -> an HF folder at `out`.

    `out` may be new or a previous export (replaced); anything else that exists is refused
    unless ``overwrite``, and a checkpoint folder (or one holding `ckpt`) always is.
    A LoRA run's checkpoint (adapters only) is read onto its base model: `out` holds the
    merged model, or with ``adapter`` the adapters alone in PEFT's format.
    Returns the folder and what it was made from (step, model, dtype)."""
    import yaml
    from transformers import AutoConfig

    from tempering.models.registry import resolve_model_path

    step_dir, policy_dir = _policy_dir(Path(ckpt))
    _check_out_dir(Path(out), step_dir, overwrite)
    config = yaml.safe_load((step_dir / "config.yaml").read_text())
    policy_cfg = config.get("policy") or {}
    source = resolve_model_path(policy_cfg["model_name"])
    tokenizer_cfg = policy_cfg.get("tokenizer") or {}
    tokenizer_source = resolve_model_path(tokenizer_cfg.get("name") or source)
    files = {"chat_template": tokenizer_cfg.get("chat_template"), "model_source": source}
    hf_config = AutoConfig.from_pretrained(source)
    lora = _lora_of(policy_cfg)
    if adapter and lora is None:
        raise ValueError(f"--adapter: {step_dir} is not from a LoRA run (lora_cfg.enabled=false)")
    precision = dtype or policy_cfg.get("precision") or "float32"
    info = json.loads((step_dir / "training_info.json").read_text())
    made_from = {"step": info.get("step"), "model_name": policy_cfg["model_name"],
                 "dtype": "float32" if adapter else precision}  # fmt: skip
    if lora is None:
        state = _read_dcp(_empty_model(hf_config).state_dict(), policy_dir)
        return save_hf_folder(
            out, state, hf_config, tokenizer_source, getattr(torch, precision), **files
        ), made_from
    from tempering.models.hf import load_causal_lm
    from tempering.models.policy.lora import (
        LoraAdapters,
        LoraSpec,
        adapter_state,
        save_peft_adapter,
    )

    model = load_causal_lm(source, dtype=torch.float32)  # the frozen base: not in the checkpoint
    adapters = LoraAdapters.attach(model, LoraSpec(**lora), "causal_lm")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    full = model.state_dict()
    full.update(_read_dcp({k: v for k, v in full.items() if k in trainable}, policy_dir))
    if adapter:
        return save_peft_adapter(out, adapter_state(full), adapters.peft_config(source)), made_from
    return save_hf_folder(
        out, adapters.merge(full), hf_config, tokenizer_source, getattr(torch, precision), **files
    ), made_from


def _lora_of(policy_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """`FSDP2PolicyWorker`'s ``lora`` argument for the run's ``policy`` section (None: off)."""
    from tempering.config.schemas import LoraConfig

    raw = (policy_cfg.get("dtensor_cfg") or {}).get("lora_cfg") or {}
    return LoraConfig(**raw).worker_kwargs()


def _empty_model(hf_config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _read_dcp(wanted: dict[str, torch.Tensor], policy_dir: Path) -> dict[str, torch.Tensor]:
    """``wanted``'s tensors filled from the DCP checkpoint in one process. Strict: a tensor
    missing from the checkpoint fails here instead of staying random."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    state = {"model": wanted}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(policy_dir), planner=DefaultLoadPlanner(), no_dist=True)
    return state["model"]
