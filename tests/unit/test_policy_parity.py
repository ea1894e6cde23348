"""Numeric parity of data-parallel training: 2 FSDP2 workers (Ray actors, gloo, CPU, fp32) x
2 micro-batches each must take the same step as 1 worker x 1 micro-batch and as a plain
unsharded autograd computation, for sequences of different lengths with masked tokens and a
masked sample. One SGD step with lr=1 makes "updated params" = "initial params - gradient", so
equal parameters mean equal gradients. Also: 2-worker `get_logprobs` == plain forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tempering.algorithms.loss_functions import NLLLoss
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.models.policy.lm_policy import build_policy

LENGTHS = [12, 5, 9, 3, 11, 7, 6, 10]
WIDTH = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("parity_model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def batch() -> BatchedDataDict:
    g = torch.Generator().manual_seed(7)
    lens = torch.tensor(LENGTHS)
    valid = torch.arange(WIDTH)[None, :] < lens[:, None]
    ids = torch.randint(1, 100, (len(LENGTHS), WIDTH), generator=g) * valid
    token_mask = valid.float()
    token_mask[:, :2] = 0  # a two-token "prompt"
    token_mask[4, 5:8] = 0  # and some masked response tokens
    sample_mask = torch.ones(len(LENGTHS))
    sample_mask[2] = 0
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=token_mask, sample_mask=sample_mask
    )


@pytest.fixture(scope="module")
def two_worker_result(ray_session, model_dir, batch):
    """Run once on 2 Ray workers: train one SGD step with 2 micro-batches per rank."""
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=1, name="parity")
    policy = build_policy(
        cluster,
        model_dir,
        train_global_batch_size=len(LENGTHS),
        train_micro_batch_size=len(LENGTHS) // 4,  # 4 rows per rank -> 2 micro-batches
        logprob_micro_batch_size=3,
        optimizer="sgd",
        learning_rate=1.0,
        max_grad_norm=None,
        num_threads=1,
    )
    try:
        odd = batch.slice(0, 7)  # not divisible by 2 ranks: exercises padding of the shards
        logprobs = policy.get_logprobs(odd)["logprobs"]
        metrics = policy.train(batch, NLLLoss())
        params = policy.state_dict_for_refit()
    finally:
        policy.shutdown()
        cluster.shutdown()
    return {"logprobs": logprobs, "metrics": metrics, "params": params}


def _plain_step(model_dir: str, data: BatchedDataDict) -> tuple[float, dict[str, torch.Tensor]]:
    """Unsharded model, one batch, hand-written masked NLL, SGD lr=1 by hand."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, lens = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits, -1)
    picked = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # scores tokens 1..S-1
    mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:]
    loss = -(picked * mask).sum() / (data["token_mask"] * data["sample_mask"][:, None]).sum()
    loss.backward()
    with torch.no_grad():
        updated = {k: (p - p.grad).clone() for k, p in model.named_parameters()}
    return float(loss.detach()), updated


def test_two_workers_two_microbatches_equal_one_batch(
    two_worker_result, model_dir, batch, monkeypatch
) -> None:
    plain_loss, plain_params = _plain_step(model_dir, batch)

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    single = FSDP2PolicyWorker(
        model_dir, optimizer="sgd", learning_rate=1.0, max_grad_norm=None, num_threads=1
    )
    try:
        single_metrics = single.train(
            batch, NLLLoss(), global_batch_size=len(LENGTHS), micro_batch_size=len(LENGTHS)
        )
        single_params = single.state_dict_for_refit()
    finally:
        single.shutdown()

    dp = two_worker_result
    assert dp["metrics"]["loss"] == pytest.approx(plain_loss, abs=1e-5)
    assert single_metrics["loss"] == pytest.approx(plain_loss, abs=1e-5)
    assert dp["metrics"]["grad_norm"] == pytest.approx(single_metrics["grad_norm"], rel=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(dp["params"]) == set(plain_params)
    for name, want in plain_params.items():
        assert (want - initial[name]).abs().max() > 0  # the step moved it
        torch.testing.assert_close(dp["params"][name], want, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(single_params[name], want, atol=1e-5, rtol=0, msg=name)


def test_two_worker_logprobs_match_plain_forward(two_worker_result, model_dir, batch) -> None:
    data = batch.slice(0, 7)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, lens = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(WIDTH)[None] < lens[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits, -1)
    want = torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0)) * attn
    got = two_worker_result["logprobs"]
    assert got.shape == (7, WIDTH)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
