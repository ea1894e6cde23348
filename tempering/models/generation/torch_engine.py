"""Torch-native generation engine: batched sampling with a KV cache, no extra dependencies.

For CPU runs and small models (tiny-arith, SmolLM2-135M) where starting vLLM costs more than
generating. Implements `GenerationInterface` with the token layout of docs/CONTRACTS.md:

- prompts arrive right-padded; the engine left-pads them internally so every row's next token
  sits in the last column, with an attention mask and position ids that ignore the padding;
- one prefill forward over the distinct prompts (a GRPO group's rows share theirs: the
  cache is copied out to each row), then one forward per new token over the whole batch with HF's
  `DynamicCache` (the loop runs over time steps, never over sequences), whose full-attention
  layers write into buffers sized once for the call (`_PreallocatedLayer`) instead of
  concatenating a fresh copy of the cache at every step;
- the workers make the model copy they generate with faster on CPU first
  (`cpu_inference.optimize_for_cpu_inference`: packed linears, grouped attention);
- rows that emit a stop token (eos or `stop_token_ids`) or whose generated text contains a
  stop string are finished: later columns are padding; once a quarter of the batch has
  finished, finished rows leave it (and the KV cache), and the loop ends once all are done;
- sampling (temperature, top-k, top-p) draws one uniform number per row from a seeded
  `torch.Generator` and inverts the row's cumulative distribution; log-probs are
  `log_softmax(logits / temperature)` of the chosen token BEFORE top-k/top-p filtering.

    engine = TorchGenerationEngine(model, tokenizer, temperature=0.7, max_new_tokens=8, seed=0)
    out = engine.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths))
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.cpu_inference import cache_dtype
from tempering.models.generation.interfaces import (
    SamplingConfig,
    StepCallback,
    check_input_lengths,
    sampling_config,
)
from tempering.models.generation.refit import cast_for_sampling
from tempering.utils import threads

# A byte-level token carries at least one byte and a character at most 4, so a stop string of
# n characters lies within the last 4n tokens (plus slack for tokens that decode to nothing).
_BYTES_PER_CHAR = 4
_STOP_WINDOW_SLACK = 4
# Finished rows leave the decode batch once the live ones are at most this share of it
# (each compaction copies the KV cache once, so not after every finished row).
_COMPACT_BELOW = 0.75


class TorchGenerationEngine:
    """Batched generation for an HF causal LM held in this process (see module docstring)."""

    reports_steps = True  # interfaces.StreamingGeneration: `generate` takes `on_step`

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: SamplingConfig | None = None,
        **sampling_args: Any,
    ) -> None:
        """`config`, or the `SamplingConfig` fields as keywords (not both)."""
        self.config = sampling_config(config, sampling_args, "TorchGenerationEngine")
        self.model = model
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if pad is None:
            raise ValueError(
                f"Tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token; "
                "set tokenizer.pad_token before building the engine."
            )
        self.pad_token_id = int(pad)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = eos_ids
        self.stop_token_ids = sorted({*eos_ids, *self.config.stop_token_ids})
        self.device = next(model.parameters()).device
        seed = self.config.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # In-flight weight updates (async GRPO): staged weights wait for the next boundary
        # between decode steps; every generated token records the version that produced it.
        self.in_flight = False  # set by a worker that takes in-flight updates: see generate
        self.weight_version = 0
        self._staged: dict[str, torch.Tensor] = {}
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._weights_lock = threading.Lock()  # guards the model's weights, staged and pending
        self._generate_lock = threading.Lock()  # one generate call at a time
        self._generating = False

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from ``seed`` (GRPO reseeds every step from the run's
        seed and the step, so a resumed run samples what an uninterrupted one would)."""
        self.generator.manual_seed(seed)

    # ---- GenerationInterface ---------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        """Nothing to wake: the model lives in this process and the KV cache is per call."""

    def finish_generation(self) -> None:
        """Nothing to release: each `generate` call's KV cache is freed when it returns."""

    def update_weights(self, weights: Mapping[str, Any]) -> None:
        """Copy tensors into the model's parameters/buffers in place, by state-dict name.

        A partial state dict updates only the named tensors (tied weights share storage);
        fp32 values into a bf16 copy round as `refit.cast_for_sampling` does (unbiased).
        """
        targets = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(weights) - set(targets))
        if unknown:
            raise KeyError(
                f"update_weights got {len(unknown)} names the model does not have, e.g. "
                f"{unknown[:3]}; expected names like {list(targets)[:3]}. Send the policy's "
                "full (unsharded) state dict with HF parameter names."
            )
        copied: dict[int, tuple] = {}  # a target's id -> where the value copied into it lives
        with torch.no_grad():
            for name, value in weights.items():
                target = targets[name]
                source = (value.data_ptr(), value.dtype, tuple(value.stride()))
                if copied.get(id(target)) == source:  # a tied weight's second name: done
                    continue
                copied[id(target)] = source
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(
                        f"update_weights: {name} has shape {tuple(value.shape)}, the model's "
                        f"has {tuple(target.shape)}; the policy and generator models differ."
                    )
                if target.dtype != value.dtype and target.is_floating_point():
                    value = cast_for_sampling(value, target.dtype, name)  # unbiased to bf16
                target.copy_(value)

    # ---- in-flight weight updates ----------------------------------------------------------

    def stage_weights(self, weights: Mapping[str, Any]) -> None:
        """Hold part of the next weights (a refit bucket) without touching the model: a
        generation running meanwhile goes on with the weights it has."""
        with self._weights_lock:
            self._staged.update(weights)

    def commit_weights(self, version: int) -> None:
        """The staged weights become ``version``: at once when no generation runs, else at the
        next boundary between decode steps (never inside a forward, never half a refit)."""
        with self._weights_lock:
            self._pending, self._staged = (self._staged, int(version)), {}
            if not self._generating:
                self._apply_pending()

    def is_generating(self) -> bool:
        return self._generating

    def _apply_pending(self) -> None:
        """Load the committed weights (the caller holds ``_weights_lock``)."""
        if self._pending is not None:
            weights, version = self._pending
            self._pending = None
            self.update_weights(weights)
            self.weight_version = version

    def _between_steps(self) -> int:
        """The version the next decode step runs with, after loading committed weights."""
        with self._weights_lock:
            self._apply_pending()
            return self.weight_version

    @torch.inference_mode()
    def generate(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
        on_step: StepCallback | None = None,
    ) -> BatchedDataDict:
        """Continue each right-padded prompt; returns the contract's BatchedDataDict.

        `sampling` replaces the engine's settings for this call (its seed, if set, seeds a
        generator for this call only); an optional ``data["max_new_tokens"]`` [B] caps each row.
        `on_step` (`interfaces.StepCallback`, the streaming server's): called after every
        decode step with the tokens just generated; the rows it returns stop at once (a
        client that went away), finish reason "length".
        """
        cfg = sampling if sampling is not None else self.config
        greedy = greedy or cfg.greedy
        input_ids = data["input_ids"].to(self.device).long()  # [B, S] right-padded
        lengths = data["input_lengths"].to(self.device).long()  # [B]
        check_input_lengths(input_ids, lengths)
        B, S = input_ids.shape
        row_caps = torch.full((B,), cfg.max_new_tokens, dtype=torch.long, device=self.device)
        if data.get("max_new_tokens") is not None:
            caps = torch.as_tensor(data["max_new_tokens"]).to(self.device).long()
            if caps.shape != (B,) or bool((caps < 1).any()):
                raise ValueError(f"max_new_tokens must be [B]={B} values >= 1; got {caps.tolist()}")
            row_caps = torch.minimum(row_caps, caps)
        generator = self.generator
        if sampling is not None and sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        with self._generate_lock:
            was_training = self.model.training
            self.model.eval()
            with self._weights_lock:
                self._generating = True
            try:
                decode = _Decode(self, cfg, greedy, generator, on_step)
                decoded = decode.run(input_ids, lengths, row_caps)
            finally:
                with self._weights_lock:
                    self._generating = False
                    self._apply_pending()  # a commit during the last step
                self.model.train(was_training)
        generated, gen_logprobs, gen_lengths, stopped, top_ids, top_values = decoded

        # Right-padded output: prompt, then generated tokens, then padding.  [B, S + T]
        T = generated.shape[1]
        cols = torch.arange(S, device=self.device)
        output_ids = torch.full((B, S + T), self.pad_token_id, dtype=torch.long, device=self.device)
        output_ids[:, :S] = torch.where(cols < lengths[:, None], input_ids, self.pad_token_id)
        logprobs = torch.zeros((B, S + T), dtype=torch.float32, device=self.device)
        dest = lengths[:, None] + torch.arange(T, device=self.device)  # [B, T]
        in_gen = torch.arange(T, device=self.device) < gen_lengths[:, None]
        output_ids.scatter_(1, dest, torch.where(in_gen, generated, self.pad_token_id))
        logprobs.scatter_(1, dest, torch.where(in_gen, gen_logprobs, 0.0))
        out = BatchedDataDict(
            output_ids=output_ids,
            logprobs=logprobs,
            generation_lengths=gen_lengths,
            unpadded_sequence_lengths=lengths + gen_lengths,
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
        )
        if top_ids is not None and top_values is not None:  # [B, T, k] -> [B, S + T, k]
            k = top_ids.shape[-1]
            dest_k = dest[:, :, None].expand(B, T, k)
            out["top_logprob_ids"] = torch.zeros((B, S + T, k), dtype=torch.long).scatter_(
                1, dest_k, top_ids * in_gen[:, :, None]
            )
            out["top_logprobs"] = torch.zeros((B, S + T, k)).scatter_(
                1, dest_k, top_values * in_gen[:, :, None]
            )
        if not self.in_flight:
            return out
        # The weight version of every generated token (-1 elsewhere) [B, S + T]
        versions = torch.full((B, S + T), -1, dtype=torch.long, device=self.device)
        step_versions = decode.versions[:T].to(self.device)[None, :].expand(B, T)
        out["token_weight_versions"] = versions.scatter_(
            1, dest, torch.where(in_gen, step_versions, -1)
        )
        return out

    # ---- internals -------------------------------------------------------------------------


