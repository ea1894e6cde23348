"""Numeric parity of distributed training: FSDP2 workers (Ray actors, gloo, CPU, fp32) in each
layout -- 2 data-parallel ranks; 2 tensor-parallel ranks (each decoder layer split in two);
2 x 2 (slow tier) -- with several micro-batches each must take the same step as 1 worker x 1
micro-batch and as a plain unsharded autograd computation, for sequences of different lengths
with masked tokens and a masked sample. One SGD step with lr=1 makes "updated params" =
"initial params - gradient", so equal parameters mean equal gradients. Also: `get_logprobs`
== plain forward, and with TP an AdamW step with gradient clipping equals one worker's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.losses import NLLLoss
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.models.policy.lm_policy import build_policy
from tests.tiny_models import save_tiny_llama

LENGTHS = [12, 5, 9, 3, 11, 7, 6, 10]
WIDTH = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("parity_model")
    save_tiny_llama(path)
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


LAYOUTS = {  # name -> (workers, tensor_parallel_size)
    "dp2": (2, 1),
    "tp2": (2, 2),
    "tp2xdp2": (4, 2),
}


@pytest.fixture(
    scope="module",
    params=["dp2", "tp2", pytest.param("tp2xdp2", marks=pytest.mark.slow)],
)
def two_worker_result(request, ray_session, model_dir, batch):
    """Run once per layout: train one SGD step with 2+ micro-batches per rank."""
    workers, tp = LAYOUTS[request.param]
    cluster = RayVirtualCluster([workers], num_cpus_per_bundle=0.5, name="parity")
    policy = build_policy(
        cluster,
        model_dir,
        train_global_batch_size=len(LENGTHS),
        train_micro_batch_size=len(LENGTHS) // 4,  # 2 rows per micro-batch
        logprob_micro_batch_size=3,
        optimizer="sgd",
        learning_rate=1.0,
        max_grad_norm=None,
        num_threads=1,
        tensor_parallel_size=tp,
    )
    try:
        odd = batch.slice(0, 7)  # not divisible by 2 ranks: exercises padding of the shards
        logprobs = policy.get_logprobs(odd)["logprobs"]
        metrics = policy.train(batch, NLLLoss())
        params = policy.refit.state_dict()
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


def _one_rank(monkeypatch, model_dir: str, **kwargs) -> FSDP2PolicyWorker:
    """A worker built in this process as a lone rank (the Ray workers' variables cleared)."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TEMPERING_DIST_INIT_METHOD", raising=False)
    return FSDP2PolicyWorker(model_dir, **kwargs)


def test_two_workers_two_microbatches_equal_one_batch(
    two_worker_result, model_dir, batch, monkeypatch
) -> None:
    plain_loss, plain_params = _plain_step(model_dir, batch)

    single = _one_rank(
        monkeypatch, model_dir, optimizer="sgd", learning_rate=1.0, max_grad_norm=None,
        num_threads=1,
    )  # fmt: skip
    try:
        single_metrics = single.train(
            batch, NLLLoss(), global_batch_size=len(LENGTHS), micro_batch_size=len(LENGTHS)
        )
        single_params = single.refit.state_dict()
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


def test_tensor_parallel_adamw_step_with_clipping_equals_one_worker(
    ray_session, model_dir, batch, monkeypatch
) -> None:
    """TP's own gradient-norm path (two meshes) and AdamW on split layers, against one rank."""
    kwargs = {"learning_rate": 1e-3, "max_grad_norm": 0.5, "num_threads": 1}
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.5, name="tp_adamw")
    policy = build_policy(cluster, model_dir, train_global_batch_size=len(LENGTHS),
                          train_micro_batch_size=4, tensor_parallel_size=2, **kwargs)  # fmt: skip
    try:
        tp_metrics = policy.train(batch, NLLLoss())
        tp_params = policy.refit.state_dict()
    finally:
        policy.shutdown()
        cluster.shutdown()
    single = _one_rank(monkeypatch, model_dir, **kwargs)
    try:
        metrics = single.train(batch, NLLLoss(), global_batch_size=len(LENGTHS))
        params = single.refit.state_dict()
    finally:
        single.shutdown()
    assert metrics["grad_norm"] > 0.5  # clipping was active
    assert tp_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for name, want in params.items():
        torch.testing.assert_close(tp_params[name], want, atol=1e-5, rtol=0, msg=name)


def test_tensor_parallel_value_head_equals_one_worker(ray_session, model_dir, batch, monkeypatch):
    """A PPO critic (``head="value"``: a new head on the split body, itself whole on every
    rank) with TP = 2: its values, and a clipped `ValueLoss` AdamW step, equal one rank's."""
    from tempering.losses import ValueLoss
    from tempering.models.policy.critic import Critic

    g = torch.Generator().manual_seed(3)
    data = BatchedDataDict(dict(batch))
    data["returns"] = torch.rand(batch["input_ids"].shape, generator=g)
    data["prev_values"] = torch.zeros(batch["input_ids"].shape)
    kwargs = {"learning_rate": 1e-2, "max_grad_norm": 0.5, "num_threads": 1, "seed": 0,
              "head": "value"}  # fmt: skip
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.5, name="tp_value")
    policy = build_policy(cluster, model_dir, train_global_batch_size=len(LENGTHS),
                          train_micro_batch_size=4, logprob_micro_batch_size=3,
                          tensor_parallel_size=2, **kwargs)  # fmt: skip
    try:
        critic = Critic(policy, value_clip=0.2)
        tp_before = critic.values(data)["values"]
        tp_metrics = critic.train(data)
        tp_after = critic.values(data)["values"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    single = _one_rank(monkeypatch, model_dir, **kwargs)
    try:
        before = single.values(data, 3)["values"]
        metrics = single.train(data, ValueLoss(0.2), global_batch_size=len(LENGTHS))
        after = single.values(data, 3)["values"]
    finally:
        single.shutdown()
    assert (after - before).abs().max() > 1e-3  # the step moved the values
    assert metrics["value_clip_fraction"] > 0  # and the clip was active
    torch.testing.assert_close(tp_before, before, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "value_clip_fraction"):
        assert tp_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(tp_after, after, atol=1e-5, rtol=0)
