"""The re-pack after an in-place vLLM reload on CPU (`vllm_extension._repack_tied_layers`),
on stand-in layers shaped like vLLM's: the real engine is in the slow tier
(tests/functional/test_family_vllm.py), where a tied lm_head computed stale logits without it.

A layer keeps its weight beside a packed copy (``cpu_linear``); the reload gives every layer it
loaded a new copy. A tied lm_head shares the embedding's weight but loads nothing, so only a
layer on the same storage as a renewed one, whose own copy did not change, is processed again.
"""

from __future__ import annotations

import torch

from tempering.models.generation.vllm_extension import _repack_tied_layers


class _Method:
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = ("packed", layer.weight.detach().clone())


def _layer(weight: torch.nn.Parameter) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = weight
    layer.quant_method = _Method()
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_only_a_layer_sharing_a_reloaded_weight_is_repacked():
    shared = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    embed, head = _layer(shared), _layer(shared)  # tied: one parameter, two layers
    other = _layer(torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False))
    before = {m: m.cpu_linear for m in (embed, head, other)}
    old_head_copy = head.cpu_linear

    shared.data.copy_(torch.ones(4, 3))  # the reload: new values in place...
    embed.quant_method.process_weights_after_loading(embed)  # ...and the loaded layer re-packed

    assert _repack_tied_layers(before) == 1
    assert head.cpu_linear is not old_head_copy and torch.equal(head.cpu_linear[1], shared)
    assert other.cpu_linear is before[other]  # untouched storage: left alone
    assert _repack_tied_layers({m: m.cpu_linear for m in (embed, head, other)}) == 0
