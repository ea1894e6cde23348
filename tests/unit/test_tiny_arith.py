"""tiny-arith: tokenizer, problem generator, SFT formatting, model building and evaluation."""

from __future__ import annotations

import re

import pytest
import torch

from tempering.models import tiny_arith as ta
from tempering.models.hf import load_causal_lm, load_tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on the shared 2-core machine, 2 threads spin against other jobs
    (150 tiny training steps took 120 s with 2 threads under load, 7 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return ta.build_tokenizer()


def test_tokenizer_is_deterministic_small_and_splits_digits(tokenizer):
    again = ta.build_tokenizer()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert 256 < len(tokenizer) <= 300
    ids = tokenizer("Q: 1234+98=? A: 1332", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("1234981332")
    assert tokenizer.decode(ids) == "Q: 1234+98=? A: 1332"
    specials = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert len(set(specials)) == 3 and None not in specials
    assert ids[0] != tokenizer.bos_token_id  # no BOS added


def test_chat_template_renders_the_plain_training_line(tokenizer):
    messages = [
        {"role": "user", "content": "Q: 23+45=? A:"},
        {"role": "assistant", "content": " 68"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "Q: 23+45=? A: 68<eos>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "Q: 23+45=? A:"


def test_make_problems_correct_seeded_and_split_disjoint():
    problems = ta.make_problems(200, seed=1, ops=("+", "-"))
    assert len(problems) == 200 and len({p["prompt"] for p in problems}) == 200
    for p in problems:
        assert p["prompt"].startswith("Q: ") and p["prompt"].endswith("=? A:")
        a, op, b = re.fullmatch(r"Q: (\d\d)([+-])(\d\d)=\? A:", p["prompt"]).groups()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert p["answer"] == str(expected) and expected >= 0
    assert ta.make_problems(200, seed=1, ops=("+", "-")) == problems
    assert ta.make_problems(200, seed=2, ops=("+", "-")) != problems
    train = {p["prompt"] for p in ta.problem_pool("train", ("+", "-"))}
    test = {p["prompt"] for p in ta.problem_pool("test", ("+", "-"))}
    assert not train & test
    assert len(train) + len(test) == 90 * 90 + 90 * 91 // 2
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15
    assert {p["prompt"] for p in ta.make_problems(50, 0, split="test")} <= test
    # Beyond the pool, train cycles through it; test refuses.
    assert len(ta.make_problems(len(train) + 5, 0, ops=("+", "-"))) == len(train) + 5
    with pytest.raises(ValueError, match="held-out"):
        ta.make_problems(10_000, 0, split="test")


def test_format_sft_example_marks_answer_and_eos(tokenizer):
    ex = ta.format_sft_example({"prompt": "Q: 23+45=? A:", "answer": "68"}, tokenizer)
    assert ex["text"] == "Q: 23+45=? A: 68"
    assert len(ex["input_ids"]) == len(ex["token_mask"])
    assert ex["input_ids"][-1] == tokenizer.eos_token_id
    answer = [i for i, m in zip(ex["input_ids"], ex["token_mask"], strict=True) if m]
    prompt = [i for i, m in zip(ex["input_ids"], ex["token_mask"], strict=True) if not m]
    assert tokenizer.decode(answer) == " 68<eos>"
    assert tokenizer.decode(prompt) == "Q: 23+45=? A:"
    # Token-wise concatenation equals tokenizing the whole line (no merge across the seam).
    whole = tokenizer(ex["text"], add_special_tokens=False)["input_ids"]
    assert ex["input_ids"][:-1] == whole


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 68", "68"),
        (" 68<eos>", "68"),
        ("68 and more", "68"),
        (" -7", "-7"),
        (" 007", "7"),
        (" sixty", None),
        ("", None),
        ("x 68", None),
    ],
)
def test_parse_answer(completion, expected):
    assert ta.parse_answer(completion) == expected


def test_build_untrained_round_trip(tmp_path, tokenizer):
    out = ta.build_untrained(tmp_path / "ta", seed=0)
    tok = load_tokenizer(out)
    model = load_causal_lm(out)
    n_params = sum(p.numel() for p in model.parameters())
    assert 400_000 < n_params < 700_000
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 64 and cfg.head_dim == 64
    assert cfg.vocab_size == len(tok) and not model.training
    assert tok.chat_template == ta.CHAT_TEMPLATE
    text = "Q: 23+45=? A: 68"
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    # Same seed, same weights; another seed, other weights.
    again = load_causal_lm(ta.build_untrained(tmp_path / "ta2", seed=0))
    other = load_causal_lm(ta.build_untrained(tmp_path / "ta3", seed=1))
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[w], again.state_dict()[w])
    assert not torch.equal(model.state_dict()[w], other.state_dict()[w])


def _reference_accuracy(model, tokenizer, problems) -> float:
    """Independent check: HF generate per problem, no padding, first integer vs answer."""
    correct = 0
    for p in problems:
        ids = tokenizer(p["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        correct += ta.parse_answer(text) == p["answer"]
    return correct / len(problems)


def test_greedy_accuracy_on_a_model_that_memorised_some_problems(tokenizer):
    """A few hundred AdamW steps make the tiny model memorise 8 problems; greedy_accuracy must
    score them high, score the same prompts with wrong answers at 0, and agree with HF generate."""
    torch.manual_seed(0)
    model = ta.LlamaForCausalLM(ta.tiny_arith_config(tokenizer))
    problems = ta.make_problems(8, seed=5)
    examples = [ta.format_sft_example(p, tokenizer) for p in problems]
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((8, width), tokenizer.pad_token_id)
    mask = torch.zeros((8, width))
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, : len(e["token_mask"])] = torch.tensor(e["token_mask"], dtype=torch.float)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(80):
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )
        loss = (nll * mask[:, 1:]).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    acc = ta.greedy_accuracy(model, tokenizer, problems, batch_size=3)
    assert acc >= 0.75, f"memorised accuracy {acc} (loss {loss.item():.3f})"
    assert acc == _reference_accuracy(model, tokenizer, problems)
    wrong = [{**p, "answer": str(int(p["answer"]) + 1)} for p in problems]
    assert ta.greedy_accuracy(model, tokenizer, wrong) <= 1 - acc
