"""Chunked logits (`tempering/logits.py`): `HiddenLogits` gives the losses what whole logits
give them -- the log-probs, their gradients (frozen and trained output projection), the
entropy, the top-k -- without a ``[B, S, V]`` tensor, and the policy worker uses it where it
costs nothing (and where asked) with the same training step as whole logits."""

from __future__ import annotations

import dataclasses

import pytest
import test_lora
import torch
import torch.nn.functional as F
from test_lora import LORA, _batch

from tempering.logits import HiddenLogits
from tempering.losses import (
    ClippedPGLoss,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_logprobs,
)
from tests.tiny_models import save_tiny_llama

B, S, H, V = 3, 7, 16, 50
lone_rank = test_lora.lone_rank  # the fixture: a worker built in this process


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    ids = torch.randint(0, V, (B, S), generator=g)
    return hidden, weight, ids


@pytest.mark.parametrize("train_weight", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_whole_logits(train_weight, temperature) -> None:
    hidden, weight, ids = _inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    upstream = torch.randn(B, S)  # a loss's gradient on each log-prob
    want = token_logprobs(F.linear(h1, w1).float() / temperature, ids)
    (want * upstream).sum().backward()
    # 4 rows per chunk: 21 rows make 6 chunks, the last one short
    got = token_logprobs(HiddenLogits(h2, w2, chunk_rows=4) / temperature, ids)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    assert h2.grad.abs().max() > 1e-2  # a gradient that says something
    if train_weight:
        torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-5)
    else:
        assert w2.grad is None