class _Decoded(NamedTuple):
    """What one `generate` call decoded, T columns per row (T <= the call's max_new_tokens)."""

    generated: torch.Tensor  # [B, T] token ids, pad after a row's end
    logprobs: torch.Tensor  # [B, T] float32, 0 after a row's end
    lengths: torch.Tensor  # [B] tokens generated per row
    stopped: torch.Tensor  # [B] bool: ended by a stop token or string (else by its cap)
    top_ids: torch.Tensor | None  # [B, T, k] (None unless top_logprobs = k > 0)
    top_values: torch.Tensor | None  # [B, T, k]

    @staticmethod
    def empty(B: int, T: int, k: int, pad: int, like: torch.Tensor) -> _Decoded:
        """Buffers for T steps of B rows on `like`'s device."""
        dev = like.device
        return _Decoded(
            generated=torch.full((B, T), pad, dtype=torch.long, device=dev),
            logprobs=torch.zeros((B, T), dtype=torch.float32, device=dev),
            top_ids=torch.zeros((B, T, k), dtype=torch.long, device=dev) if k else None,
            top_values=torch.zeros((B, T, k), device=dev) if k else None,
            lengths=torch.zeros(B, dtype=torch.long, device=dev),
            stopped=torch.zeros(B, dtype=torch.bool, device=dev),
        )

    def first(self, steps: int) -> _Decoded:
        """The first `steps` columns (the steps the loop took)."""
        cut = slice(0, steps)
        top_ids, top_values = self.top_ids, self.top_values
        return _Decoded(
            self.generated[:, cut],
            self.logprobs[:, cut],
            self.lengths,
            self.stopped,
            None if top_ids is None else top_ids[:, cut],
            None if top_values is None else top_values[:, cut],
        )


