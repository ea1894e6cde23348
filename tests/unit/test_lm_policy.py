"""`Policy` over a Ray worker group of 2 FSDP2 workers (gloo, CPU, fp32): sharded DCP
checkpoints resume exactly, the reference model stays at the initial weights, HF export from
two ranks loads with `from_pretrained`, and refit weights equal the exported ones.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.losses import NLLLoss
from tempering.models.policy.interfaces import HFExportablePolicy, PolicyInterface, RefittablePolicy
from tempering.models.policy.lm_policy import Policy, build_policy
from tests.tiny_models import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("policy_model")
    save_tiny_llama(path, tie_word_embeddings=True)
    return str(path)


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster([2], num_cpus_per_bundle=1, name="lm_policy_test")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def policy(cluster, model_dir):
    p = build_policy(
        cluster,
        model_dir,
        train_global_batch_size=4,
        train_micro_batch_size=1,
        learning_rate=1e-2,
        lr_schedule="cosine",
        warmup_steps=1,
        total_steps=8,
        init_reference_model=True,
        num_threads=1,
    )
    yield p
    p.shutdown()


def _batch(seed: int, n: int = 8) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 11, (n,), generator=g)
    mask = (torch.arange(10)[None] < lens[:, None]).float()
    ids = torch.randint(1, 100, (n, 10), generator=g) * mask.long()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=mask, sample_mask=torch.ones(n)
    )


def _plain_logprobs(model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
    ids = data["input_ids"]
    attn = (torch.arange(ids.shape[1])[None] < data["input_lengths"][:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits, -1)
    return torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0)) * attn


def test_policy_implements_the_interfaces(policy) -> None:
    assert isinstance(policy, PolicyInterface)
    # the workers run on mimalloc, preloaded by the group (tempering/utils/allocator.py)
    assert [w["allocator"] for w in policy.worker_group.worker_info] == ["mimalloc"] * 2
    assert isinstance(policy, RefittablePolicy) and isinstance(policy, HFExportablePolicy)
    assert policy.dp_size == 2


def test_sharded_checkpoint_resumes_exactly_and_exports(policy, model_dir, tmp_path) -> None:
    loss_fn = NLLLoss()
    first = policy.train(_batch(0), loss_fn)  # 8 samples / global batch 4 -> 2 optimizer steps
    assert first["num_steps"] == 2.0
    policy.save_checkpoint(str(tmp_path / "policy"))
    after_save = [policy.train(_batch(s), loss_fn) for s in (1, 2)]
    policy.load_checkpoint(str(tmp_path / "policy"))
    replay = [policy.train(_batch(s), loss_fn) for s in (1, 2)]
    for a, b in zip(after_save, replay, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
    assert after_save[1]["loss"] != pytest.approx(after_save[0]["loss"], abs=1e-4)  # it trains

    # The reference model is still the initial weights.
    data = _batch(5, n=6)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = policy.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    torch.testing.assert_close(ref, _plain_logprobs(initial, data), atol=1e-5, rtol=0)

    # HF export (gathered from 2 ranks) loads and scores like the live policy.
    policy.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    live = policy.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(_plain_logprobs(exported, data), live, atol=1e-5, rtol=0)
    assert (live - ref).abs().max() > 1e-2  # the policy moved away from the reference

    refit = policy.refit.state_dict()
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(refit[name], tensor, atol=0, rtol=0, msg=name)
    half = policy.refit.state_dict(dtype="bfloat16")
    assert half["model.embed_tokens.weight"].dtype == torch.bfloat16

    policy.prepare_for_generation()  # CPU: no-op, but must leave training intact
    policy.prepare_for_training()
    assert policy.train(_batch(3), loss_fn)["loss"] > 0


def test_build_policy_rejects_indivisible_batch_before_starting_workers(cluster, model_dir) -> None:
    with pytest.raises(ValueError, match=r"train_global_batch_size=5 .* data-parallel size 2"):
        build_policy(cluster, model_dir, train_global_batch_size=5, train_micro_batch_size=1)


def test_train_rejects_partial_global_batch(policy) -> None:
    assert isinstance(policy, Policy)
    with pytest.raises(ValueError, match="not a multiple of the global batch size 4"):
        policy.train(_batch(0, n=6), NLLLoss())


def test_streamed_refit_sends_layer_aligned_buckets_in_the_engine_dtype(policy) -> None:
    """`stream_weights` from 2 FSDP2 ranks into 2 sink workers: with a bucket limit of one
    decoder layer's size every layer is its own bucket, no layer is split, the tied lm_head is
    sent too (vLLM on CPU keeps a repacked copy of it) as the very bf16 copy of the embedding
    (one draw for both names, whichever an engine keeps), the bytes are the engine dtype's, and
    the received tensors equal the policy's full weights (bf16 as `cast_for_sampling` rounds
    them)."""
    from tempering.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
    from tempering.models.generation.refit import cast_for_sampling, stream_weights

    full = {k: v.clone() for k, v in policy.refit.state_dict().items()}
    assert "lm_head.weight" in full  # tied: the state dict names it twice
    layer_mb = (
        sum(t.numel() * 4 for k, t in full.items() if k.startswith("model.layers.0.")) / 2**20
    )
    sink_cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.1, name="refit_sinks")
    sinks = RayWorkerGroup(
        sink_cluster,
        RayWorkerBuilder("tests.workers.WeightSinkWorker"),
        "sink",
    )
    try:
        for dtype, nbytes in ((None, 4), ("bfloat16", 2)):
            moved = stream_weights(policy, sinks, dtype, bucket_mb=layer_mb)  # type: ignore[arg-type]
            got = sinks.get_all_worker_results(sinks.run_all_workers_single_data("received"))
            buckets = got[0]
            for other in got[1:]:  # every engine gets the same buckets
                assert [sorted(b) for b in other] == [sorted(b) for b in buckets]
            names = [n for b in buckets for n in b]
            assert sorted(names) == sorted(full)
            layers_per_bucket = [{n.split(".")[2] for n in b if ".layers." in n} for b in buckets]
            assert [len(s) for s in layers_per_bucket if s] == [1, 1], layers_per_bucket
            assert moved == sum(full[n].numel() * nbytes for n in names)
            want_dtype = torch.bfloat16 if dtype else torch.float32
            first = {"lm_head.weight": "model.embed_tokens.weight"}
            for name in names:
                tensor = next(b[name] for b in buckets if name in b)
                assert tensor.dtype == want_dtype, name
                want = cast_for_sampling(full[name], want_dtype, first.get(name, name))
                torch.testing.assert_close(tensor, want, atol=0, rtol=0)
            tied = [
                next(b[n] for b in buckets if n in b) for n in ("lm_head.weight", *first.values())
            ]
            assert torch.equal(*tied)  # in bf16 too: drawn under one name
        # one bucket for everything: the tied pair is gathered and cast once, sent once
        moved = stream_weights(policy, sinks, "bfloat16", bucket_mb=4 * layer_mb * len(full))
        (one,) = sinks.get_all_worker_results(sinks.run_all_workers_single_data("received"))[0]
        assert sorted(one) == sorted(full)
        assert torch.equal(one["lm_head.weight"], one["model.embed_tokens.weight"])
        assert moved == sum(full[n].numel() * 2 for n in full if n not in first)
    finally:
        sinks.shutdown()
        sink_cluster.shutdown()
