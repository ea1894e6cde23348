"""The generation seam: what the controller calls to sample tokens from a generator.

Backends (the torch-native engine here, the vLLM worker elsewhere) implement
`GenerationInterface`; `SamplingConfig` carries the plain sampling arguments they all accept.
Data in and out follows docs/CONTRACTS.md ("Generation"):

    generate(BDD{input_ids [B, S] right-padded, input_lengths [B],
                 max_new_tokens [B] (optional: a per-row cap under the call's max_new_tokens)},
             greedy=False, sampling=None (a SamplingConfig for this call only))
      -> BDD{output_ids [B, S+N] right-padded (prompt, then generated tokens),
             logprobs [B, S+N] (0 on prompt and padding; generated token t scored at its own
                                position, from log_softmax(logits / temperature) BEFORE
                                top-k/top-p filtering),
             generation_lengths [B], unpadded_sequence_lengths [B],
             finish_reasons: list["stop" | "length"],
             top_logprob_ids, top_logprobs [B, S+N, k] (only when sampling.top_logprobs = k > 0:
                                the k most likely tokens at each generated position, same
                                temperature as `logprobs`)}

Per-call sampling exists for the OpenAI-compatible server and multi-turn rollouts: requests
differ in temperature, stop strings and token budget, and a backend serves each call with the
settings it is given while keeping its own random stream.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """Plain sampling arguments shared by all generation backends."""

    temperature: float = 1.0
    """Softmax temperature (> 0). Log-probs are reported at this temperature, also when greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with total probability >= top_p."""
    top_k: int | None = None
    """Keep only the k most likely tokens; None keeps all."""
    max_new_tokens: int = 16
    """Generate at most this many tokens per sequence (finish_reason "length" when reached)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sequence (kept in the output), in addition to the tokenizer's eos."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a sequence once the generated text contains one (tokens kept)."""
    greedy: bool = False
    """Take the argmax instead of sampling (a `generate(..., greedy=True)` call also does)."""
    seed: int | None = None
    """Seed of the sampler's random generator; None draws one from torch's global RNG. A
    per-call SamplingConfig with a seed reseeds the backend's generator for that call."""
    top_logprobs: int = 0
    """Also report the k most likely tokens and their log-probs at each generated position."""

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature={self.temperature} must be > 0 (use greedy=True)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k={self.top_k} must be >= 1 or None (no top-k)")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.top_logprobs < 0:
            problems.append(f"top_logprobs={self.top_logprobs} must be >= 0")
        if any(not s for s in self.stop_strings):
            problems.append(f"stop_strings={self.stop_strings!r} must not contain empty strings")
        if problems:
            raise ValueError("Invalid SamplingConfig: " + "; ".join(problems))


@runtime_checkable
class GenerationInterface(Protocol):
    """A generator: samples continuations and receives refitted policy weights."""

    def generate(
        self, data: Mapping[str, Any], greedy: bool = False, sampling: SamplingConfig | None = None
    ) -> Mapping[str, Any]:
        """Continue each prompt; returns the BatchedDataDict described in the module docstring.
        `sampling` replaces the backend's own sampling settings for this call only."""
        ...

    def prepare_for_generation(self) -> None:
        """Make the generator ready (e.g. wake it, move weights to the device) before generate."""
        ...

    def finish_generation(self) -> None:
        """Release what generation holds (e.g. KV cache memory) so training can use it."""
        ...

    def update_weights(self, weights: Mapping[str, Any]) -> None:
        """Refit: load new weights in place, by parameter name (a full or partial state dict;
        remote backends may accept handles such as Ray object refs to one)."""
        ...


StepCallback = Callable[
    [list[int], list[int], list[float], tuple[list[list[int]], list[list[float]]] | None],
    Collection[int],
]
"""``on_step(rows, tokens, logprobs, top)`` after one decode step: the batch rows that
produced a token, those tokens and their log-probs (and ``(top_ids, top_logprobs)`` per row
when asked); returns the rows that must stop now (their client is gone)."""


@runtime_checkable
class StreamingGeneration(Protocol):
    """A backend that reports every decode step (`StepCallback`) and stops rows on request:
    what streamed responses and disconnects need. The torch engine is one; a backend without
    it is served whole, and a streamed response then arrives when its generation ends."""

    reports_steps: bool  # True: `generate` takes `on_step`

    def generate(
        self,
        data: Mapping[str, Any],
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
        on_step: StepCallback | None = None,
    ) -> Mapping[str, Any]: ...


def sampling_config(
    config: SamplingConfig | None, sampling_args: Mapping[str, Any], owner: str
) -> SamplingConfig:
    """A backend's settings from its constructor: `config`, or the `SamplingConfig` fields as
    keywords (`sampling_args`), not both (`owner` names the backend in the error)."""
    if config is not None and sampling_args:
        raise TypeError(
            f"{owner} takes a SamplingConfig or sampling keywords "
            f"({sorted(sampling_args)}), not both; put them into the SamplingConfig."
        )
    return config if config is not None else SamplingConfig(**sampling_args)


def check_input_lengths(input_ids: Any, lengths: Any) -> None:
    """ValueError unless ``input_lengths`` [B] fit the right-padded ``input_ids`` [B, S]."""
    B, S = input_ids.shape
    if lengths.shape != (B,) or bool((lengths < 1).any()) or bool((lengths > S).any()):
        raise ValueError(
            f"input_lengths must be [B]={B} values in [1, {S}] (prompt width); got "
            f"{lengths.tolist()}."
        )
