"""A generation backend that replays fixed completions as token ids: a stand-in for a model
that emits tool calls or known answers, which none we can build offline does reliably. Tests
that use it say so; everything around it (server, parsing, splicing, Gym) is real."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict


class ScriptedBackend:
    """Replies are taken in order from a list, or chosen by `replies(prompt_text)`; each reply
    is encoded and followed by EOS. The t-th generated token's log-prob is -0.01 * (t + 1), so
    tests can follow the sampler's log-probs through."""

    def __init__(self, tokenizer, replies: list[str] | Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.replies = replies if callable(replies) else list(replies)

    def _reply(self, prompt_ids: list[int]) -> list[int]:
        if callable(self.replies):
            text = self.replies(self.tokenizer.decode(prompt_ids))
        else:
            text = self.replies.pop(0)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id
        ]

    def generate(self, data, greedy=False, sampling=None):
        B, S = data["input_ids"].shape
        lengths = data["input_lengths"].tolist()
        replies = [self._reply(data["input_ids"][b, : lengths[b]].tolist()) for b in range(B)]
        T = max(len(r) for r in replies)
        out = torch.zeros((B, S + T), dtype=torch.long)
        logprobs = torch.zeros((B, S + T), dtype=torch.float32)
        for b, (L, reply) in enumerate(zip(lengths, replies, strict=True)):
            out[b, :L] = data["input_ids"][b, :L]
            out[b, L : L + len(reply)] = torch.tensor(reply)
            logprobs[b, L : L + len(reply)] = -0.01 * torch.arange(1, len(reply) + 1)
        gen = torch.tensor([len(r) for r in replies])
        return BatchedDataDict(
            output_ids=out,
            logprobs=logprobs,
            generation_lengths=gen,
            unpadded_sequence_lengths=torch.tensor(lengths) + gen,
            finish_reasons=["stop"] * B,
        )
