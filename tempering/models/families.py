"""The model families tempering trains: one registry entry per family, all its special cases in it.

Each `ModelFamily` says, for one architecture:

- how to build a TINY random-weight model of it from transformers' own config class
  (`build_tiny`: 2 layers, hidden 64, 4 heads, seeded), saved with ``save_pretrained`` together
  with a tokenizer, so CPU tests load it through `tempering.models.hf` like any local folder;
- the tokenizer: tiny-arith's committed byte-level BPE (`models/tiny-arith/tokenizer.json`)
  plus the family's real special tokens and a chat template in the family's real format
  (written here; the source of each format is named beside it). The end-of-turn token is the
  tokenizer's EOS, so generation stops where the chat splice (`generation/chat.py`) cuts;
- the tensor-parallel plan (`tp_plan_for`, used by `policy/model_setup.py`): decoder-layer
  module names -> ``colwise``/``rowwise``, or None with the reason the layout cannot be split
  that way, which start-up reports instead of sharding wrongly.

    from tempering.models.families import FAMILIES, build_tiny
    folder = build_tiny("qwen3", "/tmp/tiny-qwen3")   # then policy.model_name=/tmp/tiny-qwen3

Families are looked up by name (``FAMILIES``) or by a checkpoint's ``config.model_type``
(`family_for_model_type`); plugins add one with `register_family`. docs/model_families.md
says what each family needed and what the tests cover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from tempering.models.registry import TINY_ARITH_DIR

__all__ = [
    "FAMILIES",
    "LLAMA_TP_PLAN",
    "ModelFamily",
    "build_tiny",
    "build_tokenizer",
    "check_vllm_cpu_refit",
    "family_for_model_type",
    "get_family",
    "register_family",
    "tiny_model",
    "tool_parser_for_eot",
    "tp_plan_for",
]

# Megatron-style split of a Llama-style decoder layer: q/k/v and gate/up by output columns,
# o/down by input rows, so each layer needs one all-reduce in attention and one in the MLP.
# Embeddings, norms and lm_head stay whole on every TP rank (FSDP2 shards them).
LLAMA_TP_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}  # fmt: skip

# The tiny shape every family shares (per-family extras go in `ModelFamily.config_kwargs`).
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256,
}  # fmt: skip
# vLLM's CPU attention kernels take head sizes of 32 and up (not TINY_SHAPE's 16).
VLLM_CPU_SHAPE: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64,
}  # fmt: skip


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family and everything tempering does differently for it."""

    name: str
    model_type: str  # config.model_type of its checkpoints
    config_class: str  # transformers class names (real parts, resolved when built)
    model_class: str
    special_tokens: tuple[str, ...]  # the family's real specials, added to the tiny BPE
    eot_token: str  # ends an assistant turn; the tokenizer's EOS
    pad_token: str
    bos_token: str | None
    chat_template: str
    template_source: str  # where the format's facts come from
    tp_plan: dict[str, str] | None = None
    tp_refusal: str = ""  # why tp_plan is None
    vllm_cpu_refit_refusal: str = ""  # why refits into vLLM on CPU are refused (else allowed)
    config_kwargs: dict[str, Any] = field(default_factory=dict)  # overrides of TINY_SHAPE
    notes: str = ""  # what this family needed beyond the shared recipe
    tool_parser: str = "hermes"  # generation/chat.py TOOL_CALL_PARSERS name for its tool calls


# ---- chat templates (our own Jinja, minimal but in each family's real format) --------------
# transformers renders them with trim_blocks/lstrip_blocks: a newline right after a {% %} tag is
# dropped, so every newline the format needs sits before a tag, never after one.

