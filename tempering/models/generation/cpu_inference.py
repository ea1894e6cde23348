"""CPU inference set-up for a model that only generates: oneDNN-packed linear layers and
grouped attention without copies (see docs/generation.md).

`optimize_for_cpu_inference(model)`, called by the generation workers (and `tempering eval`)
on the model copy they generate with -- it changes the model's modules, so the torch engine
never does it to a model it is lent:

- `nn.Linear` layers (fp32 ones from `PACK_MIN_WEIGHTS` weights) become `PackedLinear` (the
  same function, computed by oneDNN from a weight copy reordered into its blocked layout once
  the weight has served `PACK_AFTER_CALLS` forwards unchanged, so a refit followed by a short
  generation does not pay a reorder it cannot earn back); packed siblings that multiply the
  same input (an attention's q/k/v projections, an MLP's gate and up) become one packed
  matrix (`FusedProjections`, `FUSED_SIBLINGS`);
- attention runs as `CPU_SDPA`: grouped-query attention with a padding mask is one SDPA call
  with ``enable_gqa`` instead of HF's copy of every key/value head per group, and a
  reduced-precision model whose CPU runs SDPA's kernel slowly in that dtype decodes (one query
  token a row) by two matmuls with fp32 scores instead (`CPU_SDPA_DECODE_MATMUL`, chosen by
  timing both once per shape and dtype, `decode_matmul_wins`).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any

import torch

from tempering.models.policy.packed_attention import matmul_attention

logger = logging.getLogger(__name__)

# oneDNN's packed linear against F.linear, measured on a 2-core Xeon with AMX (us per layer,
# 60 distinct weights in turn): fp32 packing wins from 576 x 576 up at 16 rows (115 against
# 142; the 49k x 576 lm_head 6.3 against 11.8 ms) and loses below (192 x 576: 48 against 40;
# tiny-arith's 512 x 128 at 128 rows: 86 against 72); bf16 packing wins at every size (192 x
# 576: 30 against 43; 512 x 128: 44 against 56). Reordering a weight costs ~300 us plus its
# size (the lm_head: 48 ms fp32, 25 ms bf16). So fp32 layers under PACK_MIN_WEIGHTS stay on
# F.linear, and a weight is packed once it has served PACK_AFTER_CALLS forwards unchanged
# (rent before buying: the reorder pays for itself within 3-35 calls), which a refit resets.
# The main job refits every step and runs 7 forwards a step: repacking its 15 layers each
# step made a 21 ms generation 31 ms. On a 2-core Zen 4 EPYC (2026-11-29) SmolLM2's 192 x 576
# key and value layers cost 10% of a decode step on F.linear (py-spy) and the SmolLM2 GRPO
# shape generated 5% faster with them packed (4 interleaved calls each, 12.89 -> 12.21 s),
# while tiny-arith's 512 x 128 layers measured equal: so 192 x 576 (110,592) is packed, which
# costs the Xeon ~0.5 ms a 70 ms step, and the main job's layers stay as they were.
PACK_MIN_WEIGHTS = {torch.float32: 100_000, torch.bfloat16: 0}
PACK_AFTER_CALLS = 8


class PackedLinear(torch.nn.Module):
    """`nn.Linear` for CPU inference through oneDNN with a pre-reordered weight.

    A decode step multiplies a few rows by every weight matrix, where MKL's sgemm (what
    `F.linear` calls on CPU) reached 50-110 GFLOP/s on our 2-core machine and oneDNN with the
    weight reordered once into its blocked layout 100-170 (SmolLM2's 49k x 576 lm_head at 16
    rows: 19 -> 5.8 ms). The module keeps the original ``weight``/``bias`` parameters under
    their names (state dicts, refit and tied weights are unchanged). The reorder is not free
    (see `PACK_AFTER_CALLS`): the layer runs `F.linear` until the weight has served
    ``pack_after`` forwards unchanged, then packs; a weight replaced or changed in place (its
    version counter moves) drops the packed copy and counts again, so it never computes with
    stale weights. With autograd recording (training) it is plain `F.linear`. The packing
    lives in ``fusion``: a `FusedProjections` of this layer alone, or of it and the siblings
    that multiply the same input."""

    def __init__(self, linear: torch.nn.Linear, pack_after: int = PACK_AFTER_CALLS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.pack_after = pack_after
        self.fusion = FusedProjections([self], pack_after)

    @property
    def is_packed(self) -> bool:
        """Whether the next forward computes from the packed copy (the weight unchanged)."""
        return self.fusion.is_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (torch.is_grad_enabled() and w.requires_grad) or x.dtype != w.dtype:
            return torch.nn.functional.linear(x, w, self.bias)
        out = self.fusion.forward(self, x)
        return torch.nn.functional.linear(x, w, self.bias) if out is None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, oneDNN after "
            f"{self.pack_after} calls"
        )


# Sibling layers (children of one module, by name) that read the same input, in the order a
# forward calls them: HF's Llama, Qwen, Mistral and Gemma attentions and MLPs name them so.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """`PackedLinear` layers packed as one matrix: a layer alone, or siblings that multiply the
    same input -- an attention's query, key and value projections, an MLP's gate and up. The
    first layer's call computes every member's output in one oneDNN product and keeps the
    others' parts for their calls on that same input (same tensor, unchanged): a decode step's
    seven small products a layer become four (SmolLM2 at the GRPO shape on the Zen 4 EPYC, 4
    interleaved calls each: fp32 5% faster, bf16 7%). A member called on any other input
    computes alone, so each layer stays its own function of its own weight whatever the call
    order. Rent before buying: each layer runs F.linear until the lead has served
    ``pack_after`` calls with every member's weights unchanged, then the matrix is packed; a
    refit of any member drops it and the kept parts, and the count starts again."""

    def __init__(self, layers: list[PackedLinear], pack_after: int = PACK_AFTER_CALLS) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.pack_after = pack_after
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._stamp: tuple = ()  # (id, version) of every member's weight and bias counted
        self._calls = 0  # lead calls with those weights
        self._input: tuple[torch.Tensor, int] | None = None  # what the kept parts came from
        self._parts: list[torch.Tensor] = []
        self.shared = 0  # member calls served from the lead's product (what tests count)
        for index, layer in enumerate(layers):
            layer.fusion, layer.fusion_index = self, index

    def _weights(self) -> tuple:
        return tuple(
            (id(t), t._version)
            for layer in self.layers
            for t in (layer.weight, layer.bias)
            if t is not None
        )

    @property
    def is_packed(self) -> bool:
        return self._packed is not None and self._stamp == self._weights()

    def forward(self, layer: PackedLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output on ``x`` from the packed product, or None: compute it alone."""
        stamp = self._weights()
        if stamp != self._stamp:  # new weights: drop the packed matrix and the kept parts
            self._packed, self._input, self._parts = None, None, []
            self._stamp, self._calls = stamp, 0
        if layer.fusion_index:  # a member: the lead's parts if computed from this very input
            kept = self._input
            if kept is not None and kept[0] is x and kept[1] == _version(x):
                self.shared += 1
                return self._parts[layer.fusion_index]
            return None
        if self._packed is None:
            self._calls += 1
            if self._calls <= self.pack_after:
                return None
            self._pack()
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias, "none", [], "")
        if len(self.layers) == 1:
            return out
        # contiguous parts: a model may view a projection's output in any way it could before
        self._parts = [part.contiguous() for part in out.split(self.sizes, dim=-1)]
        self._input = (x, _version(x))
        return self._parts[0]

    def _pack(self) -> None:
        weights = [m.weight.detach() for m in self.layers]
        biases = [m.bias for m in self.layers]
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, reusable
            one = weights[0] if len(weights) == 1 else torch.cat(weights)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(one)
            self._bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])


