"""Chat-template tokenisation, assistant-only loss masks, SFT collation, resumable loader."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from tempering.data.collate import collate_sft
from tempering.data.dataloader import StatefulDataLoader
from tempering.data.processing import (
    ChatTemplateError,
    TextMemo,
    tokenize_message_log,
    tokenize_message_logs,
)
from tempering.models.hf import text_encoder

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, how are you today?",
    "the answer is 42 and the question is unknown",
    "system user assistant: you are a helpful model",
    "Q: 23+45=? A: 68",
]


def make_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE (ChatML special tokens) trained on a few sentences."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


CONVERSATION = [
    {"role": "system", "content": "you are a helpful model"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "how are you today?"},
    {"role": "user", "content": "the question is unknown"},
    {"role": "assistant", "content": "the answer is 42"},
]


def masked_text(tokenizer, example) -> str:
    ids = [i for i, m in zip(example["input_ids"], example["token_mask"], strict=True) if m]
    return tokenizer.decode(ids)


def test_mask_covers_exactly_assistant_content_and_end_of_turn(tokenizer):
    example = tokenize_message_log(CONVERSATION, tokenizer, max_seq_len=512)
    # Loss tokens are the assistant contents plus the template's "<|im_end|>\n" after each.
    assert masked_text(tokenizer, example) == (
        "how are you today?<|im_end|>\nthe answer is 42<|im_end|>\n"
    )
    # Everything else (system, user, and the "<|im_start|>assistant\n" headers) is prompt.
    unmasked = [
        i for i, m in zip(example["input_ids"], example["token_mask"], strict=True) if not m
    ]
    text = tokenizer.decode(unmasked)
    assert "<|im_start|>assistant\n<|im_start|>user" in text
    assert "how are" not in text and "42" not in text


def test_pieces_concatenate_to_full_templated_tokenization(tokenizer):
    example = tokenize_message_log(CONVERSATION, tokenizer, max_seq_len=512)
    whole = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert example["input_ids"] == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert not example["truncated"]


def test_generation_prompt_is_appended_without_loss(tokenizer):
    prompt = CONVERSATION[:2]
    example = tokenize_message_log(prompt, tokenizer, 512, add_generation_prompt=True)
    expected = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(example["input_ids"]) == expected
    assert sum(example["token_mask"]) == 0


TEXTS = ["", "hello world", " 68", "<|im_start|>user\nQ: 23+45=? A:<|im_end|>\n", "héllo  \t?!"]


def test_text_encoder_equals_the_tokenizer_call_and_falls_back_where_it_must():
    tok = make_tokenizer()
    expected = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    direct = text_encoder(tok)  # the Rust tokenizer itself
    assert [direct(t) for t in TEXTS] == expected
    # a backend with truncation set: the wrapper lifts it per call, so the encoder must wrap
    tok.backend_tokenizer.enable_truncation(max_length=2)
    assert len(direct(TEXTS[3])) == 2  # the direct path is cut here
    assert [text_encoder(tok)(t) for t in TEXTS] == expected
    # with special tokens: a post-processor that adds a BOS, as Llama-style tokenizers do
    tok = make_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A",
        special_tokens=[("<|im_start|>", tok.convert_tokens_to_ids("<|im_start|>"))],
    )
    with_bos = [list(tok(t)["input_ids"]) for t in TEXTS]
    assert all(ids[:1] == [tok.convert_tokens_to_ids("<|im_start|>")] for ids in with_bos)
    assert [text_encoder(tok, special_tokens=True)(t) for t in TEXTS] == with_bos


def test_a_batch_memo_shares_renders_and_pieces_without_changing_tokens(tokenizer):
    prompt = CONVERSATION[:2]
    rows = [prompt + [CONVERSATION[2]], prompt + [CONVERSATION[4]]]
    memo = TextMemo(tokenizer)
    shared = [tokenize_message_log(r, tokenizer, 64, loss_from_message=2, memo=memo) for r in rows]
    alone = [tokenize_message_log(r, tokenizer, 64, loss_from_message=2) for r in rows]
    assert shared == alone
    assert memo.encode("hello world") is memo.encode("hello world")
    # the prompt's render (system + user + generation prompt) happened once, then one whole
    # render per row: 3, against 4 apart
    assert len(memo._renders) == 1 + 2


def test_truncation_is_flagged_and_counted(tokenizer):
    full = tokenize_message_log(CONVERSATION, tokenizer, 512)
    cut = tokenize_message_log(CONVERSATION, tokenizer, 10)
    assert cut["truncated"] and len(cut["input_ids"]) == 10
    assert cut["input_ids"] == full["input_ids"][:10]
    examples, num_truncated = tokenize_message_logs([CONVERSATION, CONVERSATION[:3]], tokenizer, 30)
    assert len(full["input_ids"]) > 30
    assert num_truncated == sum(
        len(tokenize_message_log(log, tokenizer, 512)["input_ids"]) > 30
        for log in [CONVERSATION, CONVERSATION[:3]]
    )
    assert num_truncated >= 1 and [e["truncated"] for e in examples][0]


def test_truncation_that_leaves_no_response_token_is_said(tokenizer, caplog):
    """An example whose prompt fills the budget trains on nothing; the warning counted it only
    as truncated."""
    import logging

    budget = next(i for i, m in enumerate(tokenize_message_log(CONVERSATION, tokenizer, 512)
                                          ["token_mask"]) if m)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        examples, _ = tokenize_message_logs([CONVERSATION], tokenizer, budget)
    assert not any(examples[0]["token_mask"])
    assert "(1 of them kept no response token to train on" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tokenize_message_logs([CONVERSATION], tokenizer, budget + 1)
    assert "(0 of them kept no response token" in caplog.text


def test_template_that_rewrites_history_is_rejected():
    # Renders the message count up front, so earlier turns change when a message is added.
    bad = "[{{ messages|length }}]" + CHATML
    with pytest.raises(ChatTemplateError, match="renders earlier turns unchanged"):
        tokenize_message_log(CONVERSATION, make_tokenizer(bad), 512)


def test_tokens_merging_across_messages_are_rejected():
    # No special tokens between turns: "hel" + "lo world" tokenizes differently from "hello world".
    bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    log = [{"role": "user", "content": "hel"}, {"role": "assistant", "content": "lo world"}]
    with pytest.raises(ChatTemplateError, match="merge across message boundaries"):
        tokenize_message_log(log, make_tokenizer(bare), 512)


def test_plain_concatenation_without_chat_template():
    tok = make_tokenizer(chat_template=None)
    log = [{"role": "user", "content": "Q: 23+45=? A:"}, {"role": "assistant", "content": " 68"}]
    example = tokenize_message_log(log, tok, 64)
    prompt_ids = tok("Q: 23+45=? A:", add_special_tokens=False)["input_ids"]
    answer_ids = tok(" 68", add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == prompt_ids + answer_ids + [tok.eos_token_id]
    assert example["token_mask"] == [0] * len(prompt_ids) + [1] * (len(answer_ids) + 1)


def test_collate_sft_right_pads_and_masks(tokenizer):
    long = tokenize_message_log(CONVERSATION, tokenizer, 512)
    short = tokenize_message_log(CONVERSATION[1:3], tokenizer, 512)
    prompt_only = tokenize_message_log(CONVERSATION[:2], tokenizer, 512)
    batch = collate_sft([long, short, prompt_only], pad_token_id=tokenizer.pad_token_id)
    lengths = [len(e["input_ids"]) for e in (long, short, prompt_only)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["input_lengths"].tolist() == lengths
    n = lengths[1]
    assert batch["input_ids"][1, :n].tolist() == short["input_ids"]
    assert (batch["input_ids"][1, n:] == tokenizer.pad_token_id).all()
    assert batch["token_mask"][1, :n].tolist() == short["token_mask"]
    assert batch["token_mask"][1, n:].sum() == 0
    # An example with no assistant token contributes nothing.
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0]
    assert batch.size == 3


@pytest.mark.parametrize("prefetch", [False, True])
def test_loader_resumes_exactly_across_epochs(prefetch):
    data = list(range(10))
    reference = StatefulDataLoader(data, batch_size=3, seed=7)
    expected = [reference.next_batch() for _ in range(8)]  # crosses two epoch boundaries

    first = StatefulDataLoader(data, batch_size=3, seed=7, prefetch=prefetch)
    got = [first.next_batch() for _ in range(4)]
    state = first.state_dict()
    resumed = StatefulDataLoader(data, batch_size=3, seed=0, prefetch=prefetch)  # seed: state's
    resumed.next_batch()  # a batch (and a prefetch) for the seed-0 order, then the state wins
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(4)]
    assert got == expected
    assert state == {"epoch": 1, "position": 3, "seed": 7}


def test_loader_epochs_cover_data_once_and_reshuffle():
    loader = StatefulDataLoader(list(range(12)), batch_size=4, seed=3)
    epoch0 = [x for batch in loader for x in batch]
    epoch1 = [x for batch in loader for x in batch]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1
    assert len(loader) == 3
    ordered = StatefulDataLoader(list(range(5)), 2, shuffle=False, drop_last=False)
    assert list(ordered) == [[0, 1], [2, 3], [4]]


def test_loader_prefetches_the_next_batch_in_the_background():
    """With prefetch, every batch after the first is collated off the caller's thread before
    it is asked for, never two at once, and a collate error surfaces with its own batch."""
    import threading

    calls: list[tuple[list[int], bool]] = []
    running = threading.Lock()

    def collate(batch: list[int]) -> list[int]:
        assert running.acquire(blocking=False), "collate_fn ran twice at once"
        try:
            calls.append((batch, threading.current_thread() is threading.main_thread()))
            if 99 in batch:
                raise ValueError("row 99 is malformed")
            return batch
        finally:
            running.release()

    data = list(range(9)) + [99, 10, 11]
    loader = StatefulDataLoader(data, 3, shuffle=False, collate_fn=collate, prefetch=True)
    assert loader.next_batch() == [0, 1, 2]
    assert loader.next_batch() == [3, 4, 5]
    assert loader.next_batch() == [6, 7, 8]
    with pytest.raises(ValueError, match="row 99"):
        loader.next_batch()
    assert [on_main for _, on_main in calls[:4]] == [True, False, False, False]
    assert [b for b, _ in calls[:4]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [99, 10, 11]]


def test_a_prefetching_loader_shortens_the_gil_switch_interval():
    """The prefetch thread holds the GIL while it tokenizes; at Python's default 5 ms switch
    interval each hand-over delayed the main thread's train call by up to 5 ms (see
    PREFETCH_SWITCH_INTERVAL_S). A loader without prefetch leaves the interval alone."""
    import sys

    from tempering.data.dataloader import PREFETCH_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        StatefulDataLoader(list(range(4)), 2)
        assert sys.getswitchinterval() == 0.005
        StatefulDataLoader(list(range(4)), 2, prefetch=True)
        assert sys.getswitchinterval() == pytest.approx(PREFETCH_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)


def test_loader_collates_and_rejects_bad_state(tokenizer):
    examples = [tokenize_message_log(CONVERSATION[1:3], tokenizer, 64)] * 4
    loader = StatefulDataLoader(
        examples, 2, collate_fn=lambda b: collate_sft(b, tokenizer.pad_token_id)
    )
    assert loader.next_batch()["input_ids"].shape[0] == 2
    with pytest.raises(ValueError, match="position=99"):
        loader.load_state_dict({"epoch": 0, "position": 99, "seed": 0})
    with pytest.raises(ValueError, match="has 2 examples, fewer than the 3 one step takes"):
        StatefulDataLoader([1, 2], batch_size=3)


def test_masks_are_float_for_losses(tokenizer):
    batch = collate_sft([tokenize_message_log(CONVERSATION, tokenizer, 64)], 1)
    assert batch["token_mask"].dtype == torch.float32
    assert batch["input_ids"].dtype == torch.long