# ChatML. Qwen2.5-Instruct's tokenizer_config.json: <|im_start|>{role}\n{content}<|im_end|>\n,
# generation prompt "<|im_start|>assistant\n", a default system message when none is given,
# EOS <|im_end|>, pad <|endoftext|>, no BOS.
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's tokenizer_config.json: ChatML without a default system message; with
# enable_thinking=False the generation prompt carries an empty <think>\n\n</think>\n\n block.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# Meta's Llama 3 / 3.1 model card ("Prompt format"): <|begin_of_text|>, then per message
# <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>; the generation prompt is
# an open assistant header. (3.1's default "Cutting Knowledge Date" system text is left out.)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral's V7 "tekken" format (Mistral-Small-24B-Instruct-2501, mistral-common docs):
# <s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{user}[/INST]{assistant}</s>. The assistant
# answers straight after [/INST], so there is no separate generation prompt.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}[/SYSTEM_PROMPT]"
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{%- else %}[INST]{{ m['content'] }}[/INST]{% endif %}{% endfor %}"
)
# Gemma 3 model card / ai.google.dev "Gemma formatting": <bos>, turns
# <start_of_turn>{user|model}\n{content}<end_of_turn>\n; no system role -- a system message is
# folded into the first user turn (blank line after it); generation prompt
# "<start_of_turn>model\n"; instruction-tuned checkpoints stop on <end_of_turn>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(system='') %}{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{%- set ns.system = m['content'] + '\n\n' %}{%- else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ns.system if m['role'] != 'assistant' else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% if m['role'] != 'assistant' %}{% set ns.system = '' %}{% endif %}"
    "{% endif %}{% endfor %}{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Phi-3 / Phi-3.5-mini-instruct model card: <|system|>\n..<|end|>\n<|user|>\n..<|end|>\n
