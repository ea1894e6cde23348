"""LoRA adapters on the policy: the `peft` library's layers, trained by our FSDP2 worker.

``policy.dtensor_cfg.lora_cfg.enabled=true`` (NeMo RL's keys) makes `FSDP2PolicyWorker` call
`LoraAdapters.attach` on the freshly built model, before tensor parallelism and FSDP2 split
it. What that means for the rest of the worker:

- **training**: peft's `LoraModel` wraps each targeted ``nn.Linear`` in place (the model
  keeps its class, config and decoder layers); only ``lora_A``/``lora_B`` (and a reward
  model's new score head, trained whole) keep ``requires_grad``, so the optimizer (which
  takes trainable parameters only) holds fp32 adapters and their AdamW state, nothing else.
  The output is ``W x + (alpha / dim) * B A dropout(x)``; B starts at zero, so step 0 is the
  base model exactly. With ``precision="bfloat16"`` the frozen base is stored in bf16
  (`freeze_base_in`), the adapters in fp32;
- **the reference policy for free**: `disabled` turns every adapter off for a forward, which
  is then the frozen base model bit for bit -- DPO's and GRPO's reference log-probs, with no
  second copy of the weights;
- **weights leaving the worker** (refit, export) are merged: `merge` turns peft's names
  (``q_proj.base_layer.weight`` + ``q_proj.lora_A.default.weight`` + ...) into the model's own
  (``q_proj.weight = W + scale * B @ A``), so a generation engine or ``from_pretrained`` sees a
  plain model; `adapter_state` / `save_peft_adapter` write the adapters alone in PEFT's format
  (``PeftModel.from_pretrained(base, folder)`` loads them);
- **tensor parallelism**: `tp_plan` rewrites a family's plan for wrapped layers: a colwise
  projection splits its base layer and ``lora_B`` by output columns (``lora_A`` whole), a
  rowwise one its base layer and ``lora_A`` by input rows (``lora_B`` whole), so each rank adds
  its own slice of the update;
- **checkpoints** hold what trains (`CheckpointIO` saves trainable parameters and their
  optimizer state only); the frozen base comes from the model source on resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; one adapter per policy
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt, and how (the plain arguments of ``policy.dtensor_cfg.lora_cfg``).

    ``match_all_linear``: every linear layer of the decoder (not the output head); otherwise
    ``target_modules``, each a module name or its last parts (``q_proj``, ``mlp.up_proj``).
    ``exclude_modules`` are removed from either. Scale = ``alpha / dim``."""

    dim: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    match_all_linear: bool = True

    def __post_init__(self) -> None:
        problems = [
            f"lora_cfg.{k}={v} must be > 0" for k, v in (("dim", self.dim), ("alpha", self.alpha))
            if v <= 0
        ]  # fmt: skip
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"lora_cfg.dropout={self.dropout} must lie in [0, 1)")
        if self.match_all_linear == bool(self.target_modules):
            problems.append(
                f"lora_cfg.match_all_linear={self.match_all_linear} with target_modules="
                f"{list(self.target_modules)}: set exactly one of them (match_all_linear=false "
                "to adapt only target_modules, or target_modules=[] to adapt every linear layer)"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def scale(self) -> float:
        return self.alpha / self.dim


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


@dataclass
class LoraAdapters:
    """The adapters of one policy rank's model (built by `attach`)."""

    spec: LoraSpec
    tuner: Any  # peft's LoraModel; its .model is the policy's model itself
    targets: list[str] = field(default_factory=list)  # adapted module names

    @classmethod
    def attach(cls, model: torch.nn.Module, spec: LoraSpec, head: str) -> LoraAdapters:
        """Wrap `model`'s targeted linear layers in place; freeze everything else (a
        ``head="score"`` reward model's new score head stays trainable, whole)."""
        from peft import LoraConfig
        from peft.tuners.lora import LoraModel

        targets = _select_targets(model, spec, head)
        config = LoraConfig(
            r=spec.dim, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
            target_modules=targets, bias="none",
        )  # fmt: skip
        tuner = LoraModel(model, config, ADAPTER)
        if head == "score":  # random at start: trained whole, like PEFT's modules_to_save
            model.score.requires_grad_(True)
        adapters = cls(spec, tuner, targets)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logger.info(
            "LoRA dim=%d alpha=%g on %d linear layers: %d trainable parameters of %d (%.2f%%)",
            spec.dim, spec.alpha, len(targets), trainable, total, 100.0 * trainable / total,
        )  # fmt: skip
        return adapters

    def freeze_base_in(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Store the frozen parameters in `dtype` (the policy's precision): only the
        adapters need fp32 master weights, as only they are updated."""
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Forwards inside run the base model alone (the frozen reference)."""
        layers = self._layers()
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def _layers(self) -> list[Any]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.tuner.model.modules() if isinstance(m, BaseTunerLayer)]

    def merge(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """peft-named full tensors -> the model's own names, adapters merged into their base
        weights (``W + scale * B @ A``, computed in fp32, returned in W's dtype). A wrapped
        layer's three tensors must come together (refit buckets never split a layer)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if is_adapter(name):
                continue
            if _BASE not in name:
                out[name] = tensor
                continue
            module, _, leaf = name.partition(_BASE)
            if leaf == "weight" and module + _A in state:
                a, b = state[module + _A].float(), state[module + _B].float()
                tensor = (tensor.float() + self.spec.scale * (b @ a)).to(tensor.dtype)
            out[f"{module}.{leaf}"] = tensor
        return out

    def peft_config(self, base_model: str) -> dict[str, Any]:
        """adapter_config.json's content (PEFT's LoraConfig, as ``save_pretrained`` writes it)."""
        from peft import LoraConfig

        config = LoraConfig(
            r=self.spec.dim, lora_alpha=self.spec.alpha, lora_dropout=self.spec.dropout,
            target_modules=sorted(self.targets), bias="none",
            base_model_name_or_path=base_model, task_type="CAUSAL_LM",
        )  # fmt: skip
        return config.to_dict()

    def tp_plan(self, layer: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
        """A family's decoder-layer TP plan with each wrapped projection split as the module
        docstring says (peft's wrapper is not an ``nn.Linear``; its parts are)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        modules = dict(layer.named_modules())
        out: dict[str, str] = {}
        for name, kind in plan.items():
            if not isinstance(modules.get(name), BaseTunerLayer):
                out[name] = kind
                continue
            out[f"{name}.base_layer"] = kind
            part = "lora_B" if kind == "colwise" else "lora_A"
            out[f"{name}.{part}.{ADAPTER}"] = kind
        return out


def is_adapter(name: str) -> bool:
    """Whether a peft-named state-dict entry is a LoRA adapter matrix."""
    return name.endswith((_A, _B))


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full peft-named state, under PEFT's file names
    (``base_model.model.<module>.lora_A.weight``: the adapter name dropped)."""
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            key = "base_model.model." + name.replace(f".{ADAPTER}.weight", ".weight")
            out[key] = tensor.detach().to("cpu", torch.float32).contiguous()
    return out


def save_peft_adapter(path: str | Path, tensors: Mapping[str, torch.Tensor], config: dict) -> Path:
    """A PEFT adapter folder, written atomically: adapter_model.safetensors and
    adapter_config.json (``PeftModel.from_pretrained(base, path)`` loads it)."""
    from safetensors.torch import save_file

    from tempering.utils.atomic import atomic_directory

    with atomic_directory(Path(path), overwrite=True) as tmp:
        save_file(dict(tensors), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, default=list))
    return Path(path)


def _select_targets(model: torch.nn.Module, spec: LoraSpec, head: str) -> list[str]:
    """Full names of the linear layers to adapt; an entry that matches nothing, or the
    score head of a reward model, is refused naming the model's linear layers."""
    output = model.get_output_embeddings() if head == "causal_lm" else None
    linear = [
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not output and n != "score"
    ]  # fmt: skip
    listing = sorted({n.split(".")[-1] for n in linear})
    if spec.match_all_linear:
        chosen = list(linear)
    else:
        if head == "score" and "score" in spec.target_modules:
            raise ValueError(
                "lora_cfg.target_modules names 'score', a reward model's score head: it starts "
                "random, so tempering trains it whole beside the adapters; remove 'score'"
            )
        missing = [t for t in spec.target_modules if not any(_matches(n, t) for n in linear)]
        if missing:
            raise ValueError(
                f"lora_cfg.target_modules {missing} match no linear layer of "
                f"{type(model).__name__}; its linear layers are named {listing} (e.g. "
                f"{linear[0] if linear else '-'}); fix the names or use match_all_linear=true"
            )
        chosen = [n for n in linear if any(_matches(n, t) for t in spec.target_modules)]
    excluded = [n for n in chosen if any(_matches(n, x) for x in spec.exclude_modules)]
    chosen = [n for n in chosen if n not in excluded]
    if not chosen:
        raise ValueError(
            f"lora_cfg selects no layer of {type(model).__name__} (exclude_modules="
            f"{list(spec.exclude_modules)} removed {len(excluded)}); its linear layers are "
            f"named {listing}"
        )
    return chosen
