"""The models gpu_check runs: tiny-arith (committed) and random-initialised ones built from an
HF config on the device (no download), saved as bf16 folders that the policy worker loads.

``SHAPES`` holds the full shapes (``--device cuda``); ``--quick`` builds the same families at
``QUICK_SHAPES`` (scaled down, the tiny tokenizer's vocabulary), so a CPU dry run takes
seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# name -> (family, config overrides). Llama-3-shaped (128k vocabulary, GQA 4:1) at ~0.5B and
# ~1.5B parameters, and Qwen3-0.6B's published shape.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-0.5b": ("llama3", {"hidden_size": 1024, "intermediate_size": 4096,
                               "num_hidden_layers": 24, "num_attention_heads": 16,
                               "num_key_value_heads": 4, "head_dim": 64,
                               "max_position_embeddings": 4096, "vocab_size": 128256}),
    "llama3-1.5b": ("llama3", {"hidden_size": 2048, "intermediate_size": 8192,
                               "num_hidden_layers": 20, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "head_dim": 64,
                               "max_position_embeddings": 4096, "vocab_size": 128256}),
    "qwen3-0.6b": ("qwen3", {"hidden_size": 1024, "intermediate_size": 3072,
                             "num_hidden_layers": 28, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "head_dim": 128,
                             "max_position_embeddings": 4096, "vocab_size": 151936}),
}  # fmt: skip
# --quick: each shape scaled down (same family, GQA ratio kept), the tiny tokenizer's vocabulary
QUICK_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-0.5b": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16},
    "llama3-1.5b": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16},
    "qwen3-0.6b": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 3,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}  # fmt: skip


@dataclass
class Workload:
    """The batch sizes one run uses (full on a GPU, small in --quick)."""

    parity_rows: int
    parity_len: int
    train_rows: int
    train_len: int
    timed_steps: int
    grpo_steps: int
    grpo_prompts: int
    held_out: int


FULL = Workload(parity_rows=4, parity_len=256, train_rows=8, train_len=1024, timed_steps=3,
                grpo_steps=30, grpo_prompts=32, held_out=256)  # fmt: skip
QUICK = Workload(parity_rows=4, parity_len=16, train_rows=4, train_len=32, timed_steps=1,
                 grpo_steps=2, grpo_prompts=4, held_out=32)  # fmt: skip


def model_names(quick: bool) -> list[str]:
    return ["tiny-arith"] + [f"{name}-tiny" if quick else name for name in SHAPES]


def build_model(name: str, out_dir: Path, device: torch.device) -> tuple[str, int]:
    """A folder for `name` (tiny-arith: the committed one) and the model's vocabulary size.
    Random models are initialised on `device` (seeded) and saved in bf16, so the fp32
    reference and the bf16 worker start from the same weights."""
    from tempering.models.registry import resolve_model_path

    if name == "tiny-arith":
        path = resolve_model_path("tiny-arith")
        return path, _vocab_of(path)
    import transformers

    from tempering.models.families import build_tokenizer, get_family, tiny_config

    quick = name.endswith("-tiny")
    family, shape = SHAPES[name.removesuffix("-tiny")]
    tokenizer = build_tokenizer(family)
    vocab = shape["vocab_size"]
    shape = {k: v for k, v in shape.items() if k != "vocab_size"}
    if quick:
        shape = QUICK_SHAPES[name.removesuffix("-tiny")]
    config = tiny_config(get_family(family), tokenizer, shape)
    if not quick:  # the family's real vocabulary (the tiny tokenizer's ids are a prefix of it)
        config.vocab_size = vocab
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = getattr(transformers, get_family(family).model_class)(config)
    folder = out_dir / name
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    return str(folder), int(config.vocab_size)


def _vocab_of(path: str) -> int:
    import json

    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def random_batch(rows: int, length: int, vocab: int, seed: int) -> Any:
    """Token ids drawn uniformly from the vocabulary, rows of different lengths, the first two
    tokens of each row a masked "prompt" (the layout `FSDP2PolicyWorker.train` takes)."""
    from tempering.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    valid = torch.arange(length)[None, :] < lengths[:, None]
    ids = torch.randint(0, vocab, (rows, length), generator=g) * valid
    token_mask = valid.float()
    token_mask[:, :2] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(rows)
    )
