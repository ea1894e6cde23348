"""tiny-arith: the project's own ~0.5M-parameter model for 2-digit arithmetic, built locally.

Everything here is deterministic and offline:

- `build_tokenizer()` trains a byte-level BPE (~300 tokens) on generated problem text, with
  every digit its own token (`Digits(individual_digits=True)`) so numbers are spelled digit by
  digit. No BOS is added anywhere; EOS ends an answer. Its chat template renders message
  contents verbatim and appends EOS after assistant messages, so the chat-template path and
  the plain-concatenation path give the same tokens (`"Q: 23+45=? A:"` + `" 68"` + EOS).
- `make_problems(n, seed)` samples `{"prompt": "Q: 23+45=? A:", "answer": "68"}`; a problem
  is held out (split "test") iff a hash of its text says so, so train and test never overlap.
- `build_untrained(out_dir)` saves tokenizer + a randomly initialised Llama (hidden 128,
  2 heads of dim 64, 2 layers) in `save_pretrained` format; tempering's SFT trains it and
  the result is committed at `models/tiny-arith/` (see `tempering.models.registry`).
- `greedy_accuracy(model, tokenizer, problems)` scores exact-match answers with the
  torch-native generation engine.

    uv run python -c "from tempering.models.tiny_arith import build_untrained; build_untrained('/tmp/ta')"
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB_SIZE = 300
HELD_OUT_FRACTION = 0.1
OPERATIONS = ("+", "-")

# Assistant turns end with EOS; nothing else is added (no roles, no BOS, no generation prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)

Split = Literal["train", "test"]
Problem = dict[str, str]


# ---- problems ------------------------------------------------------------------------------


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def is_held_out(a: int, op: str, b: int, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether `a op b` belongs to the held-out (test) split: a fixed hash of the problem."""
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def problem_pool(split: Split = "train", ops: Sequence[str] = ("+",)) -> list[Problem]:
    """Every 2-digit problem of `split` (a, b in 10..99; subtraction only with a >= b)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} must be 'train' or 'test'.")
    bad = [op for op in ops if op not in OPERATIONS]
    if bad or not ops:
        raise ValueError(f"ops={tuple(ops)!r} must be a non-empty subset of {OPERATIONS}.")
    pool = []
    for op in ops:
        for a in range(10, 100):
            for b in range(10, 100):
                if op == "-" and a < b:
                    continue
                if is_held_out(a, op, b) == (split == "test"):
                    pool.append({"prompt": f"Q: {a}{op}{b}=? A:", "answer": str(_answer(a, op, b))})
    return pool


def make_problems(
    n: int, seed: int = 0, split: Split = "train", ops: Sequence[str] = ("+",)
) -> list[Problem]:
    """`n` problems `{"prompt": "Q: 23+45=? A:", "answer": "68"}` from `split`, seeded.

    Distinct while `n` fits in the split's pool; beyond that (train only) the pool is cycled in
    fresh shuffles. The test split is disjoint from train by construction (`is_held_out`).
    """
    pool = problem_pool(split, ops)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    if split == "test" and n > len(pool):
        raise ValueError(
            f"make_problems: n={n} exceeds the {len(pool)} held-out problems for ops={tuple(ops)}; "
            "ask for fewer (or add '-' to ops)."
        )
    rng = random.Random(seed)
    out: list[Problem] = []
    while len(out) < n:
        out.extend(rng.sample(pool, min(len(pool), n - len(out))))
    return out


_LEADING_INT = re.compile(r"\s*([+-]?\d+)")


def parse_answer(completion: str) -> str | None:
    """The integer at the start of a completion (after whitespace), normalised; else None."""
    match = _LEADING_INT.match(completion)
    return str(int(match.group(1))) if match else None


# ---- tokenizer -----------------------------------------------------------------------------


def _training_text(seed: int = 0) -> Iterator[str]:
    for p in make_problems(4000, seed, "train", OPERATIONS):
        yield f"{p['prompt']} {p['answer']}"
    yield "The answer is the sum or the difference of two numbers. What is it?"


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE (deterministic) and wrap it with specials + chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
        padding_side="right",
    )


def format_sft_example(problem: Problem, tokenizer: Any) -> dict[str, Any]:
    """The training line `"Q: 23+45=? A: 68"` + EOS as token ids, loss on the answer part.

    Returns `{"text", "input_ids": list[int], "token_mask": list[int]}`; `token_mask` is 1 on
    `" 68"` and EOS (the tokens the model must produce) and 0 on the prompt.
    """
    prompt_ids = tokenizer(problem["prompt"], add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(" " + problem["answer"], add_special_tokens=False)["input_ids"]
    answer_ids = [*answer_ids, tokenizer.eos_token_id]
    return {
        "text": f"{problem['prompt']} {problem['answer']}",
        "input_ids": [*prompt_ids, *answer_ids],
        "token_mask": [0] * len(prompt_ids) + [1] * len(answer_ids),
    }


# ---- model ---------------------------------------------------------------------------------


def tiny_arith_config(tokenizer: Any, num_layers: int = 2) -> LlamaConfig:
    """Llama, hidden 128 = 2 heads x 64 (vLLM's CPU backend needs head_dim >= 64), tied."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_untrained(out_dir: str | Path, seed: int = 0, num_layers: int = 2) -> Path:
    """Save tokenizer + randomly initialised model (seeded) to `out_dir`; returns it."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_arith_config(tokenizer, num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    batch_size: int = 128,
    max_new_tokens: int = 6,
) -> float:
    """Fraction of `problems` whose greedy completion starts with the right answer."""
    from tempering.models.generation.torch_engine import TorchGenerationEngine

    if not problems:
        raise ValueError("greedy_accuracy needs at least one problem.")
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=max_new_tokens, greedy=True)
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        enc = tokenizer(
            [p["prompt"] for p in chunk],
            add_special_tokens=False,
            padding=True,
            padding_side="right",
            return_tensors="pt",
        )
        out = engine.generate(
            {"input_ids": enc["input_ids"], "input_lengths": enc["attention_mask"].sum(1)}
        )
        lengths = enc["attention_mask"].sum(1).tolist()
        for i, problem in enumerate(chunk):
            gen = out["output_ids"][i, lengths[i] : out["unpadded_sequence_lengths"][i]]
            completion = tokenizer.decode(gen, skip_special_tokens=True)
            correct += parse_answer(completion) == problem["answer"]
    return correct / len(problems)
