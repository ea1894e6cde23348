"""Torch-native generation engine: parity with HF generate, log-prob parity with a
teacher-forced forward, stops, seeding and in-place weight updates (tiny random Llama, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tempering.models.generation.interfaces import GenerationInterface, SamplingConfig
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.tiny_arith import build_tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on the shared 2-core machine, 2 threads spin against other jobs
    (150 tiny training steps took 120 s with 2 threads under load, 7 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPTS = ["Q: 1+2=? A:", "Q: 23+45=? A: 6", "Hi", "What is it? The answer is the sum of"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _random_llama(tokenizer, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        initializer_range=0.2,  # peaked distributions: random text with some structure
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return _random_llama(tokenizer, seed=0)


@pytest.fixture(scope="module")
def batch(tokenizer):
    enc = tokenizer(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == len(PROMPTS), "prompts must differ in length"
    return {"input_ids": enc["input_ids"], "input_lengths": lengths}


def _generated(out, batch, b: int) -> list[int]:
    start = int(batch["input_lengths"][b])
    return out["output_ids"][b, start : start + int(out["generation_lengths"][b])].tolist()


def test_engine_implements_generation_interface(model, tokenizer):
    assert isinstance(TorchGenerationEngine(model, tokenizer), GenerationInterface)


def test_greedy_matches_hf_generate_token_for_token(model, tokenizer, batch):
    n = 12
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=n)
    out = engine.generate(batch, greedy=True)
    S = batch["input_ids"].shape[1]
    for b, prompt in enumerate(PROMPTS):
        # Reference: HF generate on the prompt alone (no padding at all).
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in ref:  # HF pads after eos; we stop there
            ref = ref[: ref.index(tokenizer.eos_token_id) + 1]
        assert _generated(out, batch, b) == ref, f"row {b} ({prompt!r})"
        # Prompt copied unchanged, right-padded output, padding after the sequence.
        L = int(batch["input_lengths"][b])
        assert out["output_ids"][b, :L].tolist() == batch["input_ids"][b, :L].tolist()
        end = int(out["unpadded_sequence_lengths"][b])
        assert end == L + int(out["generation_lengths"][b])
        assert (out["output_ids"][b, end:] == tokenizer.pad_token_id).all()
        assert (out["logprobs"][b, :L] == 0).all() and (out["logprobs"][b, end:] == 0).all()
    assert out["output_ids"].shape[1] <= S + n
    # Greedy log-probs are those of the argmax token: the largest log-prob at each position.
    assert (out["logprobs"] <= 0).all()


def _check_teacher_forced(model, out, batch, temperature: float):
    """Assert the engine's log-probs equal a teacher-forced forward over its output (1e-4);
    returns that forward's logits and the mask of generated positions."""
    ids, seq_lens = out["output_ids"], out["unpadded_sequence_lengths"]
    cols = torch.arange(ids.shape[1])
    with torch.no_grad():
        logits = model(ids, attention_mask=(cols < seq_lens[:, None]).long()).logits
    # Contract layout: logprobs[b, t] = log p(ids[b, t] | ids[b, :t]) at the same temperature.
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ref = torch.nn.functional.pad(logp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    gen_mask = (cols >= batch["input_lengths"][:, None]) & (cols < seq_lens[:, None])
    torch.testing.assert_close(out["logprobs"][gen_mask], ref[gen_mask], atol=1e-4, rtol=0)
    return logits, gen_mask


def test_sampled_logprobs_match_teacher_forced_forward(model, tokenizer, batch):
    temperature = 0.7
    engine = TorchGenerationEngine(
        model, tokenizer, temperature=temperature, top_k=20, top_p=0.9, max_new_tokens=10, seed=3
    )
    out = engine.generate(batch)
    logits, gen_mask = _check_teacher_forced(model, out, batch, temperature)
    assert int(gen_mask.sum()) == int(out["generation_lengths"].sum()) > 0
    assert (out["logprobs"][~gen_mask] == 0).all()
    ids = out["output_ids"]
    # Sampling really happened (not argmax everywhere): some token is not the argmax.
    greedy_tokens = logits[:, :-1].argmax(-1)
    assert (greedy_tokens[gen_mask[:, 1:]] != ids[:, 1:][gen_mask[:, 1:]]).any()


def test_top_k_1_and_tiny_top_p_equal_greedy(model, tokenizer, batch):
    greedy = TorchGenerationEngine(model, tokenizer, max_new_tokens=6).generate(batch, True)
    for args in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = TorchGenerationEngine(model, tokenizer, max_new_tokens=6, seed=1, **args)
        assert torch.equal(sampled.generate(batch)["output_ids"], greedy["output_ids"]), args


def test_stop_token_ends_sequence(model, tokenizer, batch):
    base = TorchGenerationEngine(model, tokenizer, max_new_tokens=8).generate(batch, greedy=True)
    free = [_generated(base, batch, b) for b in range(len(PROMPTS))]
    stop_id = free[0][2]  # the third token row 0 generates freely
    out = TorchGenerationEngine(
        model, tokenizer, max_new_tokens=8, stop_token_ids=[stop_id]
    ).generate(batch, greedy=True)
    for b, tokens in enumerate(free):
        got = _generated(out, batch, b)
        if stop_id in tokens:
            assert got == tokens[: tokens.index(stop_id) + 1]
            assert out["finish_reasons"][b] == "stop"
        else:
            assert got == tokens and out["finish_reasons"][b] == "length"
    assert out["finish_reasons"][0] == "stop" and len(_generated(out, batch, 0)) <= 3


def test_all_rows_stopping_ends_the_loop_early(model, tokenizer, batch):
    every_token = list(range(len(tokenizer)))
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=8, stop_token_ids=every_token)
    out = engine.generate(batch, greedy=True)
    assert out["generation_lengths"].tolist() == [1] * len(PROMPTS)
    assert out["output_ids"].shape[1] == batch["input_ids"].shape[1] + 1
    assert out["finish_reasons"] == ["stop"] * len(PROMPTS)