def _version(x: torch.Tensor) -> int:
    """``x``'s in-place version; inference-mode tensors keep none (-1: the same tensor object
    is the same input, as HF's modules pass one hidden-states tensor to every sibling)."""
    return -1 if x.is_inference() else x._version


def fuse_sibling_layers(model: torch.nn.Module, pack_after: int = PACK_AFTER_CALLS) -> int:
    """Group ``model``'s `FUSED_SIBLINGS` that are all `PackedLinear` of one input width, dtype
    and bias-or-not into `FusedProjections`; returns how many groups."""
    groups = 0
    for module in model.modules():
        for names in FUSED_SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            alone = [type(x) is PackedLinear and len(x.fusion.layers) == 1 for x in layers]
            if all(alone):
                kinds = {(x.in_features, x.weight.dtype, x.bias is None) for x in layers}
                if len(kinds) == 1:
                    FusedProjections(layers, pack_after)
                    groups += 1
    return groups


def optimize_for_cpu_inference(
    model: torch.nn.Module, min_weights: int | None = None, pack_after: int = PACK_AFTER_CALLS
) -> dict[str, int]:
    """Make a CPU model that only generates decode faster, computing the same function:
    `PackedLinear` layers (of at least ``min_weights`` weights, None: `PACK_MIN_WEIGHTS` for
    their dtype; packed after ``pack_after`` forwards) and `CPU_SDPA` attention, decoding by
    matmuls where they win (see module docstring). Returns what it changed
    (``packed_linear_layers``, ``fused_projections``, ``cpu_sdpa``,
    ``decode_attention_by_matmul``), and logs it."""
    packed = pack_linear_layers(model, min_weights, pack_after)
    attention = use_cpu_sdpa(model)
    done = {
        "packed_linear_layers": packed,
        "fused_projections": fuse_sibling_layers(model, pack_after) if packed else 0,
        "cpu_sdpa": int(attention is not None),
        "decode_attention_by_matmul": int(attention == CPU_SDPA_DECODE_MATMUL),
    }
    logger.info("torch engine: CPU inference set-up %s", done)
    return done


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and oneDNN uses it.
    Without them oneDNN emulates bf16 (slower than fp32), so bf16 layers stay on F.linear."""
    cpu = torch.cpu
    has = [
        getattr(cpu, f, lambda: False)()
        for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(has) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(
    model: torch.nn.Module, min_weights: int | None = None, pack_after: int = PACK_AFTER_CALLS
) -> int:
    """Replace ``model``'s CPU fp32 `nn.Linear` layers (and bf16 ones on a CPU with native
    bf16, `native_bf16_cpu`) of at least ``min_weights`` weights (None: `PACK_MIN_WEIGHTS`
    for their dtype) by `PackedLinear` (packing after ``pack_after`` forwards); returns how
    many. Where oneDNN is missing (or the model is on a GPU) nothing changes, and a CPU model
    left unpacked for that is logged."""
    dtypes = (torch.float32, torch.bfloat16) if native_bf16_cpu() else (torch.float32,)
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype in dtypes
        and m.weight.numel()
        >= (PACK_MIN_WEIGHTS[m.weight.dtype] if min_weights is None else min_weights)
    ]
    if not linears:
        return 0
    ops = ("_reorder_linear_weight", "_linear_pointwise")  # what torch's inductor uses on CPU
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(torch.ops.mkldnn, op) for op in ops
    ):
        logger.warning(
            "torch engine: this torch build lacks oneDNN's %s; %d linear layers stay on "
            "F.linear (slower decoding on CPU)",
            " / ".join(ops),
            len(linears),
        )
        return 0
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear, pack_after))
    return len(linears)


CPU_SDPA = "tempering_cpu_sdpa"
CPU_SDPA_DECODE_MATMUL = "tempering_cpu_sdpa_decode_matmul"
# decode_matmul_wins: the shape timed (a GRPO decode batch over a few hundred positions), and
# how much faster the matmuls must be to replace SDPA (so a close call does not flip between
# runs and change a seed's samples).
_TIMED_ROWS, _TIMED_POSITIONS, _MATMUL_MARGIN = 16, 256, 1.25


def _cpu_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    decode_by_matmul: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention, except on CPU: grouped-query attention with a mask stays grouped
    (HF repeats every key/value head for each query head it serves whenever a mask is given,
    which CUDA's fused kernels need; torch's CPU kernels take ``enable_gqa`` with a mask: with
    padded prompts that copy was a fifth of a SmolLM2 decode step), and with
    ``decode_by_matmul`` one query token a row runs as `decode_attention_by_matmul` (whose
    cache the torch engine keeps in fp32, `cache_dtype`: other paths cast it back)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    special = special or bool(kwargs.get("dropout")) or bool(kwargs.get("output_attentions"))
    boolean = attention_mask is None or attention_mask.dtype == torch.bool
    on_cpu = query.device.type == "cpu"
    if decode_by_matmul and on_cpu and query.shape[2] == 1 and boolean and not args and not special:
        out = decode_attention_by_matmul(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    key, value = key.to(query.dtype), value.to(query.dtype)
    if not on_cpu or args or special or groups == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None  # [B, H, q, D] -> [B, q, H, D]


def decode_attention_by_matmul(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA's result for one query token a row ([B, H, 1, D] against [B, KV, L, D] keys and
    values, H a multiple of KV, grouped as ``enable_gqa``; ``keep`` a boolean mask broadcast to
    [B, 1, 1, L], None: every key) by `matmul_attention`'s two matmuls, each key/value head
    serving its group of query heads without a copy: the scores in fp32 (query and keys upcast,
    as flash kernels accumulate; bf16 scores erred 4x more), the probabilities in the values'
    dtype (fp32 where the cache holds them so, `cache_dtype`: a bf16 matmul copies a strided
    view whole, an fp32 one reads it in place). For bf16 on a CPU whose SDPA kernel is slow in
    bf16 (2026-11-28, a Zen 4 EPYC with AVX512-BF16 and no AMX: 2.2 ms a layer at 16 rows x 250
    positions against 0.35 ms this way)."""
    rows, heads, _, dim = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim).float()
    if keep is None:
        keep = torch.ones(1, 1, 1, positions, dtype=torch.bool, device=query.device)
    keep = keep.reshape(keep.shape[0], 1, 1, positions)
    scale = dim**-0.5 if scale is None else scale
    out = matmul_attention(grouped, key.float(), value, keep, scale)
    return out.reshape(rows, heads, 1, dim).to(query.dtype)


