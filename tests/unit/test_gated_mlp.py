"""Gated MLPs keep two activations for backward (tempering/models/policy/gated_mlp.py): the
same loss and gradients as plain autograd, one [tokens, intermediate] tensor fewer saved per
layer, for every registered family whose MLP is gated."""

from __future__ import annotations

import copy

import pytest
import torch

from tempering.models.families import FAMILIES, tiny_model
from tempering.models.policy.gated_mlp import gated_product, use_lean_gated_mlp


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s result and the bytes of distinct storages autograd saved while running it."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _model(family: str) -> torch.nn.Module:
    return tiny_model(family).train()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_gradients_and_fewer_saved_bytes(family: str) -> None:
    plain = _model(family)
    lean = copy.deepcopy(plain)
    changed = use_lean_gated_mlp(lean)
    if family == "qwen3_moe":  # routed experts: their own forward, left as they are
        assert sum(changed.values()) == 0
        return
    layers = plain.config.num_hidden_layers
    assert sum(changed.values()) == layers
    ids = torch.randint(
        3, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )

    def loss(model: torch.nn.Module):
        return lambda: model(input_ids=ids, labels=ids).loss

    plain_loss, plain_bytes = _saved_bytes(loss(plain))
    lean_loss, lean_bytes = _saved_bytes(loss(lean))
    plain_loss.backward()
    lean_loss.backward()
    assert torch.equal(plain_loss, lean_loss)
    for (name, p), q in zip(plain.named_parameters(), lean.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # one fp32 [tokens, intermediate] tensor less per layer: act(gate(x)) is recomputed
    assert plain_bytes - lean_bytes == layers * ids.numel() * plain.config.intermediate_size * 4


@pytest.mark.parametrize(
    "act", [torch.nn.functional.silu, torch.nn.GELU(approximate="tanh"), torch.tanh],
    ids=["silu", "gelu-tanh", "other"],  # the last through autograd, not an aten kernel
)  # fmt: skip
def test_gated_product_gradients(act) -> None:
    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(3))
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (act(a) * b).backward(grad)
    c, d = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = gated_product(c, d, act)
    out.backward(grad)
    assert torch.equal(out, act(gate) * up)
    assert torch.equal(a.grad, c.grad) and torch.equal(b.grad, d.grad)
    # only the gate needs a gradient (a frozen up projection): no gradient computed for up
    e = gate.clone().requires_grad_()
    gated_product(e, up, act).backward(grad)
    assert torch.equal(e.grad, a.grad)
    assert torch.autograd.gradcheck(lambda x, y: gated_product(x, y, act), (c, d))


def test_no_grad_takes_the_plain_path() -> None:
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        out = gated_product(gate.requires_grad_(), up, torch.nn.functional.silu)
    assert out.grad_fn is None and torch.equal(out, torch.nn.functional.silu(gate) * up)


def test_a_gate_under_min_bytes_is_kept_by_plain_autograd() -> None:
    gate = torch.randn(3, 4, requires_grad=True)  # 48 bytes
    up = torch.randn(3, 4)
    silu = torch.nn.functional.silu
    lean, kept = gated_product(gate, up, silu, min_bytes=48), gated_product(gate, up, silu, 49)
    assert type(lean.grad_fn).__name__ == "_GatedProductBackward"
    assert type(kept.grad_fn).__name__ == "MulBackward0"
    assert torch.equal(lean, kept)
    # the model's rebinding reads the threshold it was installed with
    plain = _model("llama3")
    use_lean_gated_mlp(plain, min_bytes=1 << 40)
    ids = torch.arange(3, 15).reshape(1, 12)
    _, held = _saved_bytes(lambda: plain(input_ids=ids, labels=ids).loss)
    lean_model = _model("llama3")
    use_lean_gated_mlp(lean_model)
    _, lean_held = _saved_bytes(lambda: lean_model(input_ids=ids, labels=ids).loss)
    layers = plain.config.num_hidden_layers
    assert held - lean_held == layers * ids.numel() * plain.config.intermediate_size * 4
