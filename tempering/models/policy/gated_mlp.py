"""Gated MLPs that keep two activations for backward instead of three.

A gated MLP -- ``down(act(gate(x)) * up(x))`` in Llama, Qwen, Mistral, Gemma and (from one
fused ``gate_up`` projection) Phi-3 -- run by plain autograd keeps, per layer and token,
``gate(x)`` (for the activation's backward), ``act(gate(x))`` and ``up(x)`` (for the
product's): three ``[tokens, intermediate]`` tensors, the widest a decoder layer saves.
`gated_product` keeps ``gate(x)`` and ``up(x)`` and recomputes ``act(gate(x))`` in backward
(one elementwise pass): SmolLM2-135M, a 4 x 384-token micro-batch, 9 MiB less per layer,
270 MiB of its 1.78 GiB of saved activations. The same operations in the same order, so
gradients are unchanged (tests/unit/test_gated_mlp.py). The product itself stays saved by
``down`` (its weight gradient, or a LoRA adapter's). A call whose activation is under
``min_bytes`` (`model_setup.LEAN_MIN_BYTES`: a tiny model's) takes autograd's plain path: the
recompute's per-call costs would outweigh the few MiB.

`use_lean_gated_mlp` rebinds ``forward`` of the MLP modules whose forward is one of the two
shapes above (by class, `LLAMA_STYLE` / `FUSED_GATE_UP`); any other module keeps its own,
and the count of each is logged. No-grad passes (log-probs, generation) take the plain path.
"""

from __future__ import annotations

import logging
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# HF classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
LLAMA_STYLE = frozenset(
    {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP",
     "GemmaMLP", "Gemma2MLP", "Gemma3MLP"}
)  # fmt: skip
# ... and ``gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * activation_fn(gate))``
FUSED_GATE_UP = frozenset({"Phi3MLP"})


class _GatedProduct(torch.autograd.Function):
    """``act(gate) * up``, saving ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, act: Callable) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gate, up = ctx.saved_tensors
        kernel = _backward_kernel(ctx.act)
        grad_gate = grad_up = None
        if kernel is not None:  # aten's kernel, as autograd calls it: no nested autograd call
            if ctx.needs_input_grad[0]:
                grad_gate = kernel(grad * up, gate)
            if ctx.needs_input_grad[1]:
                grad_up = grad * ctx.act(gate)
            return grad_gate, grad_up, None
        with torch.enable_grad():
            leaf = gate.detach().requires_grad_()
            activated = ctx.act(leaf)
        if ctx.needs_input_grad[0]:  # autograd's own order: (grad * up), then act's backward
            (grad_gate,) = torch.autograd.grad(activated, leaf, grad * up)
        if ctx.needs_input_grad[1]:
            grad_up = grad * activated.detach()
        return grad_gate, grad_up, None


def _backward_kernel(act: Callable) -> Callable | None:
    """The aten backward of the activations the families use (a nested ``autograd.grad`` per
    layer cost tiny-arith's step ~5%); None for any other (recomputed through autograd)."""
    name = type(act).__name__
    if act is torch.nn.functional.silu or name in ("SiLU", "SiLUActivation"):
        return torch.ops.aten.silu_backward
    inner = getattr(act, "act", None)  # transformers' GELUTanh: F.gelu(approximate="tanh")
    tanh_gelu = (name == "GELU" and getattr(act, "approximate", None) == "tanh") or (
        name == "GELUTanh" and getattr(inner, "func", None) is torch.nn.functional.gelu
    )
    if tanh_gelu:
        return lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
    return None


def gated_product(
    gate: torch.Tensor, up: torch.Tensor, act: Callable, min_bytes: int = 0
) -> torch.Tensor:
    """``act(gate) * up``; with autograd recording and ``gate`` at least ``min_bytes``, its
    backward recomputes ``act(gate)`` (a smaller one is kept: see `use_lean_gated_mlp`)."""
    recording = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if recording and gate.nbytes >= min_bytes:
        return _GatedProduct.apply(gate, up, act)
    return act(gate) * up


def _llama_style_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(gated_product(gate, up, self.act_fn, self._lean_min_bytes))


def _fused_gate_up_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gated_product(gate, up, self.activation_fn, self._lean_min_bytes))


def use_lean_gated_mlp(model: torch.nn.Module, min_bytes: int = 0) -> Counter:
    """Rebind the gated MLPs' ``forward`` (see module doc); returns and logs what changed, by
    class (``{"LlamaMLP": 30}``), and the MLP-named modules left as they are. A call whose
    ``[tokens, intermediate]`` activation is under ``min_bytes`` keeps it (autograd's plain
    path): the recompute's fixed costs buy nothing there (`model_setup.LEAN_MIN_BYTES`)."""
    changed: Counter = Counter()
    left: Counter = Counter()
    for module in model.modules():
        name = type(module).__name__
        if name in LLAMA_STYLE or name in FUSED_GATE_UP:
            forward = _llama_style_forward if name in LLAMA_STYLE else _fused_gate_up_forward
            module.forward = types.MethodType(forward, module)
            module._lean_min_bytes = min_bytes
            changed[name] += 1
        elif name.endswith(("MLP", "Experts")):
            left[name] += 1
    if changed or left:
        logger.info(
            "gated MLPs keep two activations for backward (where one is >= %d bytes): %s%s",
            min_bytes, dict(changed) or "none",
            f"; left as they are (their own forward): {dict(left)}" if left else "",
        )  # fmt: skip
    return changed
