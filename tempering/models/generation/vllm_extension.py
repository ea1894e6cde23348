"""The worker extension that vLLM mixes into its own worker class, for in-place refit.

`VllmGenerationWorker` builds `vllm.LLM(..., worker_extension_cls=EXTENSION_FQN)`; vLLM then
adds this class to the bases of each of its workers (GPU or CPU), so the methods below run
inside every worker process, with `self` being vLLM's worker (`self.model_runner`,
`self.reload_weights`, ...). The driver reaches them by name through
`llm.collective_rpc("tempering_load_weights", args=(named_tensors,))`.

vLLM refuses an extension whose attribute names clash with its worker's (vLLM 0.32's worker
already has `update_weights`, `reload_weights`, ...), hence the `tempering_` prefix.

Why `reload_weights` and not `model.load_weights`: on CPU, vLLM repacks every linear weight
into a oneDNN / sgl-kernel layout after loading and replaces `layer.weight` with an empty
tensor, so a second `model.load_weights` fails ("Attempted to load weight (torch.Size([128,
256])) into parameter (torch.Size([0]))"). Whether that repacking happens depends on the dtype
and the CPU's instruction set, which is why it was once seen to work in bf16 and fail in fp32.
vLLM's in-place reload (`Worker.reload_weights`) restores the checkpoint layout of each layer,
loads the tensors, re-runs the layer's post-load processing and copies the result back into
the tensors the kernels already use, so it works for both dtypes and on GPU alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

EXTENSION_FQN = "tempering.models.generation.vllm_extension.WeightUpdateExtension"


class WeightUpdateExtension:
    """Methods vLLM adds to its worker; call them with `LLM.collective_rpc(name, args=...)`."""

    def tempering_load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load `(hf_name, tensor)` pairs into the running model in place; returns how many.

        Names are Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj.weight`);
        vLLM's loader fuses q/k/v and gate/up itself and casts to the engine's dtype. A layer
        whose weights are all absent keeps its current values; a layer must be sent whole
        (e.g. q, k and v together), because vLLM processes a layer once all of it arrived.
        """
        pairs = list(named_tensors)
        packed = self._tempering_packed_layers()
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _repack_tied_layers(packed)
        return len(pairs)

    def _tempering_packed_layers(self) -> dict[torch.nn.Module, object]:
        """CPU layers that keep their weight beside a packed GEMM copy, with that copy."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {
            m: m.cpu_linear
            for m in model.modules()
            if hasattr(m, "cpu_linear")
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.ndim == 2
            and m.weight.numel() > 0
            and getattr(m, "quant_method", None) is not None
        }

    def tempering_worker_info(self) -> dict[str, int | str]:
        """Where the engine's worker lives: its pid and its model object's id (for tests)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {"pid": os.getpid(), "model_id": id(model), "model_class": type(model).__name__}


def _repack_tied_layers(packed: dict[torch.nn.Module, object]) -> int:
    """Re-pack the layers a reload left stale: those sharing a reloaded layer's weight.

    On CPU, vLLM gives a layer that keeps its weight (an embedding, an lm_head) a packed copy
    for its matmul (``cpu_linear``). A tied lm_head is a module of its own sharing the
    embedding's parameter: the in-place reload loads the embedding and packs it anew, but the
    lm_head received no weights, is not processed, and went on computing the OLD logits
    (every tied-embedding family -- Qwen2/3, Gemma 3, SmolLM2 -- 0.6-0.9 nats off after a
    refit, tests/functional/test_family_vllm.py). ``packed`` maps each such layer to its copy
    before the reload; a layer whose copy did not change while another layer on the same
    storage got a new one is processed again. Returns how many. GPU layers have no
    ``cpu_linear``: nothing to do."""
    renewed = {m.weight.data_ptr() for m, copy in packed.items() if m.cpu_linear is not copy}
    stale = [m for m, copy in packed.items()
             if m.cpu_linear is copy and m.weight.data_ptr() in renewed]  # fmt: skip
    for module in stale:
        module.quant_method.process_weights_after_loading(module)
    return len(stale)
