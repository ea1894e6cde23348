"""The last decoder layer's MLP at the rows a loss reads (tempering/models/policy/read_rows.py):
the same loss and gradients as the whole pass in every layout, fewer rows through the MLP,
and a read anywhere else refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict, pack_in_order
from tempering.logits import HiddenLogits, needed_rows
from tempering.losses import DistillationLoss, NLLLoss, token_logprobs, topk_logprobs
from tempering.models.policy.gated_mlp import use_lean_gated_mlp
from tempering.models.policy.microbatching import ForwardPass
from tempering.models.policy.packed_attention import use_packed_sdpa
from tempering.models.policy.read_rows import LastLayer, model_rows
from tempering.models.policy.shared_prefix import attention_cost_ratio, plan_shared_prefix

VOCAB = 100
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False, attn_implementation="sdpa",
)  # fmt: skip


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES))


def phi3() -> torch.nn.Module:  # one fused gate_up projection
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0))


def rows(shared_prompts: bool) -> BatchedDataDict:
    """8 rows of 6-15 tokens, the loss on their last 2-5 (an answer); with ``shared_prompts``
    two prompts of 8 tokens shared by 4 rows each (GRPO-like), else a 2-token common start."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(6, 16, (8,), generator=g)
    if shared_prompts:
        lengths = lengths.clamp(min=10)
    ids = torch.zeros(8, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
    ids[:, :2] = torch.tensor([5, 6])
    if shared_prompts:
        ids[1:4, :8] = ids[0, :8]
        ids[5:8, :8] = ids[4, :8]
    answer = torch.randint(2, 6, (8,), generator=g)
    pos = torch.arange(ids.shape[1])[None]
    token_mask = ((pos < lengths[:, None]) & (pos >= (lengths - answer)[:, None])).float()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(8)
    )


def layout_of(kind: str, model: torch.nn.Module, data: BatchedDataDict):
    ratio = attention_cost_ratio(model.config, sum(p.numel() for p in model.parameters()))
    if kind == "padded":
        return None
    if kind == "packed":
        return pack_in_order(data)
    plan = plan_shared_prefix(
        data["input_ids"], data["input_lengths"], ratio, 0, kind == "over-rows", None
    )
    assert plan is not None and (plan.over_rows is not None) == (kind == "over-rows")
    return plan


