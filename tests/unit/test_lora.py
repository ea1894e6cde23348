"""LoRA on the FSDP2 policy worker (`tempering/models/policy/lora.py`, peft's layers).

One rank in process: only adapters train, the adapters-off reference is the base model bit
for bit, the merged weights a generation engine receives reproduce the trainer's log-probs,
the PEFT adapter folder loads into ``PeftModel`` and agrees with the merged model, a resumed
worker takes the same next step, and bad settings fail naming the fix. Two ranks (Ray, gloo):
data parallel and tensor parallel take the same two AdamW steps as one rank.
"""

from __future__ import annotations

import types

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from tempering.config.schemas import LoraConfig
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.distributed.virtual_cluster import RayVirtualCluster
from tempering.losses import NLLLoss
from tempering.models.policy.fsdp2_worker import FSDP2PolicyWorker
from tempering.models.policy.lm_policy import build_policy
from tempering.models.policy.lora import LoraSpec
from tempering.models.registry import resolve_model_path
from tempering.preference_losses import BradleyTerryLoss
from tests.tiny_models import save_tiny_llama

LORA = {"dim": 4, "alpha": 8.0, "target_modules": (), "match_all_linear": True}
KWARGS = {"learning_rate": 2e-2, "num_threads": 1, "max_grad_norm": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lora_model")
    save_tiny_llama(path)
    return str(path)


def _batch(seed: int, rows: int = 8) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 12, (rows,), generator=g)
    valid = torch.arange(12)[None, :] < lens[:, None]
    ids = torch.randint(1, 100, (rows, 12), generator=g) * valid
    return BatchedDataDict(
        input_ids=ids, input_lengths=lens, token_mask=valid.float(), sample_mask=torch.ones(rows)
    )