class _Decode:
    """One `generate` call's decoding: prefill, then one forward per step over the batch."""

    def __init__(
        self,
        engine: TorchGenerationEngine,
        cfg: SamplingConfig,
        greedy: bool,
        generator: torch.Generator,
        on_step: StepCallback | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.model = engine.model
        self.cfg = cfg
        self.greedy = greedy
        self.generator = generator
        self.pad = engine.pad_token_id
        stop_ids = sorted({*engine.eos_token_ids, *cfg.stop_token_ids})
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=engine.device)
        max_chars = max((len(s) for s in cfg.stop_strings), default=0)
        self.stop_window = _BYTES_PER_CHAR * max_chars + _STOP_WINDOW_SLACK
        self.versions = torch.empty(0, dtype=torch.long)  # [T]: the weights of each step

    def run(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, row_caps: torch.Tensor
    ) -> _Decoded:
        """Decode right-padded prompts [B, S] of `lengths` [B], at most `row_caps` [B] new
        tokens per row; the result's T <= max(row_caps)."""
        max_new = int(row_caps.max())
        capacity = input_ids.shape[1] + max_new
        cache = _preallocated_cache(self.model.config, capacity, cache_dtype(self.model))
        self.versions = torch.full((max_new,), -1, dtype=torch.long)
        self.versions[0] = self.engine._between_steps()  # the first token: the prefill's
        logits, attention_mask = self._prefill(input_ids, lengths, cache)
        decoded = _Decoded.empty(len(lengths), max_new, self.cfg.top_logprobs, self.pad, input_ids)
        steps = self._decode(logits, attention_mask, cache, lengths, row_caps, decoded)
        return decoded.first(steps)

    def _prefill(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill `cache` with the left-padded prompts; returns each row's next-token logits
        [B, V] and the left-padded attention mask [B, S]."""
        B, S = input_ids.shape
        dev = input_ids.device
        # Left-pad: row b's L_b tokens move to the last L_b columns.
        src = torch.arange(S, device=dev)[None, :] - (S - lengths)[:, None]  # [B, S]
        real = src >= 0
        left_ids = torch.where(real, input_ids.gather(1, src.clamp(min=0)), self.pad)
        attention_mask = real.long()
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        # Rows with the same prompt (a GRPO group's G samples) are prefilled once, then the
        # cache and the last logits are copied out to every row of the group.
        key = torch.cat([left_ids, lengths[:, None]], dim=1)  # a padding token may be real
        prompts, group_of_row = torch.unique(key, dim=0, return_inverse=True)
        first_row = torch.full((len(prompts),), B, dtype=torch.long, device=dev)
        first_row.scatter_reduce_(0, group_of_row, torch.arange(B, device=dev), "amin")
        out = self.model(
            input_ids=left_ids[first_row],
            attention_mask=attention_mask[first_row],
            position_ids=position_ids[first_row],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].index_select(0, group_of_row)  # [B, V]
        cache.batch_select_indices(group_of_row)
        return logits, attention_mask

    def _decode(
        self,
        logits: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache,
        lengths: torch.Tensor,
        row_caps: torch.Tensor,
        decoded: _Decoded,
    ) -> int:
        """One forward per new token over the rows still live, writing into `decoded`;
        returns the number of steps taken."""
        generated, gen_logprobs, gen_lengths, stopped, top_ids, top_values = decoded
        k = self.cfg.top_logprobs
        B = len(lengths)
        finished = torch.zeros(B, dtype=torch.bool, device=lengths.device)
        next_position = lengths.clone()  # position id of each row's next token
        rows = torch.arange(B, device=lengths.device)  # rows still in the batch (and the cache)
        steps = 0
        for step in range(generated.shape[1]):
            threads.tick()  # torch threads follow the free cores (utils/threads.py)
            logp = torch.log_softmax(logits.float() / self.cfg.temperature, dim=-1)
            tokens = self._sample(logp)  # [b], b = len(rows)
            active = ~finished[rows]
            generated[rows, step] = torch.where(active, tokens, self.pad)
            chosen = logp.gather(1, tokens[:, None])[:, 0]
            gen_logprobs[rows, step] = torch.where(active, chosen, 0.0)
            if top_ids is not None and top_values is not None:
                values, ids = logp.topk(k, dim=-1)
                top_ids[rows, step] = ids * active[:, None]
                top_values[rows, step] = values * active[:, None]
            gen_lengths[rows] += active.long()
            steps = step + 1
            hit = active & torch.isin(tokens, self.stop_ids)
            if self.cfg.stop_strings:
                hit |= self._stop_string_hits(generated[rows, :steps], active & ~hit)
            stopped[rows] |= hit
            finished[rows] |= hit | (gen_lengths[rows] >= row_caps[rows])
            if self.on_step is not None:
                self._report_step(decoded, rows, active, step, finished)
            live = ~finished[rows]
            n_live = int(live.sum())
            if n_live == 0:
                break
            if n_live <= _COMPACT_BELOW * len(rows):
                # finished rows leave the batch: the model no longer computes them
                keep = live.nonzero().flatten()
                cache.batch_select_indices(keep)
                attention_mask, rows = attention_mask[keep], rows[keep]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1
            )
            if step + 1 < len(self.versions):  # new weights load here, between two steps
                self.versions[step + 1] = self.engine._between_steps()
            out = self.model(
                input_ids=generated[rows, step : step + 1],
                attention_mask=attention_mask,
                position_ids=next_position[rows][:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_position[rows] += 1
        return steps

    def _report_step(
        self, decoded: _Decoded, rows: torch.Tensor, active: torch.Tensor, step: int,
        finished: torch.Tensor,
    ) -> None:  # fmt: skip
        """Tell `on_step` this step's tokens (rows that produced one); stop the rows it names."""
        assert self.on_step is not None
        emitted = rows[active]
        top = None
        if decoded.top_ids is not None and decoded.top_values is not None:
            top = (decoded.top_ids[emitted, step].tolist(),
                   decoded.top_values[emitted, step].tolist())  # fmt: skip
        stop = self.on_step(emitted.tolist(), decoded.generated[emitted, step].tolist(),
                            decoded.logprobs[emitted, step].tolist(), top)  # fmt: skip
        if stop:
            finished[torch.as_tensor(list(stop), dtype=torch.long, device=finished.device)] = True

    def _sample(self, logp: torch.Tensor) -> torch.Tensor:
        """Next tokens [B] from log-probs at temperature [B, V] (top-k/top-p filter the draw
        only: the reported log-probs stay those before filtering)."""
        cfg = self.cfg
        if self.greedy:
            return logp.argmax(dim=-1)
        filtered = logp
        if cfg.top_k is not None and cfg.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered, cfg.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = mass_before >= cfg.top_p  # the top token always stays (mass_before = 0)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            filtered = torch.empty_like(filtered).scatter_(1, order, sorted_logits)
        return _inverse_cdf_sample(torch.softmax(filtered, dim=-1), self.generator)

    def _stop_string_hits(self, generated: torch.Tensor, check: torch.Tensor) -> torch.Tensor:
        """Rows in `check` whose generated text (tail window) contains a stop string."""
        hits = torch.zeros_like(check)
        rows = check.nonzero().flatten().tolist()
        if not rows:
            return hits
        tails = generated[rows, -self.stop_window :].tolist()
        texts = self.engine.tokenizer.batch_decode(tails, skip_special_tokens=True)
        for row, text in zip(rows, texts, strict=True):
            if any(s in text for s in self.cfg.stop_strings):
                hits[row] = True
        return hits


def _inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: the first index whose cumulative probability
    exceeds a uniform draw. One random number per row (`torch.multinomial` draws one per
    vocabulary entry: 16 ms of a 49k-vocabulary, 16-row decode step on our CPU); a token of
    probability 0 is never chosen, and the draw is scaled by the row's total so rounding in
    the cumulative sum cannot push it past the end."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1).squeeze(1)


class _PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers allocated once for the whole
    call (``capacity`` positions), each step writing its new positions in place. HF's layer
    concatenates the whole cache into a fresh tensor at every step: profiling SmolLM2-135M
    (16 rows, 200-token prompts, 128 new tokens) put half of the decode time in that
    ``torch.cat``. ``keys``/``values`` are views of the filled part, so every other method of
    the parent (lengths, masks, crop) keeps working."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.buffer_dtype = dtype  # None: the model's

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.buffer_dtype or key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        shape = (B, H, self.capacity, D)
        self._key_buffer = key_states.new_empty(shape, dtype=self.dtype)
        self._value_buffer = value_states.new_empty(
            shape[:-1] + value_states.shape[-1:], dtype=self.dtype
        )
        self.keys = self._key_buffer[:, :, :0]
        self.values = self._value_buffer[:, :, :0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            raise RuntimeError(
                f"KV cache of {self.capacity} positions overflowed ({end}): the engine sizes it "
                "as prompt width + max_new_tokens, so a forward added positions it did not plan"
            )
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (finished rows leave the decode batch)."""
        if not self.is_initialized:
            return
        length = self.keys.shape[-2]
        # index_select, not `buffer[indices]`: on CPU advanced indexing copied the rows 4-7x
        # slower (a GRPO group's prompt cache spread to its rows: 0.9 ms a tensor, tiny-arith)
        self._key_buffer = self._key_buffer.index_select(0, indices)
        self._value_buffer = self._value_buffer.index_select(0, indices)
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the torch engine's KV cache does not repeat rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the torch engine's KV cache does no beam search")


def _preallocated_cache(
    config: Any, capacity: int, dtype: torch.dtype | None = None
) -> DynamicCache:
    """HF's `DynamicCache` for ``config`` with each full-attention layer preallocated for
    ``capacity`` positions in ``dtype`` (None: the model's; sliding-window and other special
    layers keep HF's own)."""
    cache = DynamicCache(config=config)
    cache.layers = [
        _PreallocatedLayer(capacity, dtype) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