def test_finished_rows_leave_the_batch_and_the_rest_continue_unchanged(model, tokenizer, batch):
    n = 12
    engine = TorchGenerationEngine(model, tokenizer, max_new_tokens=n)
    whole = engine.generate(batch, greedy=True)
    sizes: list[int] = []  # the batch size of every decode forward
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        caps = torch.tensor([1, 2, 3, n])  # rows finish at steps 1, 2, 3; the last runs on
        out = engine.generate({**batch, "max_new_tokens": caps}, greedy=True)
    finally:
        hook.remove()
    assert sizes[0] == len(PROMPTS) and sizes[-1] == 1  # finished rows were dropped
    S = batch["input_ids"].shape[1]
    for b in range(len(PROMPTS)):
        full = _generated(whole, batch, b)
        assert _generated(out, batch, b) == full[: int(caps[b])], f"row {b}"
        L = int(batch["input_lengths"][b])
        got = out["logprobs"][b, L : L + len(_generated(out, batch, b))]
        want = whole["logprobs"][b, L : L + len(got)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert out["output_ids"].shape[1] <= S + n


def test_stop_string_ends_sequence(model, tokenizer, batch):
    base = TorchGenerationEngine(model, tokenizer, max_new_tokens=8).generate(batch, greedy=True)
    free = [_generated(base, batch, b) for b in range(len(PROMPTS))]
    text0 = tokenizer.decode(free[0], skip_special_tokens=True)
    stop = next(c for c in text0[1:] if c.strip()) if len(text0) > 1 else text0
    assert stop, "row 0 generated no visible text; pick other prompts"

    def first_hit(tokens: list[int]) -> int | None:
        for k in range(1, len(tokens) + 1):
            if stop in tokenizer.decode(tokens[:k], skip_special_tokens=True):
                return k
        return None

    out = TorchGenerationEngine(model, tokenizer, max_new_tokens=8, stop_strings=[stop]).generate(
        batch, greedy=True
    )
    for b, tokens in enumerate(free):
        k = first_hit(tokens)
        got = _generated(out, batch, b)
        if k is None:
            assert got == tokens and out["finish_reasons"][b] == "length"
        else:
            assert got == tokens[:k] and out["finish_reasons"][b] == "stop"
    assert out["finish_reasons"][0] == "stop"


def test_max_new_tokens_gives_length(model, tokenizer, batch):
    out = TorchGenerationEngine(model, tokenizer, max_new_tokens=3, stop_token_ids=[]).generate(
        batch, greedy=True
    )
    for b in range(len(PROMPTS)):
        if out["finish_reasons"][b] == "length":
            assert int(out["generation_lengths"][b]) == 3
        else:  # eos reached first
            assert _generated(out, batch, b)[-1] == tokenizer.eos_token_id


def test_sampling_seeded_reproducible_and_seed_dependent(model, tokenizer, batch):
    def run(seed: int) -> torch.Tensor:
        cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=seed)
        return TorchGenerationEngine(model, tokenizer, cfg).generate(batch)["output_ids"]

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def test_update_weights_in_place(tokenizer, batch):
    model_a, model_b = _random_llama(tokenizer, 1), _random_llama(tokenizer, 2)
    engine = TorchGenerationEngine(model_a, tokenizer, max_new_tokens=6)
    before = engine.generate(batch, greedy=True)["output_ids"]
    expected = TorchGenerationEngine(model_b, tokenizer, max_new_tokens=6).generate(batch, True)
    assert not torch.equal(before, expected["output_ids"])
    engine.update_weights(model_b.state_dict())
    assert engine.model is model_a  # same module, new values
    assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], expected["output_ids"])
    with pytest.raises(KeyError, match="model.no_such.weight"):
        engine.update_weights({"model.no_such.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})


def test_in_flight_update_loads_between_decode_steps_and_tokens_record_it(tokenizer, batch):
    """Async GRPO's in-flight weight updates: weights committed while a generation runs load
    at the next boundary between decode steps, never inside a forward; each token records
    the version that produced it; staged weights alone change nothing."""
    model_b = _random_llama(tokenizer, 2)
    reference = TorchGenerationEngine(_random_llama(tokenizer, 1), tokenizer, max_new_tokens=8)
    before = reference.generate(batch, greedy=True)
    engine = TorchGenerationEngine(_random_llama(tokenizer, 1), tokenizer, max_new_tokens=8)
    engine.in_flight = True
    names = list(model_b.state_dict())
    engine.stage_weights({n: model_b.state_dict()[n] for n in names[: len(names) // 2]})
    engine.stage_weights({n: model_b.state_dict()[n] for n in names[len(names) // 2 :]})
    assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], before["output_ids"])

    forwards = []

    def commit_during_the_third_forward(module, args, kwargs, output):
        forwards.append(1)
        if len(forwards) == 3:  # prefill -> token 0, decode forwards -> tokens 1, 2 (...)
            engine.commit_weights(1)

    hook = engine.model.register_forward_hook(commit_during_the_third_forward, with_kwargs=True)
    try:
        out = engine.generate(batch, greedy=True)
    finally:
        hook.remove()
    assert engine.weight_version == 1
    for name, value in model_b.state_dict().items():  # all of the new weights, loaded
        assert torch.equal(engine.model.state_dict()[name], value), name
    versions = out["token_weight_versions"]
    long_rows = 0
    for b in range(len(PROMPTS)):
        start, n = int(batch["input_lengths"][b]), int(out["generation_lengths"][b])
        assert (versions[b, :start] == -1).all() and (versions[b, start + n :] == -1).all()
        expected = [0] * min(n, 3) + [1] * max(n - 3, 0)  # token 3 on: the new weights
        assert versions[b, start : start + n].tolist() == expected, b
        # Tokens 0-2 are the old weights' (as without a refit); later ones differ.
        k = min(n, 3)
        assert _generated(out, batch, b)[:k] == _generated(before, batch, b)[:k]
        torch.testing.assert_close(
            out["logprobs"][b, start : start + k], before["logprobs"][b, start : start + k]
        )
        if n > 3 and int(before["generation_lengths"][b]) > 3:
            long_rows += 1
            assert not torch.allclose(
                out["logprobs"][b, start + 3 : start + 4],
                before["logprobs"][b, start + 3 : start + 4],
            ), b
    assert long_rows >= 1
    # No generation running: a commit loads at once.
    engine.stage_weights(_random_llama(tokenizer, 1).state_dict())
    engine.commit_weights(2)
    assert engine.weight_version == 2
    assert torch.equal(engine.generate(batch, greedy=True)["output_ids"], before["output_ids"])


def test_invalid_sampling_config_names_every_problem():
    with pytest.raises(ValueError) as e:
        SamplingConfig(temperature=0, top_p=1.5, max_new_tokens=0)
    assert "temperature=0" in str(e.value) and "top_p=1.5" in str(e.value)
    assert "max_new_tokens=0" in str(e.value)


def test_cpu_inference_set_up_computes_the_same_function(tokenizer, batch):
    """optimize_for_cpu_inference (oneDNN-packed linears, grouped attention with a padding
    mask) changes how the model computes, not what: greedy tokens equal and log-probs within
    1e-5 of the untouched model on padded prompts (the mask path), also after new weights
    arrive in place (a refit: a stale packed copy would keep the old model's answers), and a
    forward with autograd still trains through plain F.linear."""
    import copy

    from tempering.models.generation.cpu_inference import (
        CPU_SDPA,
        PackedLinear,
        optimize_for_cpu_inference,
    )

    plain, other = _random_llama(tokenizer, 3), _random_llama(tokenizer, 4)
    fast = copy.deepcopy(plain)
    done = optimize_for_cpu_inference(fast, min_weights=0, pack_after=0)  # packed at once
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert done == {
        "packed_linear_layers": n_linear,
        "fused_projections": 2 * plain.config.num_hidden_layers,  # q/k/v and gate/up
        "cpu_sdpa": 1,
        "decode_attention_by_matmul": 0,
    }
    assert isinstance(fast.model.layers[0].self_attn.q_proj, PackedLinear)
    fusions = [
        fast.model.layers[0].self_attn.q_proj.fusion,
        fast.model.layers[0].mlp.up_proj.fusion,
    ]
    assert fast.config._attn_implementation == CPU_SDPA
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads  # grouped

    def both(model_a, model_b):
        args = {"max_new_tokens": 8}
        a = TorchGenerationEngine(model_a, tokenizer, **args).generate(batch, greedy=True)
        b = TorchGenerationEngine(model_b, tokenizer, **args).generate(batch, greedy=True)
        assert torch.equal(a["output_ids"], b["output_ids"])
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
        return a

    before = both(fast, plain)
    shared = [f.shared for f in fusions]
    assert all(n > 0 for n in shared)  # members were served from their lead's product
    TorchGenerationEngine(fast, tokenizer).update_weights(other.state_dict())
    after = both(fast, other)
    assert not torch.equal(before["output_ids"], after["output_ids"])  # the refit took
    assert all(f.shared > n for f, n in zip(fusions, shared, strict=True))

    ids = batch["input_ids"]
    fast.train()
    other.train()
    loss_fast = fast(ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits.sum()
    loss_plain = other(ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits.sum()
    loss_fast.backward()
    loss_plain.backward()
    q_fast, q_plain = fast.model.layers[0].self_attn.q_proj, other.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q_fast.weight.grad, q_plain.weight.grad, atol=1e-4, rtol=1e-4)


def test_fused_projections_share_one_product_only_for_the_same_input():
    """Sibling packed layers (q/k/v) fused: each member's output is its own layer's function
    of its own weight and bias; members take the lead's parts only when called on the very
    tensor the lead multiplied, unchanged since, and after ``pack_after`` calls with every
    member's weights unchanged; a member's refit drops the fused matrix."""
    import copy

    from tempering.models.generation.cpu_inference import FusedProjections, PackedLinear

    torch.manual_seed(0)
    plain = [torch.nn.Linear(64, n) for n in (48, 16, 16)]
    layers = [PackedLinear(copy.deepcopy(linear)) for linear in plain]
    fusion = FusedProjections(layers, pack_after=1)
    x, y = torch.randn(5, 64), torch.randn(5, 64)

    def check(inputs, shared):
        before = fusion.shared
        for layer, linear, inp in zip(layers, plain, inputs, strict=True):
            torch.testing.assert_close(layer(inp), linear(inp), atol=1e-5, rtol=1e-5)
        assert fusion.shared - before == shared

    with torch.inference_mode():
        check([x, x, x], 0)  # the first lead call: each layer alone (pack_after=1)
        assert not fusion.is_packed
        check([x, x, x], 2)
        assert fusion.is_packed
        check([x, y, x], 1)  # another input: that member computes alone
        check([y, x, x], 0)  # the lead multiplied y: nothing kept for x
    with torch.no_grad():
        x.mul_(2.0)  # the same tensor changed in place after the lead's call below
    with torch.inference_mode():
        layers[0](x)
    with torch.no_grad():
        x.add_(1.0)
    with torch.inference_mode():
        torch.testing.assert_close(layers[1](x), plain[1](x), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            layers[2].weight.mul_(-1.0)  # a refit of one member
            plain[2].weight.mul_(-1.0)
        assert not fusion.is_packed
        check([x, x, x], 0)
        check([x, x, x], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_attention_by_matmul_is_grouped_sdpa(dtype, masked):
    """One query token a row by two matmuls: SDPA's result (with enable_gqa, so query head h
    reads key/value head h // group) in fp32 to 1e-5 and in bf16 to bf16 rounding, with a
    boolean padding mask or none, and a masked position changes the answer (the mask is
    applied, not dropped)."""
    import torch.nn.functional as F

    from tempering.models.generation.cpu_inference import decode_attention_by_matmul

    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, positions, dim = 5, 6, 2, 37, 16
    query = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype)
    key, value = (
        torch.randn(rows, kv_heads, positions, dim, generator=gen).to(dtype) for _ in "kv"
    )
    keep = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    keep[1, ..., :9] = keep[3, ..., :20] = False
    mask = keep if masked else None
    scale = 0.3
    want = F.scaled_dot_product_attention(
        *(t.float() for t in (query, key, value)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    got = decode_attention_by_matmul(query, key, value, mask, scale)
    assert got.dtype == dtype and got.shape == query.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    if mask is not None:
        unmasked = decode_attention_by_matmul(query, key, value, None, scale)
        assert (unmasked.float() - want)[[1, 3]].abs().max() > 10 * tol


def test_engine_decodes_the_same_by_matmuls(tokenizer, batch, monkeypatch):
    """A model switched to CPU_SDPA_DECODE_MATMUL generates what the untouched one does on
    padded prompts (greedy tokens equal, log-probs within 1e-5 in fp32), its decode steps going
    through the matmuls (counted) and its prefill through SDPA; fp32 is never switched by the
    timing (`decode_matmul_wins`), and a bf16 model's set-up reports the timing's choice."""
    import copy

    from tempering.models.generation import cpu_inference

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return decode_attention_by_matmul(*args, **kwargs)

    decode_attention_by_matmul = cpu_inference.decode_attention_by_matmul
    monkeypatch.setattr(cpu_inference, "decode_attention_by_matmul", counted)
    plain = _random_llama(tokenizer, 3)
    fast = copy.deepcopy(plain)
    assert cpu_inference.use_cpu_sdpa(fast, decode_by_matmul=True) == (
        cpu_inference.CPU_SDPA_DECODE_MATMUL
    )
    args = {"max_new_tokens": 6}
    a = TorchGenerationEngine(fast, tokenizer, **args).generate(batch, greedy=True)
    b = TorchGenerationEngine(plain, tokenizer, **args).generate(batch, greedy=True)
    assert torch.equal(a["output_ids"], b["output_ids"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    assert calls and all(shape[2] == 1 for shape in calls)  # decode steps only
    layers = plain.config.num_hidden_layers
    assert len(calls) >= layers * (args["max_new_tokens"] - 1) // 2

    # bf16: the cache holds fp32 keys and values for the matmuls (prefill casts them back for
    # SDPA); the same tokens as SDPA decoding, log-probs to bf16 rounding
    bf16_plain, bf16_fast = plain.bfloat16(), fast.bfloat16()
    a = TorchGenerationEngine(bf16_fast, tokenizer, **args).generate(batch, greedy=True)
    b = TorchGenerationEngine(bf16_plain, tokenizer, **args).generate(batch, greedy=True)
    assert torch.equal(a["output_ids"], b["output_ids"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=2e-2, rtol=2e-2)
    assert cpu_inference.cache_dtype(bf16_fast) == torch.float32
    assert cpu_inference.cache_dtype(bf16_plain) is None

    config = plain.config
    shape = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert not cpu_inference.decode_matmul_wins(torch.float32, *shape)
    done = cpu_inference.optimize_for_cpu_inference(copy.deepcopy(plain))
    wins = cpu_inference.decode_matmul_wins(torch.bfloat16, *shape)
    assert done["decode_attention_by_matmul"] == int(wins)


def test_bf16_layers_are_packed_only_where_the_cpu_computes_bf16(tokenizer, batch):
    """A bf16 sampler's linears go through oneDNN where the CPU multiplies bf16 natively
    (AVX512-BF16 / AMX: about 2x F.linear for SmolLM2's layers at 16 rows) and stay on F.linear
    where oneDNN would emulate bf16. Packed or not, the model computes the same function: the
    logits of padded prompts agree with the untouched bf16 model to bf16 rounding, also after
    new weights arrive in place (a stale packed copy would keep the old model's logits)."""
    import copy

    from tempering.models.generation.cpu_inference import (
        PackedLinear,
        native_bf16_cpu,
        optimize_for_cpu_inference,
    )

    plain, other = _random_llama(tokenizer, 3).bfloat16(), _random_llama(tokenizer, 4).bfloat16()
    fast = copy.deepcopy(plain)
    done = optimize_for_cpu_inference(fast, pack_after=0)  # bf16: every size, packed at once
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    packed = isinstance(fast.model.layers[0].mlp.down_proj, PackedLinear)
    assert packed == native_bf16_cpu()
    assert done["packed_linear_layers"] == (n_linear if packed else 0)
    ids = batch["input_ids"]
    mask = (ids != tokenizer.pad_token_id).long()

    def logits(model):
        with torch.inference_mode():
            return model(ids, attention_mask=mask).logits.float() * mask[..., None]

    torch.testing.assert_close(logits(fast), logits(plain), atol=0.05, rtol=0.02)
    TorchGenerationEngine(fast, tokenizer).update_weights(other.state_dict())
    torch.testing.assert_close(logits(fast), logits(other), atol=0.05, rtol=0.02)
    assert (logits(fast) - logits(plain)).abs().max() > 0.5  # the refit took


def test_linear_layers_pack_only_where_and_when_the_reorder_pays(tokenizer, batch):
    """oneDNN's reorder of a weight costs more than a short generation gains (the main job:
    repacking its layers after every refit made a 21 ms generation 31 ms). fp32 layers under
    PACK_MIN_WEIGHTS stay plain `nn.Linear` (slower packed); a packed layer computes with
    F.linear until its weight has served ``pack_after`` forwards unchanged, then from the
    packed copy, and a weight changed in place starts the count again -- the output is the
    layer's function of its current weight throughout."""
    import copy

    from tempering.models.generation.cpu_inference import (
        PACK_MIN_WEIGHTS,
        PackedLinear,
        optimize_for_cpu_inference,
    )

    small = _random_llama(tokenizer, 3)  # 64 x 64 .. 128 x 64 weights
    assert (
        max(m.weight.numel() for m in small.modules() if isinstance(m, torch.nn.Linear))
        < (PACK_MIN_WEIGHTS[torch.float32])
    )
    assert optimize_for_cpu_inference(copy.deepcopy(small))["packed_linear_layers"] == 0

    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 32)
    layer = PackedLinear(copy.deepcopy(plain), pack_after=2)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        for call in range(1, 5):
            torch.testing.assert_close(layer(x), plain(x), atol=1e-5, rtol=1e-5)
            assert layer.is_packed == (call > 2), call
        layer.weight.mul_(-1.0)  # a refit in place: the packed copy is stale
        plain.weight.mul_(-1.0)
        assert not layer.is_packed
        for call in range(1, 4):
            torch.testing.assert_close(layer(x), plain(x), atol=1e-5, rtol=1e-5)
            assert layer.is_packed == (call > 2), call


def test_rows_sharing_a_prompt_are_prefilled_once(model, tokenizer):
    """A GRPO group's rows share their prompt: the prefill runs once per distinct prompt and
    its cache is copied to each row. Greedy rows of a group equal the prompt generated alone,
    sampled rows differ from each other, and every sampled log-prob equals a teacher-forced
    forward over the finished sequence."""
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[3]]
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    grouped = {"input_ids": enc["input_ids"], "input_lengths": enc["attention_mask"].sum(1)}
    sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        greedy = TorchGenerationEngine(model, tokenizer, max_new_tokens=8).generate(grouped, True)
    finally:
        hook.remove()
    assert sizes[0] == 3  # three distinct prompts prefilled, six rows decoded
    assert sizes[1] == len(prompts)
    for b, prompt in enumerate(prompts):
        alone = tokenizer([prompt], add_special_tokens=False, return_tensors="pt")["input_ids"]
        one = {"input_ids": alone, "input_lengths": torch.tensor([alone.shape[1]])}
        ref = TorchGenerationEngine(model, tokenizer, max_new_tokens=8).generate(one, True)
        assert _generated(greedy, grouped, b) == _generated(ref, one, 0), f"row {b}"

    temperature = 1.0
    out = TorchGenerationEngine(
        model, tokenizer, temperature=temperature, max_new_tokens=10, seed=5
    ).generate(grouped)
    assert _generated(out, grouped, 0) != _generated(out, grouped, 1) or _generated(
        out, grouped, 0
    ) != _generated(out, grouped, 3)
    _check_teacher_forced(model, out, grouped, temperature)


def test_inverse_cdf_sampling_follows_the_distribution():
    """One uniform draw per row, inverted through the row's cumulative distribution: token
    frequencies over 40,000 draws match the probabilities (within 0.01), and a token of
    probability 0 -- first, inside or last -- is never drawn."""
    from tempering.models.generation.torch_engine import _inverse_cdf_sample

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([_inverse_cdf_sample(probs.expand(4000, -1), generator) for _ in range(10)])
    freq = torch.bincount(draws, minlength=len(probs)).float() / len(draws)
    assert freq[probs == 0].sum() == 0
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_bf16_refits_round_without_bias_along_the_update(tokenizer):
    """fp32 weights sitting exactly halfway between two bf16 values (8% of SmolLM2's, from
    GGUF) round to nearest one way; a small update moves each such tie across in the update's
    direction, so rounding to nearest moves the bf16 copy ~half a bf16 step per tie along the
    gradient (measured: the SmolLM2 sampler/trainer mismatch 1.03 -> 1.24 after one lr 1e-6
    step). `cast_for_sampling` rounds with a fixed per-element draw: the copy moves by the
    update in expectation, values on the bf16 grid stay exact, and the same weights give the
    same copy; the engine's refit and the policy's bf16 buckets both round that way."""
    from tempering.models.generation.refit import cast_for_sampling
    from tempering.models.policy.weight_streaming import _in_dtype

    gen = torch.Generator().manual_seed(0)
    grid = (torch.randn(50_000, generator=gen) * 0.03).bfloat16().float()
    ties = (grid.view(torch.int32) | 0x8000).view(torch.float32)  # halfway to the next value
    step = 1e-6 * torch.randn(ties.shape, generator=gen).sign()  # an Adam-like update

    def moved(cast):  # the bf16 copy's mean move along the update, in units of the update
        return float(((cast(ties + step) - cast(ties)) * step.sign()).mean() / 1e-6)

    assert moved(lambda x: x.bfloat16().float()) > 30  # nearest: a leap along the update
    ours = lambda x: cast_for_sampling(x, torch.bfloat16, "w").float()  # noqa: E731
    assert 0.5 < moved(ours) < 1.5  # the update itself
    assert torch.equal(ours(grid), grid)  # exact on the grid
    assert torch.equal(ours(ties + step), ours(ties + step))  # deterministic
    assert cast_for_sampling(ties, torch.float16, "w").dtype == torch.float16  # others: torch's
    assert torch.equal(
        _in_dtype(ties, "bfloat16", "w"), cast_for_sampling(ties, torch.bfloat16, "w")
    )

    model = _random_llama(tokenizer, 1).bfloat16()
    name = "model.norm.weight"
    values = ties[: model.state_dict()[name].numel()] + step[: model.state_dict()[name].numel()]
    TorchGenerationEngine(model, tokenizer).update_weights({name: values})
    assert torch.equal(model.state_dict()[name], cast_for_sampling(values, torch.bfloat16, name))


def test_a_generation_worker_decodes_with_the_runs_tokenizer(tmp_path):
    """`policy.tokenizer.name` reaches the split torch workers: a model folder holding weights
    only (no tokenizer) failed in the worker, which read the tokenizer from the model folder."""
    import shutil

    from tempering.models.generation.torch_worker import TorchGenerationWorker
    from tempering.models.hf import load_tokenizer
    from tempering.models.registry import resolve_model_path

    weights_only = tmp_path / "weights_only"
    shutil.copytree(resolve_model_path("tiny-arith"), weights_only,
                    ignore=shutil.ignore_patterns("tokenizer*", "chat_template.jinja"))  # fmt: skip
    with pytest.raises(ValueError):  # the folder alone has no tokenizer to decode with
        load_tokenizer(weights_only)
    sampling = {"max_new_tokens": 4}
    worker = TorchGenerationWorker(str(weights_only), sampling, tokenizer_path="tiny-arith")
    reference = TorchGenerationWorker("tiny-arith", sampling)
    tokenizer = load_tokenizer("tiny-arith")
    ids = tokenizer(["Q: 23+45=? A:"], return_tensors="pt")["input_ids"]
    batch = {"input_ids": ids, "input_lengths": torch.tensor([ids.shape[1]])}
    got, want = worker.generate(batch, greedy=True), reference.generate(batch, greedy=True)
    assert torch.equal(got["output_ids"], want["output_ids"])
    assert worker.tokenizer.eos_token_id == tokenizer.eos_token_id
