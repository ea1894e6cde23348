"""The policy rank's weights for generation engines (refit): whole, or streamed in buckets.

A component of `FSDP2PolicyWorker`, reached as its ``refit`` attribute, so a controller names
it in full: ``run_all_workers_single_data("refit.buckets", bucket_bytes)`` (the worker group's
``execute`` resolves dotted names). `tempering.models.generation.refit.stream_weights` drives
it through `Policy.refit`: the ranks agree on layer-aligned buckets (`buckets`), then for each
bucket every rank joins the all-gathers and rank 0 puts the gathered tensors, cast to the
engine's dtype, into Ray's object store (`bucket`). With LoRA the engines receive merged
weights under the model's own names (`PolicyState.hf_weights`); a bucket holds a whole
decoder layer, so each adapter arrives with its base weight. A vLLM engine can take the
adapters alone instead (`adapter`, for ``vllm_cfg.lora_adapter_refit``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tempering.models.generation.refit import cast_for_sampling
from tempering.models.policy.model_setup import PolicyState, full_tensor


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full parameters on rank 0 (CPU); empty on the other ranks. Collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


class WeightStreamer:
    """The policy's weights (this rank's shard of them) as rank 0 hands them out."""

    def __init__(self, state: PolicyState) -> None:
        self.state = state
        self.tied = tied_names(state.model)  # the module tree's, so every rank agrees

    def state_dict(self, dtype: str | None = None) -> dict[str, torch.Tensor] | None:
        """Full CPU tensors by HF name on rank 0 (None elsewhere), optionally cast to `dtype`."""
        sd = full_state_dict(self.state.model)
        if self.state.topo.rank != 0:
            return None
        return self._cast(self.state.hf_weights(sd), dtype)

    def buckets(self, bucket_bytes: int) -> list[list[str]]:
        """State-dict names in buckets of at most ``bucket_bytes`` (fp32 size), cut only
        between decoder layers (`refit.py`); the same on every rank."""
        buckets: list[list[str]] = []
        current: list[str] = []
        size, layer = 0, None
        # A tied lm_head is sent too: vLLM on CPU repacks it apart from embed_tokens, so
        # loading embed_tokens alone left it stale (log-probs off by 3e-3, test_grpo).
        for name, tensor in self.state.model.state_dict().items():
            this_layer = _layer_of(name)
            nbytes = tensor.numel() * 4
            if current and this_layer != layer and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
            layer = this_layer
        return buckets + ([current] if current else [])

    def bucket(self, names: list[str], dtype: str | None) -> tuple[Any, int] | None:
        """Gather the full tensors of ``names`` (collective), cast to ``dtype``; rank 0 puts
        them into Ray's object store and returns ``(ref, bytes)``, the others None."""
        state, rank = self.state.model.state_dict(), self.state.topo.rank
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if self.tied.get(name) in names:  # a tied weight's second name: gathered once
                continue
            full = full_tensor(state[name])  # every rank joins each all-gather, in the same order
            if rank == 0:
                out[name] = full.detach().to("cpu", copy=True)
        if rank != 0:
            return None
        import ray

        out = self._cast(self.state.hf_weights(out), dtype)
        out.update({n: out[self.tied[n]] for n in names if self.tied.get(n) in names})
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in out.values()}
        return ray.put(out), sum(unique.values())  # a tensor named twice is pickled once

    def adapter(self) -> tuple[Any, int] | None:
        """The LoRA adapters alone for an engine's adapter refit (collective): rank 0 puts
        ``{"tensors": PEFT-named fp32 adapters, "config": adapter_config.json's content}``
        into Ray's object store and returns ``(ref, bytes)``, the others None."""
        from tempering.models.policy.lora import adapter_state, is_adapter

        lora = self.state.lora
        if lora is None:
            raise RuntimeError("refit.adapter: this policy trains without LoRA adapters")
        state, rank = self.state.model.state_dict(), self.state.topo.rank
        gathered = {name: full_tensor(t) for name, t in state.items() if is_adapter(name)}
        if rank != 0:
            return None
        import ray

        tensors = adapter_state(gathered)
        payload = {"tensors": tensors, "config": lora.peft_config(self.state.source.model_path)}
        return ray.put(payload), sum(t.numel() * t.element_size() for t in tensors.values())

    def _cast(self, weights: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
        """``weights`` in ``dtype``; a tied weight's second name is drawn for under its first
        (one bf16 copy of a tied embedding, whichever name an engine keeps), cast once when
        both are here."""
        out: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            first = self.tied.get(name, name)
            same = first in out and weights[first].data_ptr() == t.data_ptr()
            out[name] = out[first] if same else _in_dtype(t, dtype, first)
        return out


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """``{later name: first name}`` for parameters the module tree holds under two names (a
    tied lm_head -> embed_tokens)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied[name] = first[id(param)]
    return tied


def _in_dtype(t: torch.Tensor, dtype: str | None, name: str) -> torch.Tensor:
    """Weight ``name`` cast to ``dtype`` (a torch dtype name) if it is floating point, as
    `cast_for_sampling` rounds for a sampler; None keeps it."""
    if not dtype or not t.is_floating_point():
        return t
    return cast_for_sampling(t, getattr(torch, dtype), name)


def _layer_of(name: str) -> str:
    """``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``; the name itself otherwise."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name