@pytest.fixture
def lone_rank(monkeypatch):
    """A worker built in this process as a lone rank (no Ray variables)."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TEMPERING_DIST_INIT_METHOD", raising=False)
    built: list[FSDP2PolicyWorker] = []

    def build(model_dir: str, **kwargs) -> FSDP2PolicyWorker:
        if built:
            built[-1].shutdown()
        built.append(FSDP2PolicyWorker(model_dir, **{**KWARGS, **kwargs}))
        return built[-1]

    yield build
    if built:
        built[-1].shutdown()


def _plain_logprobs(model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
    ids, lens = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    return torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0)) * attn


def test_only_adapters_train_and_the_reference_is_the_base_model(model_dir, lone_rank) -> None:
    worker = lone_rank(model_dir, lora=LORA)
    names = {id(p): n for n, p in worker.state.model.named_parameters()}
    in_optimizer = [p for g in worker.state.optimizer.param_groups for p in g["params"]]
    assert in_optimizer and all(".lora_" in names[id(p)] for p in in_optimizer)
    assert all(p.dtype == torch.float32 for p in in_optimizer)
    # every linear layer of the decoder (7 per layer x 2), never the output head
    assert len(in_optimizer) == 2 * 7 * 2 and not any(
        "lm_head" in names[id(p)] for p in in_optimizer
    )
    frozen = {n: p.detach().clone() for n, p in worker.state.model.named_parameters()
              if not p.requires_grad}  # fmt: skip
    data = _batch(1)
    base = _plain_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), data)
    torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], base, atol=1e-6, rtol=0)
    for step in range(3):
        worker.train(_batch(10 + step), NLLLoss(), with_reference=True)
    after = worker.get_logprobs(data)["logprobs"]
    assert (after - base).abs().max() > 1e-2  # the adapters moved the policy
    for n, p in worker.state.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed but is frozen"
    reference = worker.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    again = _plain_logprobs(worker.state.model, data)  # adapters back on after the reference
    assert torch.equal(
        reference, worker.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    )
    torch.testing.assert_close(reference, base, atol=1e-6, rtol=0)
    torch.testing.assert_close(again, after, atol=1e-6, rtol=0)
    # a teacher's top-k (on-policy distillation) is the plain forward's, zero past each row
    from tempering.losses import topk_logprobs

    ids, lens = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    with torch.no_grad():
        want_v, want_i = topk_logprobs(
            worker.state.model(input_ids=ids, attention_mask=attn).logits, 3
        )
    got = worker.get_topk_logprobs(data, k=3)
    valid = attn.bool()
    valid[:, 0] = False
    torch.testing.assert_close(
        got["teacher_topk_logprobs"][valid], want_v[valid], atol=1e-5, rtol=0
    )
    assert got["teacher_topk_indices"].dtype == torch.int32  # half int64's bytes on the wire
    assert torch.equal(got["teacher_topk_indices"][valid].long(), want_i[valid])
    assert not got["teacher_topk_logprobs"][~attn.bool()].any()
    # no second copy of the weights: the reference is the model itself
    assert worker.state.reference_model is None and worker.state.has_reference


def test_merged_refit_export_and_peft_adapter_agree_with_the_trainer(
    model_dir, lone_rank, tmp_path
) -> None:
    from peft import PeftModel

    from tempering.models.generation.interfaces import SamplingConfig
    from tempering.models.generation.torch_engine import TorchGenerationEngine

    worker = lone_rank(model_dir, lora={**LORA, "dropout": 0.1})
    for step in range(3):
        worker.train(_batch(step), NLLLoss())
    data = _batch(99)
    trainer = worker.get_logprobs(data)["logprobs"]
    weights = worker.refit.state_dict()
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    engine_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)  # ids only: no text here
    engine = TorchGenerationEngine(engine_model, tokenizer, SamplingConfig(max_new_tokens=1))
    engine.update_weights(weights)
    torch.testing.assert_close(_plain_logprobs(engine.model, data), trainer, atol=1e-4, rtol=0)

    worker.checkpoint.export_hf(str(tmp_path / "merged"))
    worker.checkpoint.export_adapter(str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(_plain_logprobs(merged, data), trainer, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(
        _plain_logprobs(peft_model, data), _plain_logprobs(merged, data), atol=1e-5, rtol=0
    )


def test_resumed_worker_takes_the_same_steps_from_a_small_checkpoint(
    model_dir, lone_rank, tmp_path
) -> None:
    worker = lone_rank(model_dir, lora=LORA)
    worker.train(_batch(0), NLLLoss())
    worker.checkpoint.save(str(tmp_path / "lora"))
    want = [worker.train(_batch(s), NLLLoss())["loss"] for s in (1, 2)]
    want_lp = worker.get_logprobs(_batch(3))["logprobs"]
    resumed = lone_rank(model_dir, lora=LORA)
    resumed.checkpoint.load(str(tmp_path / "lora"))
    assert [resumed.train(_batch(s), NLLLoss())["loss"] for s in (1, 2)] == want
    assert torch.equal(resumed.get_logprobs(_batch(3))["logprobs"], want_lp)
    # the checkpoint holds adapters and their AdamW state, not the base: far below a full one
    full = lone_rank(model_dir)
    full.train(_batch(0), NLLLoss())  # its AdamW state exists too
    full.checkpoint.save(str(tmp_path / "full"))

    def size(folder: str) -> int:
        return sum(f.stat().st_size for f in (tmp_path / folder).iterdir())

    # 8k adapter parameters against 87k; DCP's per-tensor overhead (~2 KB each) makes the
    # ratio 0.28 at this tiny size (bench/bench_lora.py reports SmolLM2's)
    assert size("lora") < 0.35 * size("full")
    # exactly the adapters, also where a frozen weight is tied under a second name (tiny-arith's
    # lm_head is its embedding; torch's ignore_frozen_params alone would keep it)
    from torch.distributed.checkpoint import FileSystemReader

    tied = lone_rank(resolve_model_path("tiny-arith"), lora=LORA)
    tied.checkpoint.save(str(tmp_path / "tied"))
    saved = {k.removeprefix("model.") for k in
             FileSystemReader(str(tmp_path / "tied")).read_metadata().state_dict_metadata
             if k.startswith("model.")}  # fmt: skip
    trained = {n for n, p in tied.state.model.named_parameters() if p.requires_grad}
    assert saved == trained


def test_bf16_keeps_the_frozen_base_in_bf16_and_the_adapters_in_fp32(model_dir, lone_rank):
    from tempering.models.policy.model_setup import local_tensor

    worker = lone_rank(model_dir, precision="bfloat16", lora=LORA)
    dtypes = {n: local_tensor(p).dtype for n, p in worker.state.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    losses = [worker.train(_batch(0), NLLLoss())["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]  # the same batch: the adapters fit it
    base = _plain_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), _batch(2))
    reference = worker.get_reference_policy_logprobs(_batch(2))["reference_policy_logprobs"]
    assert (reference - base).abs().max() < 0.1  # bf16 compute of the base


def test_a_reward_model_trains_its_new_score_head_whole_beside_the_adapters(model_dir, lone_rank):
    worker = lone_rank(model_dir, head="score", pad_token_id=0, lora=LORA)
    names = {id(p): n for n, p in worker.state.model.named_parameters()}
    trained = {names[id(p)] for g in worker.state.optimizer.param_groups for p in g["params"]}
    assert "score.weight" in trained and all(".lora_" in n for n in trained - {"score.weight"})
    before = worker.refit.state_dict()["score.weight"].clone()
    pairs = _batch(4)  # rows (2i, 2i+1) as (chosen, rejected)
    worker.train(pairs, BradleyTerryLoss())
    assert not torch.equal(worker.refit.state_dict()["score.weight"], before)


def test_bad_lora_settings_fail_naming_the_fix(model_dir, lone_rank) -> None:
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] match no linear layer.*q_proj"):
        lone_rank(model_dir, lora={**LORA, "target_modules": ("qkv_proj",),
                                   "match_all_linear": False})  # fmt: skip
    with pytest.raises(ValueError, match="dim=0 must be > 0"):
        LoraSpec(dim=0)
    with pytest.raises(ValueError, match="set exactly one"):
        LoraConfig(enabled=True, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="greater than 0"):
        LoraConfig(enabled=True, alpha=0)
    with pytest.raises(ValueError, match="'score'"):
        lone_rank(
            model_dir,
            head="score",
            pad_token_id=0,
            lora={**LORA, "target_modules": ("score", "q_proj"), "match_all_linear": False},
        )


@pytest.fixture(scope="module", params=["dp2", "tp2"])
def two_rank_lora(request, ray_session, model_dir):
    """Two AdamW steps of LoRA (reference log-probs computed inside the first) on 2 ranks."""
    tp = 2 if request.param == "tp2" else 1
    cluster = RayVirtualCluster([2], num_cpus_per_bundle=0.5, name=f"lora_{request.param}")
    policy = build_policy(cluster, model_dir, train_global_batch_size=8, train_micro_batch_size=2,
                          tensor_parallel_size=tp, lora=LORA, **KWARGS)  # fmt: skip
    try:
        losses = [policy.train(_batch(0), NLLLoss(), with_reference=True)["loss"]]
        losses.append(policy.train(_batch(1), NLLLoss())["loss"])
        reference = policy.get_reference_policy_logprobs(_batch(2))["reference_policy_logprobs"]
        weights = policy.refit.state_dict()
        # on-policy distillation's teacher call, on the same run: 7 rows over 2 ranks (padded)
        topk = policy.get_topk_logprobs(_batch(3, rows=7), k=5)
        streamed: dict[str, torch.Tensor] = {}  # the split-generation refit: small buckets
        buckets = policy.refit.buckets(64 * 1024)
        for names in buckets:
            streamed.update(ray.get(policy.refit.bucket(names, None)[0]))
        adapter_ref, adapter_bytes = policy.refit.adapter()  # vLLM's adapter-only refit
        adapter = ray.get(adapter_ref)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return {"losses": losses, "reference": reference, "weights": weights, "adapter": adapter,
            "adapter_bytes": adapter_bytes, "streamed": streamed, "buckets": len(buckets),
            "topk": topk}  # fmt: skip


def test_lora_on_two_ranks_equals_one_rank(two_rank_lora, model_dir, lone_rank) -> None:
    single = lone_rank(model_dir, lora=LORA)
    losses = [single.train(_batch(0), NLLLoss(), with_reference=True)["loss"]]
    losses.append(single.train(_batch(1), NLLLoss())["loss"])
    assert two_rank_lora["losses"] == pytest.approx(losses, abs=1e-5)
    base = _plain_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), _batch(2))
    torch.testing.assert_close(two_rank_lora["reference"], base, atol=1e-5, rtol=0)
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    want = single.refit.state_dict()
    assert set(two_rank_lora["weights"]) == set(want) == set(initial)
    moved = 0
    for name, tensor in want.items():
        moved += int((tensor - initial[name]).abs().max() > 1e-4)
        torch.testing.assert_close(two_rank_lora["weights"][name], tensor, atol=1e-5, rtol=0)
    assert moved == 14  # the adapted projections, merged; nothing else
    # the sharded teacher top-k (on-policy distillation) equals one rank's
    topk = single.get_topk_logprobs(_batch(3, rows=7), k=5)
    assert torch.equal(two_rank_lora["topk"]["teacher_topk_indices"], topk["teacher_topk_indices"])
    torch.testing.assert_close(
        two_rank_lora["topk"]["teacher_topk_logprobs"], topk["teacher_topk_logprobs"],
        atol=1e-5, rtol=0,
    )  # fmt: skip
    assert two_rank_lora["buckets"] > 2 and set(two_rank_lora["streamed"]) == set(want)
    for name, tensor in two_rank_lora["streamed"].items():
        assert torch.equal(tensor, two_rank_lora["weights"][name]), name


def test_the_adapter_refit_carries_the_adapters_alone(two_rank_lora, model_dir, tmp_path):
    """What vLLM's adapter-only refit receives, gathered from 2 ranks: PEFT's files, which on
    the base model give the merged weights the full refit sends; 14 x 2 small matrices."""
    from peft import PeftModel

    from tempering.models.policy.lora import save_peft_adapter

    adapter = two_rank_lora["adapter"]
    tensors = adapter["tensors"]
    assert len(tensors) == 2 * 14 and adapter["config"]["r"] == LORA["dim"]
    assert two_rank_lora["adapter_bytes"] == sum(t.numel() * 4 for t in tensors.values())
    folder = save_peft_adapter(tmp_path / "adapter", tensors, adapter["config"])
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    merged = PeftModel.from_pretrained(base, folder).merge_and_unload().state_dict()
    for name, tensor in two_rank_lora["weights"].items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-5, rtol=0, msg=name)
