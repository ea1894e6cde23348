"""Shared-prefix forwards (tempering/models/policy/shared_prefix.py): rows that start alike
run their prefix once, and every row's logits, log-probs and gradients equal those of the rows
computed whole, under a tree mask or attending over rows; the cost model keeps rows apart where
sharing would not pay and picks the cheaper attention; DPO's reference
log-probs computed inside the train call equal the separate call's, and GRPO's, at the
sampling temperature, equal the separate call's at that temperature.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.losses import ClippedPGLoss, NLLLoss
from tempering.models.policy import packed_attention
from tempering.models.policy.microbatching import ForwardPass
from tempering.models.policy.packed_attention import use_packed_sdpa
from tempering.models.policy.shared_prefix import attention_cost_ratio, plan_shared_prefix
from tempering.preference_losses import DPOLoss
from tests import tiny_models

VOCAB = 100


def tiny_llama() -> LlamaForCausalLM:
    return tiny_models.tiny_llama(max_position_embeddings=64, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return str(path)


def grouped_rows(seed: int = 0) -> BatchedDataDict:
    """GRPO-like rows: 3 prompts (lengths 9, 6, 11) x 4 continuations each (lengths 1-7), two
    of them identical, one continuation empty past the prompt's last token; shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    for prompt_len, tails in ((9, [3, 7, 3, 1]), (6, [5, 2, 6, 4]), (11, [2, 2, 7, 5])):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g).tolist()
        same = torch.randint(1, VOCAB, (max(tails),), generator=g).tolist()
        for k, n in enumerate(tails):
            tail = same[:n] if k in (0, 2) else torch.randint(1, VOCAB, (n,), generator=g).tolist()
            rows.append(prompt + tail)
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    token_mask = (torch.arange(width)[None] < lengths[:, None]).float()
    token_mask[:, :5] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask,
        sample_mask=torch.ones(len(rows)),
    )  # fmt: skip