# <|assistant|>\n..<|end|>\n; generation prompt "<|assistant|>\n"; generation stops on <|end|>.
PHI3_TEMPLATE = (
    "{%- for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN3_SPECIALS = (*_QWEN_SPECIALS, "<think>", "</think>", "<tool_call>", "</tool_call>")
# what every ChatML family's tokenizer says of its turns (Qwen2.5's and Qwen3's configs)
_CHATML_TOKENS: dict[str, Any] = {
    "eot_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
}
# Qwen3's chat format, dense and MoE alike
_QWEN3_FORMAT: dict[str, Any] = {
    "special_tokens": _QWEN3_SPECIALS,
    **_CHATML_TOKENS,
    "chat_template": QWEN3_TEMPLATE,
    "template_source": "Qwen3 tokenizer_config.json (ChatML, enable_thinking)",
}

FAMILIES: dict[str, ModelFamily] = {
    "qwen2": ModelFamily(
        name="qwen2", model_type="qwen2",
        config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
        special_tokens=(*_QWEN_SPECIALS, "<tool_call>", "</tool_call>"), **_CHATML_TOKENS,
        chat_template=QWEN2_TEMPLATE,
        template_source="Qwen2.5-Instruct tokenizer_config.json (ChatML)",
        tp_plan=LLAMA_TP_PLAN,
        config_kwargs={"tie_word_embeddings": True},
        notes="q/k/v projections carry biases; column-split biases shard with their weights.",
    ),
    "qwen3": ModelFamily(
        name="qwen3", model_type="qwen3",
        config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
        **_QWEN3_FORMAT,
        tp_plan=LLAMA_TP_PLAN,
        config_kwargs={"tie_word_embeddings": True},
        notes="q_norm/k_norm act per head (head_dim), so a column split by heads keeps them.",
    ),
    "llama3": ModelFamily(
        name="llama3", model_type="llama",
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                        "<|finetune_right_pad_id|>"),
        eot_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>",
        bos_token="<|begin_of_text|>",
        chat_template=LLAMA3_TEMPLATE,
        template_source="Meta Llama 3.1 model card, 'Prompt format'",
        tp_plan=LLAMA_TP_PLAN,
        config_kwargs={"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}},
        notes="llama3 RoPE scaling (original context shrunk to 64 to fit the tiny model); "
        "JSON tool calls.",
        tool_parser="llama3_json",
    ),
    "mistral": ModelFamily(
        name="mistral", model_type="mistral",
        config_class="MistralConfig", model_class="MistralForCausalLM",
        special_tokens=("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                        "[/SYSTEM_PROMPT]", "[TOOL_CALLS]"),
        eot_token="</s>", pad_token="<pad>", bos_token="<s>",
        chat_template=MISTRAL_TEMPLATE,
        template_source="mistral-common V7-tekken (Mistral-Small-24B-Instruct-2501)",
        tp_plan=LLAMA_TP_PLAN,
        notes="No generation prompt: the assistant answers right after [/INST]; tool calls "
        "follow [TOOL_CALLS].",
        tool_parser="mistral",
    ),
    "gemma3": ModelFamily(
        name="gemma3", model_type="gemma3_text",
        config_class="Gemma3TextConfig", model_class="Gemma3ForCausalLM",
        special_tokens=("<start_of_turn>", "<end_of_turn>"),
        eot_token="<end_of_turn>", pad_token="<pad>", bos_token="<bos>",
        chat_template=GEMMA3_TEMPLATE,
        template_source="Gemma 3 model card / ai.google.dev 'Gemma formatting'",
        tp_plan=LLAMA_TP_PLAN,
        config_kwargs={"layer_types": ["sliding_attention", "full_attention"],
                       "sliding_window": 512, "query_pre_attn_scalar": 16},
        notes="One sliding-window and one full-attention layer (the engine caches both kinds); "
        "no system role: the template folds it into the first user turn.",
    ),
    "phi3": ModelFamily(
        name="phi3", model_type="phi3",
        config_class="Phi3Config", model_class="Phi3ForCausalLM",
        special_tokens=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        eot_token="<|end|>", pad_token="<|endoftext|>", bos_token=None,
        chat_template=PHI3_TEMPLATE,
        template_source="Phi-3.5-mini-instruct model card, 'Chat format'",
        tp_plan=None,
        tp_refusal="Phi-3 fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj; a "
        "column split of a fused weight gives rank 0 all of q and none of v, so it needs a "
        "per-part split that tempering does not implement yet",
        config_kwargs={"head_dim": None},  # Phi3Config derives it (hidden / heads)
        notes="Phi3Config's default pad/bos/eos ids (32000, 1, 32000) lie outside a small vocab: "
        "set from the tokenizer.",
    ),
    "qwen3_moe": ModelFamily(
        name="qwen3_moe", model_type="qwen3_moe",
        config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM",
        **_QWEN3_FORMAT,
        tp_plan=None,
        tp_refusal="Qwen3-MoE keeps its experts as one fused 3-D parameter per layer "
        "(mlp.experts.gate_up_proj/down_proj), not nn.Linear modules: ColwiseParallel/"
        "RowwiseParallel cannot shard them and expert parallelism is not implemented",
        vllm_cpu_refit_refusal="vLLM's CPU experts compute from a prepacked copy of their "
        "weights, and its in-place reload leaves them in checkpoint layout (sampling 0.04 nats "
        "off after a refit, tests/functional/test_family_vllm.py); the first load is exact",
        config_kwargs={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "tie_word_embeddings": True},
        notes="Mixture of experts (4 experts, top-2).",
    ),
}  # fmt: skip


def register_family(family: ModelFamily) -> None:
    """Add a family (a plugin's); its name and model_type must be new."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered; pick another name")
    if family_for_model_type(family.model_type) is not None:
        raise ValueError(f"model_type {family.model_type!r} already belongs to a registered family")
    FAMILIES[family.name] = family


def get_family(name: str | ModelFamily) -> ModelFamily:
    """A registered family by name (a `ModelFamily` passes through)."""
    if isinstance(name, ModelFamily):
        return name
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is unknown; registered: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """The family whose checkpoints have this ``config.model_type``, else None."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def check_vllm_cpu_refit(model_type: str) -> None:
    """Refuse, naming the reason and the fix, a family whose refits into vLLM on CPU are
    known to be wrong (`ModelFamily.vllm_cpu_refit_refusal`)."""
    family = family_for_model_type(model_type)
    if family is not None and family.vllm_cpu_refit_refusal:
        raise ValueError(
            f"policy.generation.backend=vllm on CPU cannot be refitted with a {family.name} "
            f"model: {family.vllm_cpu_refit_refusal}. Fix: policy.generation.backend=torch "
            "(exact after every refit), or run vLLM on GPUs"
        )


def tp_plan_for(model_type: str) -> dict[str, str]:
    """The tensor-parallel plan for a ``config.model_type``: the family's, the Llama-style
    plan for a type no family claims, and a ValueError naming the reason for a family whose
    layers cannot be split (``tp_plan`` None)."""
    family = family_for_model_type(model_type)
    if family is None:
        return LLAMA_TP_PLAN
    if family.tp_plan is None:
        raise ValueError(
            f"tensor parallelism is not supported for model family {family.name!r} "
            f"(model_type={model_type!r}): {family.tp_refusal}. Fix: set "
            "policy.dtensor_cfg.tensor_parallel_size=1 (FSDP2 alone shards this model)."
        )
    return family.tp_plan


def tool_parser_for_eot(eot_token: str) -> str | None:
    """The tool-call parser of the families whose chat format ends turns with `eot_token`
    (the chat format, not the architecture, decides it: SmolLM2 is a Llama with ChatML), or
    None when no family uses that token or the families using it disagree."""
    parsers = {f.tool_parser for f in FAMILIES.values() if f.eot_token == eot_token}
    return parsers.pop() if len(parsers) == 1 else None


# ---- building ----------------------------------------------------------------------------


def build_tokenizer(family: ModelFamily | str) -> PreTrainedTokenizerFast:
    """tiny-arith's BPE + the family's special tokens, chat template, EOS (= end of turn)."""
    fam = get_family(family)
    base = Tokenizer.from_file(str(TINY_ARITH_DIR / "tokenizer.json"))
    return PreTrainedTokenizerFast(
        tokenizer_object=base,
        bos_token=fam.bos_token,
        eos_token=fam.eot_token,
        pad_token=fam.pad_token,
        additional_special_tokens=list(fam.special_tokens),
        chat_template=fam.chat_template,
        model_max_length=TINY_SHAPE["max_position_embeddings"],
        padding_side="right",
    )


def tiny_config(
    family: ModelFamily, tokenizer: PreTrainedTokenizerFast, shape: dict[str, Any] | None = None
) -> Any:
    """The family's transformers config at the tiny shape (``shape`` overrides its entries),
    token ids from `tokenizer`."""
    kwargs = {**TINY_SHAPE, **(shape or {}), **family.config_kwargs}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}  # None: the class's default
    config_class = getattr(transformers, family.config_class)
    return config_class(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **kwargs,
    )


def tiny_model(
    family: ModelFamily | str,
    seed: int = 0,
    shape: dict[str, Any] | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Any:
    """A tiny random-weight model of `family` (seeded; the global RNG left as it was), token
    ids from `tokenizer` (default: the family's tiny one)."""
    fam = get_family(family)
    config = tiny_config(fam, tokenizer or build_tokenizer(fam), shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(transformers, fam.model_class)(config)


def build_tiny(
    family: ModelFamily | str,
    out_dir: str | Path,
    seed: int = 0,
    shape: dict[str, Any] | None = None,
) -> Path:
    """Save a tiny random-weight model of `family` (seeded) + its tokenizer to `out_dir`;
    ``shape`` overrides `TINY_SHAPE` entries (e.g. `VLLM_CPU_SHAPE`)."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(get_family(family))
    model = tiny_model(family, seed, shape, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
