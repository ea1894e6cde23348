"""A model's shape (layers, widths, vocabulary) without loading it, for the placement planner.

    shape = model_shape("meta-llama/Llama-3.1-8B")   # a `ModelShape`, or None if unknown here
    plan = plan_for(cfg)                             # `make_plan` with the config's models read

From the model's ``config.json`` when it is on this machine (a folder, one of the project's
own models, or the HF cache), else from `KNOWN_SHAPES` (hub ids the shipped GPU configs name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tempering.distributed.placement import ModelShape, Plan, make_plan, positions_in
from tempering.models.registry import MODEL_REGISTRY, REPO_ROOT, resolve_model_path

__all__ = ["KNOWN_SHAPES", "max_positions", "model_shape", "plan_for"]


def _shape(**cfg: Any) -> ModelShape:
    return ModelShape.from_config(cfg, source="known hub id")


# Hub ids the shipped configs name, whose config.json may not be on this machine (published
# config.json values; `params` reproduces the published counts, tested).
KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-1.5B": _shape(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                tie_word_embeddings=True, model_type="qwen2"),
    "meta-llama/Llama-3.2-1B": _shape(hidden_size=2048, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=8192, vocab_size=128256, head_dim=64,
                                      tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B": _shape(hidden_size=4096, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=14336, vocab_size=128256),
    "smollm2-135m-instruct": _shape(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                    num_key_value_heads=3, intermediate_size=1536,
                                    vocab_size=49152, tie_word_embeddings=True),
}  # fmt: skip
KNOWN_SHAPES["meta-llama/Llama-3.2-1B-Instruct"] = KNOWN_SHAPES["meta-llama/Llama-3.2-1B"]
KNOWN_SHAPES["meta-llama/Llama-3.1-8B-Instruct"] = KNOWN_SHAPES["meta-llama/Llama-3.1-8B"]


def plan_for(cfg: Any) -> Plan:
    """`make_plan` for a master config, with what it needs of its models read here: the
    policy's shape and positions and, for on-policy distillation, the teacher's; for PPO
    with a critic of its own, the critic's."""
    teacher, critic = getattr(cfg, "teacher", None), getattr(cfg, "critic", None)
    shape, positions = _shape_and_positions(cfg.policy.model_name)
    tshape, tpositions = _shape_and_positions(teacher.model_name) if teacher else (None, None)
    own = critic is not None and critic.enabled and critic.model_name
    cshape, cpositions = _shape_and_positions(critic.model_name) if own else (None, None)
    return make_plan(cfg, shape, tshape, positions=positions, teacher_positions=tpositions,
                     critic_shape=cshape, critic_positions=cpositions)  # fmt: skip


def model_shape(model_name: str) -> ModelShape | None:
    """The shape of ``model_name`` without loading (or downloading, or converting) it."""
    return _shape_and_positions(model_name)[0]


def max_positions(model_name: str) -> int | None:
    """The positions ``model_name`` was made for, from any config that names them (a model
    `model_shape` cannot size, OPT say, included); None where none is found."""
    return _shape_and_positions(model_name)[1]


def _shape_and_positions(model_name: str) -> tuple[ModelShape | None, int | None]:
    """The model's shape (None where unknown or not sizable) and its positions, from one read
    of its config."""
    if model_name in KNOWN_SHAPES:
        return KNOWN_SHAPES[model_name], KNOWN_SHAPES[model_name].max_positions
    found = _config(model_name)
    return (_read_shape(*found), positions_in(found[0])) if found else (None, None)


def _config(model_name: str) -> tuple[dict[str, Any], str] | None:
    """``model_name``'s config.json and where it was found, without loading the model."""
    folders = [Path(model_name), REPO_ROOT / "models" / model_name]
    if model_name in MODEL_REGISTRY:  # the project's own small models: cheap to resolve
        folders.append(Path(resolve_model_path(model_name)))
    for folder in folders:
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text()), "config.json"
    try:  # a hub id already in the local cache
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_name, "config.json")
    except Exception:  # not a valid repo id
        return None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), "HF cache"
    return None


def _read_shape(config: dict[str, Any], source: str) -> ModelShape | None:
    """The shape in a Llama-style config (hidden_size, num_hidden_layers, ...) or a GPT-2's
    (n_embd, n_layer, ...), else None (GPT-J, say, names its sizes GPT-2's way but is built
    otherwise): the planner notes that memory went unchecked."""
    try:
        return ModelShape.from_config(config, source)
    except KeyError:
        return None