@functools.cache
def decode_matmul_wins(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention_by_matmul` beats grouped SDPA by `_MATMUL_MARGIN` on this CPU
    for a decode step of this shape and dtype (timed once a process: interleaved rounds, the
    median). fp32 is never switched: the two were within 10% on both CPUs we measured, and
    fp32 sampling stays SDPA's, as the trainer's log-prob parity checks it."""
    if dtype == torch.float32:
        return False
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(_TIMED_ROWS, heads, 1, head_dim, generator=gen).to(dtype)
    key, value = (
        torch.randn(_TIMED_ROWS, kv_heads, _TIMED_POSITIONS, head_dim, generator=gen).to(dtype)
        for _ in range(2)
    )
    mask = torch.ones(_TIMED_ROWS, 1, 1, _TIMED_POSITIONS, dtype=torch.bool)
    mask[: _TIMED_ROWS // 4, ..., : _TIMED_POSITIONS // 8] = False  # left padding

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=True
        )

    cached = key.float(), value.float()  # the engine's cache holds them so (`cache_dtype`)

    def matmul() -> torch.Tensor:
        return decode_attention_by_matmul(query, *cached, mask)

    seconds: dict[Any, list[float]] = {sdpa: [], matmul: []}
    with torch.inference_mode():
        for _ in range(5):
            for way, times in seconds.items():
                way()  # warm, then time one
                start = time.perf_counter()
                way()
                times.append(time.perf_counter() - start)
    sdpa_s, matmul_s = (statistics.median(t) for t in seconds.values())
    wins = matmul_s * _MATMUL_MARGIN < sdpa_s
    logger.info(
        "decode attention (%s, %d heads over %d, dim %d): SDPA %.0f us, two matmuls %.0f us: %s",
        dtype,
        heads,
        kv_heads,
        head_dim,
        sdpa_s * 1e6,
        matmul_s * 1e6,
        "matmuls" if wins else "SDPA",
    )
    return wins


def _attention_shape(config: Any) -> tuple[int, int, int] | None:
    """(heads, key/value heads, head dim) from an HF config; None where it does not say."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def use_cpu_sdpa(model: Any, decode_by_matmul: bool | None = None) -> str | None:
    """Switch an SDPA model on CPU to `CPU_SDPA` (same masks, same results), or to
    `CPU_SDPA_DECODE_MATMUL` where ``decode_by_matmul`` (None: where `decode_matmul_wins` for
    the model's dtype and attention shape); returns the implementation set, None if neither."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in (
        "sdpa",
        CPU_SDPA,
        CPU_SDPA_DECODE_MATMUL,
    ):
        return None
    weight = next(model.parameters())
    if weight.device.type != "cpu":
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if decode_by_matmul is None:
        shape = _attention_shape(getattr(config, "text_config", config))
        decode_by_matmul = shape is not None and decode_matmul_wins(weight.dtype, *shape)
    name = CPU_SDPA_DECODE_MATMUL if decode_by_matmul else CPU_SDPA
    for registered in (CPU_SDPA, CPU_SDPA_DECODE_MATMUL):
        AttentionInterface.register(
            registered,
            functools.partial(
                _cpu_sdpa_attention, decode_by_matmul=registered == CPU_SDPA_DECODE_MATMUL
            ),
        )
        AttentionMaskInterface.register(registered, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model.set_attn_implementation(name)
    except (ValueError, NotImplementedError) as exc:  # a model that fixes its attention
        logger.warning("torch engine: %s keeps HF's sdpa attention (%s)", type(model).__name__, exc)
        return None
    return name if getattr(model.config, "_attn_implementation", None) == name else None


def cache_dtype(model: Any) -> torch.dtype | None:
    """The dtype a generation KV cache should hold for ``model``: fp32 where it decodes by
    matmuls (`CPU_SDPA_DECODE_MATMUL`: the scores are fp32 anyway, and the strided views of a
    preallocated bf16 cache were copied whole by the keys' upcast and by bf16 ``bmm``, 19 ms of a
    64 ms SmolLM2 step), None (the model's dtype) otherwise."""
    config = getattr(model, "config", None)
    decodes_by_matmul = getattr(config, "_attn_implementation", None) == CPU_SDPA_DECODE_MATMUL
    return torch.float32 if decodes_by_matmul else None
