"""Norm outputs recomputed in backward (tempering/models/policy/norm_recompute.py): loss and
gradients bit-identical to plain autograd, and the norm outputs no longer held by the graph
after the forward, for every registered family, full weights and LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tempering.models.families import FAMILIES, tiny_model
from tempering.models.policy.norm_recompute import NORM_CLASS_SUFFIXES, recompute_norm_outputs


def _model(family: str) -> torch.nn.Module:
    return tiny_model(family).train()


def _held_norm_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes of decoder norm outputs still alive once the forward returned
    (held by the autograd graph: nothing else keeps them)."""
    refs = []

    def keep(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        refs.append((StorageWeakRef(output.untyped_storage()), output.untyped_storage().nbytes()))

    handles = [
        m.register_forward_hook(keep)
        for layer in model.model.layers
        for m in layer.modules()
        if type(m).__name__.endswith(NORM_CLASS_SUFFIXES)
    ]
    loss = model(input_ids=ids, labels=ids).loss
    for h in handles:
        h.remove()
    return loss, sum(n for ref, n in refs if not ref.expired())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_gradients_and_norm_outputs_not_held(family: str, lora: bool) -> None:
    plain = _model(family)
    if lora:
        from peft import LoraConfig
        from peft.tuners.lora import LoraModel

        LoraModel(plain, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), "default")
        for name, param in plain.named_parameters():
            param.requires_grad_("lora_" in name)
            if "lora_B" in name:  # nonzero, so the adapters' gradients reach everything
                torch.nn.init.normal_(param, std=0.02)
    lean = copy.deepcopy(plain)
    layers = list(lean.model.layers)
    assert recompute_norm_outputs(layers) == len(layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, plain.config.vocab_size, (2, 12), generator=g)

    plain_loss, plain_held = _held_norm_bytes(plain, ids)
    lean_loss, lean_held = _held_norm_bytes(lean, ids)
    plain_loss.backward()
    lean_loss.backward()
    assert torch.equal(plain_loss, lean_loss)
    for (name, p), q in zip(plain.named_parameters(), lean.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    # the norms feeding linear layers (attention's, the MLP's): held before, not after
    one = ids.numel() * plain.config.hidden_size * 4
    assert plain_held >= 2 * len(layers) * one
    assert lean_held == 0


def test_backward_twice_and_no_grad() -> None:
    plain, lean = _model("llama3"), None
    lean = copy.deepcopy(plain)
    recompute_norm_outputs(list(lean.model.layers))
    ids = torch.arange(3, 15).reshape(1, 12)
    a, b = plain(input_ids=ids, labels=ids).loss, lean(input_ids=ids, labels=ids).loss
    a.backward(retain_graph=True)
    a.backward()
    b.backward(retain_graph=True)
    b.backward()  # the second backward recomputes again
    for p, q in zip(plain.parameters(), lean.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, lean(input_ids=ids).logits)


def test_an_input_modified_in_place_is_named_not_recomputed_wrong() -> None:
    norm = torch.nn.LayerNorm(4)
    layer = torch.nn.Sequential(norm)
    layer.out = torch.nn.Linear(4, 4)
    layer.forward = lambda x: layer.out(norm(x))
    assert recompute_norm_outputs([layer]) == 1
    assert recompute_norm_outputs([layer]) == 1  # twice: installed once
    x = torch.randn(2, 4)  # needs no gradient: autograd keeps no version check of its own
    y = layer(x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="LayerNorm's input was modified in place"):
        y.sum().backward()


def test_hidden_states_under_min_bytes_keep_their_norm_outputs() -> None:
    plain = _model("llama3")
    ids = torch.arange(3, 15).reshape(1, 12)
    one = ids.numel() * plain.config.hidden_size * 4  # one norm output's bytes
    kept, lean = copy.deepcopy(plain), copy.deepcopy(plain)
    layer_norms = 2  # llama: before attention and before the MLP
    recompute_norm_outputs(list(kept.model.layers), min_bytes=layer_norms * one + 1)
    recompute_norm_outputs(list(lean.model.layers), min_bytes=layer_norms * one)
    plain_loss, plain_held = _held_norm_bytes(plain, ids)
    kept_loss, kept_held = _held_norm_bytes(kept, ids)
    _, lean_held = _held_norm_bytes(lean, ids)
    assert kept_held == plain_held >= 2 * len(plain.model.layers) * one
    assert lean_held == 0
    assert torch.equal(plain_loss, kept_loss)
