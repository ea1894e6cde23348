"""Load Hugging Face tokenizers and causal LMs by `policy.model_name`, offline by default.

Names go through `tempering.models.registry.resolve_model_path` ("tiny-arith",
"smollm2-135m-instruct", a local folder, or a cached hub id), so the one clear
`ModelNotFoundError` is raised before transformers produces its own long network error.

    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_causal_lm("tiny-arith", dtype=torch.float32)
    encode = text_encoder(tok)  # text -> ids, the Rust tokenizer's speed where exact
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tempering.errors import UserInputError
from tempering.models.registry import hub_offline, resolve_model_path


class TokenizerMissingError(ValueError, UserInputError):
    """A model's tokenizer cannot be read (a folder holding weights only)."""


def load_tokenizer(
    name_or_path: str | os.PathLike[str],
    chat_template: str | None = None,
    named: tuple[str, str] | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template, or ``chat_template`` in its place: a run's
    ``policy.tokenizer.chat_template``) of a model; pad token set to eos if missing.
    ``named``: (the setting that named the folder, the fix), for `TokenizerMissingError`
    when the folder has no tokenizer (transformers says only what it could not build)."""
    path = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=hub_offline())
    except (OSError, ValueError) as err:
        if named is None:
            raise
        raise TokenizerMissingError(
            f"{named[0]}: no tokenizer can be read from {path} (a folder of weights only? it "
            f"needs tokenizer.json or tokenizer_config.json): {str(err).splitlines()[0]}. "
            f"Fix: {named[1]}."
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def text_encoder(tokenizer: Any, special_tokens: bool = False) -> Callable[[str], list[int]]:
    """``text -> ids``, exactly as ``tokenizer(text, add_special_tokens=special_tokens)``:
    through the Rust tokenizer itself where transformers' wrapper would only forward to it (a
    fast tokenizer with no truncation or padding set and its special-token splitting as the
    wrapper sets it), which costs a third of the wrapper's ~60 us a call; otherwise the
    wrapper."""
    fast = getattr(tokenizer, "is_fast", False)
    backend = getattr(tokenizer, "backend_tokenizer", None) if fast else None
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return lambda text: backend.encode(text, add_special_tokens=special_tokens).ids
    return lambda text: list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])


def load_causal_lm(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A causal LM in `dtype`, in eval mode, on CPU."""
    path = resolve_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=hub_offline())
    model.eval()
    return model


def load_sequence_classifier(
    name_or_path: str | os.PathLike[str], pad_token_id: int, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """``AutoModelForSequenceClassification`` with one label (a reward model), on CPU.

    From a causal-LM folder the body is the LM's and the ``score`` head is new (transformers
    says so); ``config.pad_token_id`` makes HF pool the score at the last non-pad token.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path, local_files_only=hub_offline())
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    return AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, local_files_only=hub_offline()
    )


def value_head_config(config: Any) -> Any:
    """``config`` for a PPO critic: one label (a value per token) and no dropout before the
    head (transformers' token classifiers default to 0.1, which would make a critic's values
    random in training)."""
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def load_token_classifier(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """``AutoModelForTokenClassification`` with one label (a PPO critic: a value per token),
    on CPU. From a causal-LM folder the body is the LM's and the ``score`` head is new."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = resolve_model_path(name_or_path)
    config = value_head_config(AutoConfig.from_pretrained(path, local_files_only=hub_offline()))
    return AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=dtype, local_files_only=hub_offline()
    )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s decoder layers in order: the modules whose class, or a class it derives
    from, is named in ``model._no_split_modules`` (FSDP2's ``fully_shard`` turns a
    ``LlamaDecoderLayer`` into an ``FSDPLlamaDecoderLayer`` subclass); [] if none."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
