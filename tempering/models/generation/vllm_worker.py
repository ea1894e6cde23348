"""vLLM generation worker: fast batched sampling with in-place weight refit.

`VllmGenerationWorker` implements `GenerationInterface` (docs/CONTRACTS.md, "Generation") on
top of one `vllm.LLM` engine. It runs inside a Ray actor in the vLLM extra's own venv
(`ACTOR_ENVIRONMENT_REGISTRY` maps this class's FQN to `uv run --locked --extra vllm`), so the
driver never imports vLLM. Standalone use, in that venv:

    worker = VllmGenerationWorker("/path/to/hf_model", temperature=1.0, max_new_tokens=64)
    out = worker.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths))
    worker.update_weights(policy_state_dict)   # refit, into the running engine
    worker.shutdown()

vLLM 0.32 details this module relies on:

- Prompts go in as token ids (`TokensPrompt`), never as text.
- Log-probs: the engine is built with `logprobs_mode="processed_logprobs"` and each request
  asks for `logprobs=0` (just the sampled token). vLLM's default, "raw_logprobs", is
  `log_softmax(logits)` at temperature 1; "processed_logprobs" is `log_softmax` after
  temperature AND top-k/top-p. With top-k/top-p off that is exactly the contract's
  `log_softmax(logits / temperature)`, so this worker refuses top-k/top-p (vLLM cannot return
  the pre-filter distribution at temperature T). Greedy requests (vLLM temperature 0) get
  `log_softmax(logits)`, i.e. temperature 1: exact only when `temperature == 1`.
- Refit: `update_weights` sends `(name, tensor)` pairs through `LLM.collective_rpc` to
  `WeightUpdateExtension.tempering_load_weights` (vllm_extension.py), which uses vLLM's
  in-place `reload_weights`; then the prefix cache is reset so no KV computed with the old
  weights is reused. The engine is never restarted.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set here unless already set) keeps the engine core in
  this process: `LLM()` starts in seconds instead of ~75 s on CPU, and `collective_rpc`
  arguments (the weights) are passed by reference instead of serialised.
- LoRA (``lora_rank``, the adapter refit): the engine is built with ``enable_lora`` and one
  adapter slot; `update_adapter` writes the trained adapters in PEFT's format to a private
  folder and loads them with ``add_lora(LoRARequest(..., load_inplace=True))`` under one fixed
  id, replacing the last ones; every request then runs with them (vLLM's punica kernels, CPU
  too). The base weights never change.
- CPU: run with `enforce_eager=True` and pass `kv_cache_memory_bytes` (vLLM's CPU default
  reserves a large share of RAM). fp32 and bf16 both work, refit included. Sleep mode
  (`enable_sleep_mode`) exists only on GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.interfaces import (
    SamplingConfig,
    check_input_lengths,
    sampling_config,
)
from tempering.models.generation.vllm_extension import EXTENSION_FQN

logger = logging.getLogger(__name__)

_FINISH_REASONS = ("stop", "length")


class VllmGenerationWorker:
    """One vLLM engine behind `GenerationInterface` (see module docstring)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: SamplingConfig | None = None,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_sleep_mode: bool = False,
        kv_cache_memory_bytes: int | None = None,
        lora_rank: int | None = None,
        tokenizer_path: str | None = None,
        **sampling_args: Any,
    ) -> None:
        """`config`, or the `SamplingConfig` fields as keywords (temperature, top_p, top_k,
        max_new_tokens, stop_token_ids, stop_strings, greedy, seed), not both.

        Engine arguments go to `vllm.LLM` unchanged; `dtype` is "auto" (the checkpoint's),
        "bfloat16", "float16" or "float32". `enable_sleep_mode=True` (GPU only) lets
        `finish_generation` free the GPU for training in colocated mode. `lora_rank`: the
        adapters' rank, for `update_adapter` (None: merged weights only, `update_weights`).
        `tokenizer_path`: the run's tokenizer (`policy.tokenizer.name`), default the model's.
        """
        self.config = sampling_config(config, sampling_args, "VllmGenerationWorker")
        _check_filters(self.config)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # deferred: only this worker's venv has vLLM

        if enable_sleep_mode and not torch.cuda.is_available():
            raise ValueError(
                "enable_sleep_mode=True needs a GPU (vLLM sleep mode offloads GPU memory); "
                "on CPU set enable_sleep_mode=False."
            )
        self._vllm = vllm
        self.model_path = str(model_path)
        self.enable_sleep_mode = enable_sleep_mode
        self._next_seed: int | None = None  # set by reseed()
        self.llm = vllm.LLM(
            model=self.model_path,
            tokenizer=str(tokenizer_path or self.model_path),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            seed=self.config.seed if self.config.seed is not None else 0,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_FQN,
            **_lora_engine_args(lora_rank),
        )
        self._adapter_dir = None if lora_rank is None else Path(tempfile.mkdtemp(
            prefix="tempering_adapter_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ))  # fmt: skip
        self._lora_request: Any = None  # the adapters every request runs with
        tokenizer = self.llm.get_tokenizer()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None
        if pad is None:
            pad = tokenizer.eos_token_id
        if pad is None:
            raise ValueError(
                f"The tokenizer of {self.model_path} has neither a pad nor an eos token; add "
                "one to its tokenizer_config.json."
            )
        self.pad_token_id = int(pad)
        self._asleep = False

    # ---- GenerationInterface ---------------------------------------------------------------

    def prepare_for_generation(self) -> None:
        """Colocated mode: wake the engine (weights back on the GPU, KV cache reallocated)."""
        if self.enable_sleep_mode and self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def finish_generation(self) -> None:
        """Colocated mode: sleep (level 1: weights offloaded to CPU, KV cache discarded)."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def reseed(self, seed: int) -> None:
        """Per-request seeds from now on: ``seed`` offset by rank, one per request."""
        self._next_seed = (
            seed * 1_000_003 % 2**31 + 1_000 * int(os.environ.get("RANK", "0")) * 2**16
        )

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Refit: load a (full or per-layer partial) HF-named state dict into the running engine."""
        self._check_awake("update_weights")
        pairs = [(name, tensor.detach()) for name, tensor in weights.items()]
        loaded = self.llm.collective_rpc("tempering_load_weights", args=(pairs,))
        if any(n != len(pairs) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} tensors, expected {len(pairs)}.")
        # KV blocks cached for a prompt prefix were computed with the old weights.
        self.llm.reset_prefix_cache()

    def update_adapter(self, adapter: Mapping[str, Any]) -> None:
        """Adapter-only refit: ``adapter`` = ``{"tensors": PEFT-named adapter tensors,
        "config": adapter_config.json's content}`` (`WeightStreamer.adapter`), loaded in place
        of the last adapters; every later request runs with them."""
        self._check_awake("update_adapter")
        if self._adapter_dir is None:
            raise RuntimeError(
                "update_adapter on a vLLM worker built without lora_rank: start it with the "
                "adapters' rank (policy.generation.vllm_cfg.lora_adapter_refit=true does)"
            )
        from vllm.lora.request import LoRARequest

        from tempering.models.policy.lora import save_peft_adapter

        folder = save_peft_adapter(
            self._adapter_dir / "policy", adapter["tensors"], adapter["config"]
        )
        request = LoRARequest("tempering-policy", 1, str(folder), load_inplace=True)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter written to {folder}")
        self._lora_request = request
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old adapters

    def generate(
        self, data: Mapping[str, Any], greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> BatchedDataDict:
        """Continue each right-padded prompt; returns the contract's BatchedDataDict
        (`sampling` overrides this worker's settings for the call; ``data["max_new_tokens"]``
        optionally caps each row)."""
        cfg = sampling if sampling is not None else self.config
        _check_filters(cfg)
        greedy = greedy or cfg.greedy
        input_ids = data["input_ids"].long().cpu()  # [B, S] right-padded
        lengths = data["input_lengths"].long().cpu()  # [B]
        check_input_lengths(input_ids, lengths)
        B = len(lengths)
        caps = [cfg.max_new_tokens] * B
        if data.get("max_new_tokens") is not None:
            caps = [min(cfg.max_new_tokens, int(c)) for c in data["max_new_tokens"]]
        if greedy and cfg.temperature != 1.0:
            logger.warning(
                "greedy generation with temperature=%s: vLLM reports log-probs at "
                "temperature 1 for greedy requests.",
                cfg.temperature,
            )
        prompts = [
            self._vllm.TokensPrompt(prompt_token_ids=input_ids[b, : lengths[b]].tolist())
            for b in range(B)
        ]
        seeds = self._request_seeds(sampling, greedy, B)
        params = [
            self._sampling_params(cfg, greedy, cap, s) for cap, s in zip(caps, seeds, strict=True)
        ]
        outputs = self.llm.generate(
            prompts, params, use_tqdm=False, lora_request=self._lora_request
        )
        completions = [out.outputs[0] for out in outputs]
        return self._contract_output(input_ids, lengths, completions, cfg.top_logprobs)

    # ---- extras ----------------------------------------------------------------------------

    def engine_info(self) -> dict[str, Any]:
        """Identity of the running engine: this process's pid, the LLM object's id, and each
        vLLM worker's pid/model id (tests use it to prove a refit did not restart anything)."""
        return {
            "pid": os.getpid(),
            "llm_id": id(self.llm),
            "workers": self.llm.collective_rpc("tempering_worker_info"),
        }

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the worker is unusable afterwards."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    # ---- internals -------------------------------------------------------------------------

    def _check_awake(self, method: str) -> None:
        if self._asleep:
            raise RuntimeError(
                f"{method} called while the vLLM engine sleeps; call "
                "prepare_for_generation() first (sleep level 1 keeps no writable weights)."
            )

    def _request_seeds(
        self, sampling: SamplingConfig | None, greedy: bool, n: int
    ) -> list[int | None]:
        """One seed per request of a call. A per-call seed seeds each request of the call;
        after `reseed` (GRPO: every step) request i gets its own seed from the step's stream,
        so samples of one prompt differ and a resumed run draws what an uninterrupted one
        would. Otherwise the engine's own seed (set at start-up) governs."""
        seed = sampling.seed if sampling is not None else None
        if seed is None and self._next_seed is not None and not greedy:
            seeds: list[int | None] = [self._next_seed + i for i in range(n)]
            self._next_seed += n
            return seeds
        return [seed] * n

    def _contract_output(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, completions: list[Any], k: int
    ) -> BatchedDataDict:
        """vLLM's completions laid out as docs/CONTRACTS.md's right-padded tensors."""
        B, S = input_ids.shape
        gen_lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
        T = int(gen_lengths.max()) if B else 0
        # Right-padded output: prompt, then generated tokens, then padding.  [B, S + T]
        output_ids = torch.full((B, S + T), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((B, S + T), dtype=torch.float32)
        top_ids = torch.zeros((B, S + T, k), dtype=torch.long)
        top_values = torch.zeros((B, S + T, k), dtype=torch.float32)
        finish_reasons = []
        for b, completion in enumerate(completions):
            L, n = int(lengths[b]), len(completion.token_ids)
            output_ids[b, :L] = input_ids[b, :L]
            output_ids[b, L : L + n] = torch.tensor(completion.token_ids, dtype=torch.long)
            steps = list(zip(completion.token_ids, completion.logprobs, strict=True))
            logprobs[b, L : L + n] = torch.tensor([step[tok].logprob for tok, step in steps])
            for t, (_, step) in enumerate(steps if k else []):
                ranked = sorted(step.items(), key=lambda kv: kv[1].rank)[:k]
                top_ids[b, L + t, : len(ranked)] = torch.tensor([i for i, _ in ranked])
                top_values[b, L + t, : len(ranked)] = torch.tensor([v.logprob for _, v in ranked])
            if completion.finish_reason not in _FINISH_REASONS:
                raise RuntimeError(
                    f"vLLM finished sequence {b} with reason {completion.finish_reason!r} "
                    f"({completion.stop_reason!r}); expected one of {_FINISH_REASONS}."
                )
            finish_reasons.append(completion.finish_reason)
        out = BatchedDataDict(
            output_ids=output_ids,
            logprobs=logprobs,
            generation_lengths=gen_lengths,
            unpadded_sequence_lengths=lengths + gen_lengths,
            finish_reasons=finish_reasons,
        )
        if k:
            out["top_logprob_ids"], out["top_logprobs"] = top_ids, top_values
        return out

    def _sampling_params(
        self, cfg: SamplingConfig, greedy: bool, max_tokens: int, seed: int | None
    ) -> Any:
        return self._vllm.SamplingParams(
            temperature=0.0 if greedy else cfg.temperature,
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=list(cfg.stop_token_ids),
            stop=list(cfg.stop_strings) or None,
            include_stop_str_in_output=True,  # the contract keeps the stop tokens
            detokenize=bool(cfg.stop_strings),  # text is only needed to spot stop strings
            logprobs=cfg.top_logprobs,  # the sampled token's log-prob (+ the top k)
        )


# the ranks vLLM 0.32 accepts as max_lora_rank (an adapter of a lower rank fits the slot)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_engine_args(rank: int | None) -> dict[str, Any]:
    """`vllm.LLM` arguments for one adapter slot of at least ``rank`` (none without LoRA)."""
    if rank is None:
        return {}
    fitting = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(
            f"LoRA rank {rank} exceeds vLLM's largest adapter rank {_VLLM_LORA_RANKS[-1]}; "
            "lower policy.dtensor_cfg.lora_cfg.dim or set vllm_cfg.lora_adapter_refit=false"
        )
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": fitting[0]}


def _check_filters(cfg: SamplingConfig) -> None:
    if cfg.top_k is not None or cfg.top_p < 1.0:
        raise ValueError(
            f"VllmGenerationWorker: top_k={cfg.top_k}, top_p={cfg.top_p} "
            "is not supported: vLLM 0.32 reports log-probs either before temperature or "
            "after top-k/top-p, never log_softmax(logits / temperature) before filtering as "
            "docs/CONTRACTS.md requires. Set top_k=None and top_p=1.0, or use the torch "
            "engine (policy.generation.backend=torch)."
        )