def plain_logits(model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
    ids, lengths = data["input_ids"], data["input_lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    return model(input_ids=ids, attention_mask=mask).logits


def ratio_of(model: torch.nn.Module) -> float:
    return attention_cost_ratio(model.config, sum(p.numel() for p in model.parameters()))


def test_shared_prefix_logits_equal_each_row_computed_whole() -> None:
    model = tiny_llama()
    data = grouped_rows()
    plan = plan_shared_prefix(data["input_ids"], data["input_lengths"], ratio_of(model))
    assert plan is not None
    # every distinct prefix (trie node) runs once: each prompt once, a duplicate row not at all
    rows = [r[:n].tolist() for r, n in zip(data["input_ids"], data["input_lengths"], strict=True)]
    distinct = {tuple(r[: t + 1]) for r in rows for t in range(len(r))}
    assert plan.tokens == len(distinct) < int(data["input_lengths"].sum()) / 2
    with torch.no_grad():
        want, got = plain_logits(model, data), plan.forward(model)
    valid = torch.arange(want.shape[1])[None] < data["input_lengths"][:, None]
    assert got.shape == want.shape
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def test_gradients_through_shared_prefix_equal_whole_rows() -> None:
    data = grouped_rows(seed=1)
    grads = []
    for shared in (False, True):
        model = tiny_llama().train()
        if shared:
            plan = plan_shared_prefix(data["input_ids"], data["input_lengths"], ratio_of(model))
            logits = plan.forward(model)
        else:
            logits = plain_logits(model, data)
        loss, _ = NLLLoss()(logits, data, data["token_mask"].sum(), torch.tensor(12.0))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert max(g.abs().max() for g in grads[0].values()) > 1e-3  # not a vacuous comparison
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4)


def test_rows_stay_apart_when_sharing_does_not_pay() -> None:
    ratio = ratio_of(tiny_llama())
    g = torch.Generator().manual_seed(2)
    distinct = torch.randint(1, VOCAB, (6, 12), generator=g)
    assert plan_shared_prefix(distinct, torch.full((6,), 12), ratio) is None
    # a 2-token common start under 40-token continuations: attention over the merged row
    # costs more than the 2 tokens it saves (a high attention ratio, as in a long-context model)
    long_tails = torch.randint(1, VOCAB, (4, 42), generator=g)
    long_tails[:, :2] = 7
    assert plan_shared_prefix(long_tails, torch.full((4,), 42), ratio=0.02) is None
    # the same rows with a 30-token common start do share
    long_tails[:, :30] = long_tails[0, :30]
    plan = plan_shared_prefix(long_tails, torch.full((4,), 42), ratio=0.02)
    assert plan is not None and plan.tokens == 30 + 4 * 12  # random tails share nothing
    # two of four 40-token rows share 10 tokens: the merged group (70) sets the packed width,
    # 3 rows x 70 positions > 4 x 40 padded ones, so the plan is dropped
    sft_like = torch.randint(1, VOCAB, (4, 40), generator=g)
    sft_like[1, :10] = sft_like[0, :10]
    assert plan_shared_prefix(sft_like, torch.full((4,), 40), ratio=1e-4) is None


def sft_rows(seed: int = 0, rows: int = 8) -> BatchedDataDict:
    """SFT-like rows: a 2-token common start (a chat template's), random tails of 8-14 tokens,
    two rows sharing 6 tokens: as one tree-masked group they would attend densely over ~90
    positions; as rows, over their own ~14."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 17, (rows,), generator=g)
    ids = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
    ids[:, :2] = torch.tensor([5, 6])
    ids[1, :6] = ids[0, :6]
    token_mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).float()
    token_mask[:, :4] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(rows)
    )


def sliding_mistral() -> MistralForCausalLM:
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=5, attn_implementation="sdpa",
    )  # fmt: skip
    return MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("short_rows", [64, 0], ids=["matmul-attention", "sdpa-kernel"])
@pytest.mark.parametrize("per_sequence", [None, 0.0], ids=["padded-rows", "row-by-row"])
@pytest.mark.parametrize("make_model", [tiny_llama, sliding_mistral])
def test_attention_over_rows_equals_each_row_computed_whole(
    make_model, per_sequence, short_rows, monkeypatch
) -> None:
    """A plan over rows (many short rows under a 2-token start) computes each shared token's
    matmuls once and gives every row's logits and gradients as if computed alone -- also with
    grouped-query heads and a sliding window (5) narrower than the rows; its rows attend
    padded in one call, or (an attention call costing nothing more) one call each; short rows
    by two matmuls, longer ones by torch's SDPA kernel (`packed_attention.SHORT_ROWS`)."""
    monkeypatch.setattr(packed_attention, "SHORT_ROWS", short_rows)
    data = sft_rows()
    grads, logits = [], []
    for shared in (False, True):
        model = make_model().train()
        if shared:
            assert use_packed_sdpa(model)
            ratio = ratio_of(model)
            plan = plan_shared_prefix(
                data["input_ids"], data["input_lengths"], ratio, 0, True, per_sequence
            )
            assert plan is not None and plan.over_rows is not None and plan.mask is None
            assert (plan.over_rows.bounds is None) == (per_sequence is None)
            # rows share only their start: a tree mask would cost more than the padded rows
            assert plan_shared_prefix(data["input_ids"], data["input_lengths"], ratio) is None
            assert plan.tokens == int(data["input_lengths"].sum()) - 7 * 2 - 4
            out = plan.forward(model)
        else:
            out = plain_logits(model, data)
        loss, _ = NLLLoss()(out, data, data["token_mask"].sum(), torch.tensor(8.0))
        loss.backward()
        logits.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    valid = torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]
    torch.testing.assert_close(logits[1][valid], logits[0][valid], atol=1e-5, rtol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("short_rows", [64, 0], ids=["matmul-attention", "sdpa-kernel"])
def test_padding_free_rows_keep_a_sliding_window(short_rows, monkeypatch) -> None:
    """A padding-free micro-batch (its rows packed into one, one attention call each) of a
    model with a sliding window (5) narrower than its rows gives every row's logits as if
    computed alone (until 2026-11-28 the window was dropped there)."""
    from tempering.distributed.batched_data_dict import pack_in_order

    monkeypatch.setattr(packed_attention, "SHORT_ROWS", short_rows)

    model = sliding_mistral()
    data = sft_rows()
    with torch.no_grad():
        want = plain_logits(model, data)
        assert use_packed_sdpa(model)
        fp = ForwardPass("causal_lm", torch.device("cpu"), None, 0)
        got = fp.logits(model, data, pack_in_order(data))
    valid = torch.arange(want.shape[1])[None] < data["input_lengths"][:, None]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def test_the_cheaper_attention_wins_and_a_model_without_it_is_refused() -> None:
    """GRPO-like rows (long prompts, short answers) keep the tree mask even where attending
    over rows is possible; SFT-like rows attend over rows; a plan over rows given to a model
    whose attention would ignore it is an error, not wrong logits."""
    model = tiny_llama()
    ratio = ratio_of(model)
    grpo = grouped_rows()
    tree = plan_shared_prefix(grpo["input_ids"], grpo["input_lengths"], ratio, 0, True)
    assert tree is not None and tree.over_rows is None
    sft = sft_rows()
    over = plan_shared_prefix(sft["input_ids"], sft["input_lengths"], ratio, 0, True)
    assert over is not None and over.over_rows is not None
    fp = ForwardPass("causal_lm", torch.device("cpu"), ratio, 0, over_rows=True)
    with pytest.raises(ValueError, match="attends over rows.*'sdpa'"):
        fp.logits(model, sft, over)


def test_worker_shared_prefix_matches_whole_rows_and_counts_tokens(make_worker) -> None:
    data = grouped_rows(seed=3)
    runs = {}
    for shared in (False, True):
        worker = make_worker(shared_prefix=shared, optimizer="sgd", learning_rate=1.0)
        logprobs = worker.get_logprobs(data, micro_batch_size=6)["logprobs"]
        metrics = worker.train(data, NLLLoss(), global_batch_size=12, micro_batch_size=6)
        runs[shared] = (logprobs, metrics, worker.refit.state_dict())
    (lp0, m0, p0), (lp1, m1, p1) = runs[False], runs[True]
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    assert m1["loss"] == pytest.approx(m0["loss"], abs=1e-6)
    for name, value in p0.items():
        torch.testing.assert_close(p1[name], value, atol=1e-5, rtol=0)
    assert m0["num_computed_tokens"] == m0["num_tokens"] == float(data["input_lengths"].sum())
    assert m1["num_computed_tokens"] < 0.7 * m1["num_tokens"]


def test_dpo_reference_inside_the_train_call_equals_the_separate_call(make_worker) -> None:
    data = grouped_rows(seed=4)  # rows 2i / 2i+1 as chosen / rejected pairs
    loss_fn = DPOLoss(0.1)
    worker = make_worker(init_reference_model=True, init_optimizer=True, learning_rate=0.0)
    separate = dict(data)
    separate["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(data)[
        "reference_policy_logprobs"
    ]
    with torch.no_grad():  # move the policy away from its reference
        for p in worker.state.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    two_calls = worker.train(
        BatchedDataDict(separate), loss_fn, global_batch_size=12, micro_batch_size=4,
        eval_mode=True,
    )  # fmt: skip
    one_call = worker.train(
        data, loss_fn, global_batch_size=12, micro_batch_size=4, eval_mode=True,
        with_reference=True,
    )  # fmt: skip
    assert abs(two_calls["reward_margin"]) > 1e-4  # the policy differs from its reference
    # the reference's forward is not counted: the rows' tokens, each shared prefix once
    assert one_call["num_computed_tokens"] == two_calls["num_computed_tokens"]
    assert one_call["num_computed_tokens"] < one_call["num_tokens"]
    for key in ("loss", "reward_margin", "rewards_chosen_mean", "reference_logprob_accuracy"):
        assert one_call[key] == pytest.approx(two_calls[key], abs=1e-5), key


def test_grpo_trains_on_the_distribution_sampled_at_its_temperature(make_worker) -> None:
    """Samples drawn at temperature T carry log_softmax(logits / T); a `ClippedPGLoss` built
    with T makes the worker divide the policy's and the reference's logits by T before the
    loss. So the sampler/trainer mismatch is nil, and the KL term computed with the reference
    inside the train call equals the one from the separate reference call at T. (Trained at
    T = 1 instead, token_mult_prob_error would read the gap between the two distributions.)"""
    T = 0.5
    data = grouped_rows(seed=5)
    worker = make_worker(init_reference_model=True, init_optimizer=True, learning_rate=0.0)
    with torch.no_grad():  # move the policy away from its reference: the KL is not zero
        for p in worker.state.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    data["generation_logprobs"] = worker.get_logprobs(data, temperature=T)["logprobs"]
    data["advantages"] = torch.linspace(-1.0, 1.0, data.size)
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.5, temperature=T)
    args = {"global_batch_size": 12, "micro_batch_size": 4, "eval_mode": True}
    one_call = worker.train(data, loss_fn, with_reference=True, **args)
    separate = BatchedDataDict(dict(data))
    separate["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(
        data, temperature=T
    )["reference_policy_logprobs"]
    two_calls = worker.train(separate, loss_fn, **args)
    at_one = worker.train(separate, ClippedPGLoss(reference_policy_kl_penalty=0.5), **args)
    assert one_call["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5)
    assert at_one["token_mult_prob_error"] > 1.01  # what training at T = 1 would see
    assert one_call["kl_penalty"] > 1e-4
    for key in ("loss", "kl_penalty", "entropy"):
        assert one_call[key] == pytest.approx(two_calls[key], abs=1e-6), key