@pytest.mark.parametrize("fused", [True, False], ids=["chunked", "materialised-rows"])
def test_only_the_masked_rows_are_projected(fused, monkeypatch) -> None:
    """With a mask, the log-probs and the gradients of the hidden states and a trained
    projection equal whole logits' read at the mask, and the projection sees only the rows the
    mask reads (row t scores token t + 1): a prompt and padding cost it nothing."""
    import tempering.logits as logits_module

    hidden, weight, ids = _inputs()
    mask = torch.zeros(B, S)
    mask[0, 2:] = 1  # an answer after a two-token prompt
    mask[1, 4:6] = 1
    mask[2, 1] = 1  # row 2: one token, the rest unread
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    upstream = torch.randn(B, S)
    want = token_logprobs(F.linear(h1, w1).float(), ids) * mask
    (want * upstream).sum().backward()
    projected: list[int] = []
    real = logits_module._logits

    def counting(h, w, t):
        projected.append(h.shape[0])
        return real(h, w, t)

    monkeypatch.setattr(logits_module, "_logits", counting)
    chunked = HiddenLogits(h2, w2, chunk_rows=4, fused=fused)
    got = token_logprobs(chunked, ids, mask)
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-5)
    assert h2.grad[2, 2:].abs().max() == 0 and h2.grad[0, 1:-1].abs().min() > 0
    # forward: 5 + 2 + 1 rows; the fused backward recomputes the same 8 once more
    assert sum(projected) == int(mask.sum()) * (2 if fused else 1)
    # the entropy the training pass left covers the mask; a wider one is computed anew
    whole = F.linear(hidden, weight)
    torch.testing.assert_close(
        token_entropy(chunked, mask), token_entropy(whole, mask), atol=1e-5, rtol=0
    )
    wider = torch.ones(B, S)
    torch.testing.assert_close(
        token_entropy(chunked, wider), token_entropy(whole, wider), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("head", ["frozen", "trained-fused", "trained-rows", "whole-tensor"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_differentiated_entropy_equals_autograd_through_whole_logits(head, temperature) -> None:
    """An entropy bonus's gradient: the log-probs' and the entropy's together, at a mask, equal
    autograd through whole logits' log-softmax -- for each way the policy hands a loss its
    logits -- and the log-probs alone are unchanged by asking for the entropy."""
    hidden, weight, ids = _inputs()
    mask = (torch.arange(S)[None] < torch.tensor([[7], [3], [5]])).float()
    mask[:, 0] = 0
    train_weight = head != "frozen"
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    up_lp, up_ent = torch.randn(B, S), torch.randn(B, S)
    z = F.linear(h1, w1).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    want_lp = F.pad(logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0)) * mask
    want_ent = F.pad(-(logp.exp() * logp).sum(-1)[:, :-1], (1, 0)) * mask
    ((want_lp * up_lp).sum() + (want_ent * up_ent).sum()).backward()
    if head == "whole-tensor":
        logits = F.linear(h2, w2).float() / temperature
    else:
        logits = HiddenLogits(h2, w2, chunk_rows=4, fused=head != "trained-rows") / temperature
    got_lp, got_ent = token_logprobs_and_entropy(logits, ids, mask)
    ((got_lp * up_lp).sum() + (got_ent * up_ent).sum()).backward()
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
    if train_weight:
        torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # asked for outside training (an evaluation pass): still computed
        _, no_grad_ent = token_logprobs_and_entropy(logits, ids, mask)
    torch.testing.assert_close(no_grad_ent, want_ent.detach(), atol=1e-5, rtol=0)
    # the entropy's own share of the gradient is there (not the log-probs' alone)
    h3 = hidden.clone().requires_grad_()
    lp_only = token_logprobs(F.linear(h3, weight).float() / temperature, ids, mask)
    (lp_only * up_lp).sum().backward()
    assert (h3.grad - h1.grad).abs().max() > 1e-2


def test_bf16_hidden_states_follow_the_bf16_model_path() -> None:
    """A bf16 model computes its projection in bf16 and the log-probs in fp32: the chunks do
    the same, so they agree to fp32 rounding, not bf16's."""
    hidden, weight, ids = _inputs(torch.bfloat16)
    want = token_logprobs(F.linear(hidden, weight).float(), ids)
    got = token_logprobs(HiddenLogits(hidden, weight, chunk_rows=5), ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_entropy_and_topk_equal_whole_logits() -> None:
    hidden, weight, ids = _inputs()
    whole = F.linear(hidden, weight)
    mask = (torch.arange(S)[None] < torch.tensor([[7], [3], [5]])).float()
    want = token_entropy(whole, mask)
    # without a training pass: computed chunk by chunk on demand
    torch.testing.assert_close(
        token_entropy(HiddenLogits(hidden, weight, 4), mask), want, atol=1e-5, rtol=0
    )
    # after a training pass (what a loss's entropy metric reads): no second pass, same values
    chunked = HiddenLogits(hidden.clone().requires_grad_(), weight, 4)
    token_logprobs(chunked, ids)
    assert chunked.entropy is not None
    torch.testing.assert_close(token_entropy(chunked, mask), want, atol=1e-5, rtol=0)
    values, indices = topk_logprobs(HiddenLogits(hidden, weight, 4) / 0.5, 5)
    want_v, want_i = topk_logprobs(whole / 0.5, 5)
    torch.testing.assert_close(values, want_v, atol=1e-5, rtol=0)
    assert torch.equal(indices, want_i)


def _grpo_batch(seed: int, rows: int = 8) -> dict:
    batch = _batch(seed, rows)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(rows, generator=g)
    batch["generation_logprobs"] = -torch.rand(batch["input_ids"].shape, generator=g)
    batch["token_mask"][:, :3] = 0  # a prompt: its positions are not the loss's
    return batch


WORKERS = {
    "lora-frozen-head": {"lora": LORA},  # chunked by default: its head is frozen
    "full-fused-head": {"logprob_chunk_size": 4, "init_reference_model": True},
    "full-needed-rows": {"init_reference_model": True},  # the default: only the loss's rows
}


@pytest.mark.parametrize("kind", list(WORKERS))
def test_worker_steps_equal_with_and_without_chunks(kind, lone_rank, tmp_path) -> None:
    """Two GRPO steps (KL to the reference, an entropy bonus) of a worker whose loss computes
    only the logits it reads (LoRA's frozen head and logprob_chunk_size=4: chunk by chunk;
    full fine-tuning by default: the masked rows under autograd) equal a worker's that
    materialises every position's logits, in losses, metrics and the weights it ends with."""
    path = _tiny_model(tmp_path)
    extra = WORKERS[kind]
    results = []
    for chunked in (True, False):
        worker = lone_rank(path, **extra)
        fp = worker.forward_pass
        assert fp.chunk_rows is not None
        if not chunked:  # the same worker, logits whole everywhere
            # (the same layouts: shared prefixes, padding-free, attention over rows)
            worker.forward_pass = dataclasses.replace(fp, chunk_rows=None, fuse_trained_head=False)
        loss = ClippedPGLoss(reference_policy_kl_penalty=0.1, entropy_coeff=0.05)
        steps = []
        for seed in (0, 1):
            batch = _grpo_batch(seed)
            batch["prev_logprobs"] = worker.get_logprobs(batch)["logprobs"]
            ref = worker.get_reference_policy_logprobs(batch)["reference_policy_logprobs"]
            batch["reference_policy_logprobs"] = ref
            steps.append(worker.train(batch, loss))
        results.append((steps, worker.refit.state_dict()))
    (chunked_steps, chunked_w), (whole_steps, whole_w) = results
    for a, b in zip(chunked_steps, whole_steps, strict=True):
        for key in ("loss", "entropy", "kl_penalty", "entropy_bonus", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # AdamW at lr 2e-2 moves a weight up to ~4e-2 in two steps, and turns a near-zero
    # gradient's float rounding into a sizeable step (m / sqrt(v)): 5e-5 is 800x tighter than
    # what a wrong chunk would show
    for name, tensor in whole_w.items():
        torch.testing.assert_close(chunked_w[name], tensor, atol=5e-5, rtol=0)
    initial = torch.load(f"{path}/initial.pt")
    moved = sum(int((whole_w[n] - t).abs().max() > 1e-4) for n, t in initial.items())
    assert moved > 0  # the steps changed the weights


def test_the_entropy_bonus_holds_the_entropy_up(lone_rank, tmp_path) -> None:
    """Policy-gradient steps that reward a fixed set of answers sharpen the policy: held-out
    entropy falls. With `loss_fn.entropy_coeff` (1.0 against advantages of 1) the same steps
    leave it higher."""
    path = _tiny_model(tmp_path)
    held_out = _grpo_batch(7, rows=16)
    ends = {}
    for coeff in (0.0, 1.0):
        worker = lone_rank(path, logprob_chunk_size=4)  # the fused trained head
        loss = ClippedPGLoss(entropy_coeff=coeff)
        start = worker.train(held_out, loss, eval_mode=True)["entropy"]
        for step in range(15):
            batch = _grpo_batch(step % 3)
            batch["advantages"] = torch.ones(8)
            worker.train(batch, loss)
        ends[coeff] = worker.train(held_out, loss, eval_mode=True)["entropy"]
    # measured: 4.58 at the start, 3.73 after the steps, 4.27 with the bonus
    assert ends[0.0] < start - 0.5, (start, ends)
    assert ends[1.0] > ends[0.0] + 0.3, (start, ends)


def _tiny_model(tmp_path) -> str:
    """A tied output projection (the trained-head case trains the embedding through it)."""
    model = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    torch.save(model.state_dict(), tmp_path / "initial.pt")
    return str(tmp_path)


def test_a_chunk_size_where_no_logits_are_chunked_fails_naming_the_key(lone_rank, tmp_path):
    path = _tiny_model(tmp_path)
    with pytest.raises(ValueError, match="policy.logprob_chunk_size=4 applies to a causal LM"):
        lone_rank(path, head="score", pad_token_id=0, logprob_chunk_size=4)
    # a reward model keeps its scores whole, and says nothing when not asked to chunk
    assert lone_rank(path, head="score", pad_token_id=0).forward_pass.chunk_rows is None