@pytest.mark.parametrize("make_model", [llama, phi3])
@pytest.mark.parametrize("kind", ["padded", "packed", "tree", "over-rows"])
def test_loss_and_gradients_equal_the_whole_pass(make_model, kind) -> None:
    """In every layout the rows a loss reads get the same log-probs and every weight the same
    gradient as when the last MLP runs at every row, while that MLP sees only the rows read
    (at most 60% of the model's tokens here), and so do its query and output projections."""
    data = rows(shared_prompts=kind == "tree")
    reads = needed_rows(data["token_mask"])
    results, seen = [], []
    for read_rows in (False, True):
        model = make_model().train()
        assert use_packed_sdpa(model) and use_lean_gated_mlp(model)
        last = LastLayer.of(model)
        assert last is not None
        assert len(last.modules) == (3 if make_model is llama else 2)  # Phi-3: qkv fused
        for module in last.modules:  # the MLP, (the query projection,) the output projection
            module.register_forward_hook(  # the rows it computed: the others are zeros
                lambda _m, _args, out: seen.append(int(out.flatten(0, -2).any(-1).sum()))
            )
        fp = ForwardPass(
            "causal_lm", torch.device("cpu"), 0.1, 0, chunk_rows=16,
            over_rows=kind == "over-rows", read_rows=read_rows,
        )  # fmt: skip
        layout = layout_of(kind, model, data)
        logits = fp.logits(model, data, layout, reads=reads)
        loss, _ = NLLLoss()(logits, data, data["token_mask"].sum(), torch.tensor(8.0))
        loss.backward()
        logprobs = token_logprobs(logits, data["input_ids"], data["token_mask"]).detach()
        results.append((logprobs, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_whole, g_whole), (lp_read, g_read) = results
    torch.testing.assert_close(lp_read, lp_whole, atol=1e-6, rtol=0)
    for name, grad in g_whole.items():
        torch.testing.assert_close(g_read[name], grad, atol=1e-6, rtol=1e-5)
    parts = len(seen) // 2
    whole, read = set(seen[:parts]), set(seen[parts:])  # rows each part saw
    assert len(whole) == len(read) == 1
    assert read == {len(model_rows(reads, layout_of(kind, llama(), data)))}
    assert read.pop() <= 0.6 * whole.pop()


def test_a_read_outside_the_computed_rows_is_refused() -> None:
    """Logits whose last MLP ran at the token mask's rows refuse the reads that would see the
    other rows' (wrong) hidden states: every row, another mask, a teacher's top-k."""
    data = rows(shared_prompts=False)
    computed = needed_rows(data["token_mask"])
    logits = HiddenLogits(
        torch.randn(*data["input_ids"].shape, 8), torch.randn(VOCAB, 8), 16,
        computed_rows=computed,
    ) / 0.7  # fmt: skip
    token_logprobs(logits, data["input_ids"], data["token_mask"])  # the rows it was made for
    with pytest.raises(ValueError, match="computed only at the .* rows the loss reads"):
        token_logprobs(logits, data["input_ids"])
    with pytest.raises(ValueError, match="rows outside them"):
        token_logprobs(logits, data["input_ids"], torch.ones_like(data["token_mask"]))
    with pytest.raises(ValueError, match="reads_token_mask_only"):
        topk_logprobs(logits, 3)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_worker_trains_alike_and_reads_only_for_losses_that_say_so(make_worker, precision) -> None:
    """Through the worker: the same loss and weights after a step with and without the last
    MLP at the read rows, also on an FSDP2-wrapped model (bf16: ``fully_shard`` renames the
    layer classes, and the read rows must still find the last layer); a loss that reads
    elsewhere (distillation) is never given them."""
    from torch.distributed.fsdp import FSDPModule

    data = rows(shared_prompts=False)
    runs, seen = [], []
    tol = 1e-6 if precision == "float32" else 1e-3
    for read_rows in (True, False):
        worker = make_worker(optimizer="sgd", learning_rate=1.0, precision=precision)
        assert isinstance(worker.state.model, FSDPModule) == (precision == "bfloat16")
        assert worker.forward_pass.read_rows  # the worker's default
        worker.forward_pass = dataclasses.replace(worker.forward_pass, read_rows=read_rows)
        last = LastLayer.of(worker.state.model)
        last.modules[0].down_proj.register_forward_hook(
            lambda _m, args, _out: seen.append(args[0].shape[:-1].numel())
        )
        metrics = worker.train(data, NLLLoss(), global_batch_size=8, micro_batch_size=8)
        runs.append((metrics["loss"], worker.refit.state_dict()))
    assert seen[0] == int(data["token_mask"][:, 1:].sum()) < seen[1]
    assert runs[0][0] == pytest.approx(runs[1][0], abs=tol)
    for name, value in runs[1][1].items():
        torch.testing.assert_close(runs[0][1][name], value, atol=tol, rtol=0)
    assert worker.forward_pass.read_rows is False
    worker.forward_pass = dataclasses.replace(worker.forward_pass, read_rows=True)
    assert not hasattr(DistillationLoss(), "reads_token_mask_only")
    k = 4
    data["teacher_topk_logprobs"] = torch.log_softmax(
        torch.randn(8, data["input_ids"].shape[1], k), -1
    )
    data["teacher_topk_indices"] = torch.randint(0, VOCAB, (8, data["input_ids"].shape[1], k))
    worker.train(data, DistillationLoss(), global_batch_size=8, micro_batch_size=8)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    llama().save_pretrained(path)
    return str(path)
