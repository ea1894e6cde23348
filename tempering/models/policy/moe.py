"""Mixture-of-experts training: the router's load-balancing loss and the experts' load.

A model whose config names experts and a ``router_aux_loss_coef`` (transformers' Qwen3-MoE,
Mixtral, OLMoE) is trained with the Switch-Transformer load-balancing loss its own code
defines, scaled by its config's coefficient: without it the router learns to send every token
to a few experts. The training forward asks the model for its router logits
(``output_router_logits=True``); per micro-batch the worker adds

    moe_aux_loss = router_aux_loss_coef * aux * (micro-batch valid tokens / global valid tokens)

to the loss it differentiates (so the summed term is the token-weighted mean over the global
batch; the reported ``loss`` stays the objective's own), and logs the experts' load: the share
of top-k assignments each expert got over every layer and real token, as
``moe_expert_load_max`` / ``moe_expert_load_min`` times the number of experts (1.0 each:
perfectly balanced). Shared-prefix layouts do not return router logits, so a MoE model runs
whole rows (`model_setup.shared_prefix_ratio` turns them off, logged). Expert parallelism is a
GPU plan (docs/model_families.md), not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MoERouting:
    num_experts: int
    top_k: int
    aux_loss_coef: float

    @classmethod
    def of(cls, model: Any) -> MoERouting | None:
        """The model's routing, or None for a dense model."""
        cfg = getattr(model, "config", None)
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if not experts or not hasattr(cfg, "router_aux_loss_coef"):
            return None
        return cls(int(experts), int(cfg.num_experts_per_tok), float(cfg.router_aux_loss_coef))

    def loss_and_metrics(
        self,
        aux: torch.Tensor,
        router_logits: tuple[torch.Tensor, ...],
        mask: torch.Tensor | None,
        share: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The term to add to the micro-batch's loss, and its metrics (module docstring)."""
        term = aux * self.aux_loss_coef * share
        load = self.expert_load(router_logits, mask)
        return term, {
            "moe_aux_loss": float(term.detach()),
            "moe_expert_load_max": float(load.max()) * self.num_experts,
            "moe_expert_load_min": float(load.min()) * self.num_experts,
        }

    def expert_load(
        self, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """[E]: each expert's share of the top-k assignments of real tokens, over layers."""
        counts = torch.zeros(self.num_experts)
        with torch.no_grad():
            for logits in router_logits:  # [rows, E] per layer
                chosen = logits.float().topk(self.top_k, dim=-1).indices.cpu()  # [rows, k]
                weight = torch.ones_like(chosen, dtype=torch.float32)
                if mask is not None:
                    weight = weight * mask.reshape(-1, 1).float().cpu()
                counts.scatter_add_(0, chosen.reshape(-1), weight.reshape(-1))
        return counts / counts.sum().clamp(min=1.0)
