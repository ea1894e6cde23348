"""Every model family in `tempering.models.families`, built tiny into tmp_path and loaded through
the project's own loaders: sampler log-probs == a teacher-forced forward (fp32), the chat
template in the family's real format and the chat splice's end of turn, one optimizer step
that lowers a fixed batch's loss, and the tensor-parallel plan (or its refusal)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tempering.models.families import (
    FAMILIES,
    LLAMA_TP_PLAN,
    build_tiny,
    family_for_model_type,
    tp_plan_for,
)
from tempering.models.generation.chat import ChatPromptBuilder
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.hf import load_causal_lm, load_tokenizer

NAMES = sorted(FAMILIES)
SYSTEM = {"role": "system", "content": "Be brief."}
USER1 = {"role": "user", "content": "Q: 1+2=? A:"}
USER2 = {"role": "user", "content": "Q: 2+2=? A:"}
# [system, user, assistant " 3", user] with the generation prompt, written out by hand from each
# family's public format (see the sources in families.py), not produced by our templates.
EXPECTED = {
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 1+2=? A:<|im_end|>\n"
    "<|im_start|>assistant\n 3<|im_end|>\n<|im_start|>user\nQ: 2+2=? A:<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nQ: 1+2=? A:<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n3<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nQ: 2+2=? A:<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Q: 1+2=? A:[/INST] 3</s>"
    "[INST]Q: 2+2=? A:[/INST]",
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nQ: 1+2=? A:<end_of_turn>\n"
    "<start_of_turn>model\n3<end_of_turn>\n<start_of_turn>user\nQ: 2+2=? A:<end_of_turn>\n"
    "<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nQ: 1+2=? A:<|end|>\n<|assistant|>\n 3<|end|>\n"
    "<|user|>\nQ: 2+2=? A:<|end|>\n<|assistant|>\n",
}
EXPECTED["qwen3"] = EXPECTED["qwen3_moe"] = EXPECTED["qwen2"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the tiny models gain nothing from two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family name -> a folder holding its tiny model + tokenizer (each built once, lazily)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_tiny(name, root / name, seed=0))
        return built[name]

    return get


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_sampler_logprobs_equal_a_teacher_forced_forward(name, folders):
    tokenizer, model = load_tokenizer(folders(name)), load_causal_lm(folders(name))
    assert type(model).__name__ == FAMILIES[name].model_class
    prompts = [_chat_ids(tokenizer, [USER1]), _chat_ids(tokenizer, [SYSTEM, USER2])]
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((2, int(lengths.max())), tokenizer.pad_token_id)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    temperature = 0.7
    engine = TorchGenerationEngine(model, tokenizer, temperature=temperature, max_new_tokens=5)
    engine.reseed(0)
    out = engine.generate({"input_ids": ids, "input_lengths": lengths})
    assert int(out["generation_lengths"].sum()) > 0

    seq, seq_lens = out["output_ids"], out["unpadded_sequence_lengths"]
    cols = torch.arange(seq.shape[1])
    with torch.no_grad():
        logits = model(seq, attention_mask=(cols < seq_lens[:, None]).long()).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ref = torch.nn.functional.pad(logp.gather(-1, seq[:, 1:, None]).squeeze(-1), (1, 0))
    generated = (cols >= lengths[:, None]) & (cols < seq_lens[:, None])
    torch.testing.assert_close(out["logprobs"][generated], ref[generated], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chat_template_and_end_of_turn_splice(name, folders):
    family, tokenizer = FAMILIES[name], load_tokenizer(folders(name))
    conversation = [SYSTEM, USER1, {"role": "assistant", "content": " 3"}, USER2]
    full = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert full == EXPECTED[name]
    # Special tokens are single ids, and the end of turn is what generation stops on.
    assert all(
        len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in family.special_tokens
    )
    assert tokenizer.eos_token == family.eot_token

    builder = ChatPromptBuilder(tokenizer)
    assert builder.eot_token == family.eot_token
    first = builder.encode([SYSTEM, USER1]).ids
    generated = builder.encode_text(" 3") + [builder.eot_token_id]
    assistant = {"role": "assistant", "content": " 3", "prompt_token_ids": first,
                 "generation_token_ids": generated}  # fmt: skip
    second = builder.encode([SYSTEM, USER1, assistant, USER2])
    assert second.spliced
    n = len(first) + len(generated)
    assert second.ids[:n] == first + generated
    # After the turn's end-of-turn token: the template's text for the next user turn, exactly.
    close = full.index("3" + family.eot_token) + 1 + len(family.eot_token)
    assert tokenizer.decode(second.ids[n:], skip_special_tokens=False) == full[close:]


@pytest.mark.parametrize("name", NAMES)
def test_one_optimizer_step_lowers_the_loss(name, folders):
    tokenizer, model = load_tokenizer(folders(name)), load_causal_lm(folders(name))
    conversation = [SYSTEM, USER1, {"role": "assistant", "content": " 3"}]
    ids = torch.tensor([_chat_ids(tokenizer, conversation)] * 2)
    model.train()

    def loss() -> torch.Tensor:
        logits = model(ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = loss()
    start.backward()
    optimizer.step()
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"
    with torch.no_grad():
        assert loss() < start


def _layer(model) -> torch.nn.Module:
    return model.model.layers[0]


@pytest.mark.parametrize("name", NAMES)
def test_tp_plan_names_linear_modules_or_is_refused_with_a_reason(name, folders):
    family, model = FAMILIES[name], load_causal_lm(folders(name))
    model_type = model.config.model_type
    assert family_for_model_type(model_type) is family
    modules = dict(_layer(model).named_modules())
    if family.tp_plan is not None:
        assert tp_plan_for(model_type) == family.tp_plan
        for module, style in family.tp_plan.items():
            assert style in ("colwise", "rowwise"), (module, style)
            # ColwiseParallel/RowwiseParallel shard nn.Linear weights and nothing else.
            assert isinstance(modules.get(module), torch.nn.Linear), module
        return
    assert family.tp_refusal
    with pytest.raises(ValueError, match=f"{name!r}.*tensor_parallel_size=1"):
        tp_plan_for(model_type)
    # The refusal is warranted: the Llama-style plan does not fit this layer.
    assert not all(isinstance(modules.get(m), torch.nn.Linear) for m in LLAMA_TP_PLAN)


def test_a_model_type_no_family_claims_gets_the_llama_plan():
    assert tp_plan_for("smollm-like-unknown") == LLAMA_TP_PLAN


# ---- the policy worker's start-up uses the registry's plan ---------------------------------


class _Split(Exception):
    """Raised by the stand-in `_tensor_parallel`: the plan load_sharded chose, no sharding."""


def _load_with_tp(folder: str, monkeypatch) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tempering.models.policy import model_setup

    def split(layer, tp_mesh, plan):
        raise _Split(plan)

    monkeypatch.setattr(model_setup, "_tensor_parallel", split)
    topo = model_setup.Topology(0, 2, 1, 2, torch.device("cpu"), None, None, object(), None)
    with pytest.raises(_Split) as caught:
        model_setup.load_sharded(
            model_setup.ModelSource(folder), topo, MixedPrecisionPolicy(),
            activation_checkpointing=False, lean_loading=False,
        )  # fmt: skip
    return caught.value.args[0]


def test_policy_start_up_splits_layers_by_the_family_plan(folders, monkeypatch):
    # A plan of gemma3's own (not the Llama default object): the lookup goes by model_type.
    plan = {**LLAMA_TP_PLAN, "mlp.down_proj": "rowwise"}
    monkeypatch.setitem(FAMILIES, "gemma3", dataclasses.replace(FAMILIES["gemma3"], tp_plan=plan))
    assert _load_with_tp(folders("gemma3"), monkeypatch) is plan


def test_policy_start_up_refuses_tp_for_a_family_without_a_plan(folders, monkeypatch):
    from tempering.models.policy import model_setup

    def no_read(self):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(model_setup.ModelSource, "read", no_read)
    with pytest.raises(ValueError, match="'phi3'.*fused.*tensor_parallel_size=1"):
        _load_with_tp(folders("phi3"), monkeypatch)


# ---- mixture of experts: the router's load-balancing loss in training ---------------------


@pytest.fixture
def tiny_llama_dir(folders):
    """What `make_worker` (tests/conftest.py) builds from: here the mixture-of-experts family."""
    return folders("qwen3_moe")


def _moe_batch(folder: str) -> tuple:
    from tempering.distributed.batched_data_dict import BatchedDataDict

    tok = load_tokenizer(folder)
    rows = [
        tok(t, add_special_tokens=False)["input_ids"] for t in ("Q: 1+2=? A: 3", "Q: 45+5=? A:")
    ]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    mask[:, 0] = 0
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=mask,
                           sample_mask=torch.ones(2)), mask  # fmt: skip


def test_moe_training_adds_the_router_loss_and_logs_the_expert_load(make_worker, folders):
    from tempering.losses import NLLLoss
    from tempering.models.policy.moe import MoERouting

    folder = folders("qwen3_moe")
    batch, _ = _moe_batch(folder)
    model = load_causal_lm(folder).eval()
    attn = torch.arange(batch["input_ids"].shape[1])[None] < batch["input_lengths"][:, None]
    with torch.no_grad():
        ref = model(
            input_ids=batch["input_ids"], attention_mask=attn.long(), output_router_logits=True
        )
    routing = MoERouting.of(model)
    assert routing is not None and routing.aux_loss_coef > 0 and MoERouting.of(
        load_causal_lm(folders("qwen2"))) is None  # fmt: skip
    # Hand-computed expert load: top-k assignments of the real tokens, over layers.
    counts = torch.zeros(routing.num_experts)
    for layer in ref.router_logits:
        top = layer.topk(routing.top_k, -1).indices[attn.reshape(-1)]
        counts += torch.bincount(top.reshape(-1), minlength=routing.num_experts)
    load = counts / counts.sum()

    worker = make_worker(optimizer="sgd", learning_rate=1.0, max_grad_norm=None)
    m = worker.train(batch, NLLLoss(), global_batch_size=2, micro_batch_size=2, eval_mode=True)
    assert m["moe_aux_loss"] == pytest.approx(routing.aux_loss_coef * float(ref.aux_loss), rel=1e-5)
    assert m["moe_expert_load_max"] == pytest.approx(float(load.max()) * routing.num_experts)
    assert m["moe_expert_load_min"] == pytest.approx(float(load.min()) * routing.num_experts)

    # The term reaches the router's gradient: one SGD step moves the gates differently
    # with the coefficient than without it (the objective's loss being the same).
    gates = {}
    for coef in (routing.aux_loss_coef * 1000, 0.0):
        worker = make_worker(optimizer="sgd", learning_rate=1.0, max_grad_norm=None)
        worker.moe = dataclasses.replace(worker.moe, aux_loss_coef=coef)
        worker.train(batch, NLLLoss(), global_batch_size=2, micro_batch_size=2)
        gates[coef] = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                       for k, v in worker.state.model.state_dict().items() if "mlp.gate." in k}  # fmt: skip
    assert gates[0.0] and any(
        not torch.allclose(gates[0.0][k], v) for k, v in gates[routing.aux_loss_coef * 1000].items()
    )


def test_vllm_on_cpu_refuses_a_family_it_refits_wrongly():
    """Qwen3-MoE's refit into vLLM on CPU leaves its experts in checkpoint layout
    (tests/functional/test_family_vllm.py): refused with the reason and the fix; the dense
    families and unknown model types pass."""
    from tempering.models.families import check_vllm_cpu_refit

    with pytest.raises(ValueError, match="qwen3_moe.*backend=torch"):
        check_vllm_cpu_refit("qwen3_moe")
    for model_type in ("qwen2", "qwen3", "llama", "gemma3_text", "phi3", "some_new_type"):
        check_vllm_cpu_refit(model_type)
