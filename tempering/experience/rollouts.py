"""The rollout loop: generate -> environment step -> append observation -> repeat.

One loop for single- and multi-turn episodes, batched across samples per turn, used both
in-process (`InProcessTurnClient`: straight into the chat service) and over HTTP
(`HttpTurnClient`: concurrent requests to the OpenAI-compatible server, which batches them).
Both build every prompt the same way (`tempering.models.generation.chat`), so turn t's prompt
is exactly turn t-1's prompt + generated ids + the template's tokens for the observation.

    batch = run_rollouts(client, samples, environments, sampling=SamplingConfig(...),
                         max_turns=3, max_seq_len=512)

Output: the BatchedDataDict the GRPO step trains on, one row per sample:
  input_ids [B, S] right-padded (the whole conversation), input_lengths [B],
  token_mask [B, S] (1 on every generated token of every turn, 0 elsewhere), sample_mask [B],
  generation_logprobs [B, S] (the sampler's log-probs on generated tokens, 0 elsewhere),
  rewards [B] (summed over turns), turns [B], truncated [B] (the episode did not end by
  itself: the turn limit or the sequence budget cut it), generation_lengths [B] (generated
  tokens over all turns), finish_reasons (the last turn's), message_logs (for logging).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tempering.data.episodes import EpisodeRecord, build_batch
from tempering.distributed.batched_data_dict import BatchedDataDict
from tempering.models.generation.chat import message_text
from tempering.models.generation.chat_service import (
    CONTEXT_LENGTH_EXCEEDED,
    ChatRequest,
    ChatResult,
    RequestError,
)
from tempering.models.generation.interfaces import SamplingConfig

log = logging.getLogger(__name__)

__all__ = [
    "HttpTurnClient",
    "InProcessTurnClient",
    "RolloutSample",
    "TurnClient",
    "problem_samples",
    "run_rollouts",
]


@dataclass
class RolloutSample:
    """One episode to roll out."""

    messages: list[dict[str, Any]]  # the conversation so far (usually one user message)
    metadata: dict[str, Any]  # what the environment needs (ground_truth, ...)
    task_name: str  # which environment scores it
    prompt_ids: list[int] | None = None  # first-turn ids, when the caller encoded the prompt
    tools: list[dict[str, Any]] | None = None  # OpenAI tool specs offered to the model


def problem_samples(
    problems: Sequence[Any], tokenizer: Any, use_chat_template: bool, in_process: bool
) -> list[RolloutSample]:
    """One episode per problem (`data.grpo_problems.Problem`), as GRPO and ``tempering eval``
    start them: the problem's system and user messages, the tools its environment offers
    (the class attribute ``tools``), and in process the first prompt's ids encoded once here.
    A problem offered tools gets no ids: the chat service renders the tools into its prompt,
    as it does for an HTTP client (encoding the bare prompt here hid them from the model)."""
    from tempering.data.prompts import prompt_token_ids
    from tempering.environments.registry import get_environment_class, offered_tools

    samples = []
    for p in problems:
        get_environment_class(p.task_name)  # an unknown task is named here
        tools = offered_tools(p.task_name)
        system = [{"role": "system", "content": p.system}] if p.system else []
        ids = None
        if in_process and not tools:
            ids = prompt_token_ids(p.prompt, tokenizer, use_chat_template, p.system)
        samples.append(RolloutSample(
            messages=[*system, {"role": "user", "content": p.prompt}],
            metadata={"ground_truth": p.answer, "prompt": p.prompt},
            task_name=p.task_name,
            prompt_ids=ids,
            tools=tools,
        ))  # fmt: skip
    return samples


class TurnClient(Protocol):
    def complete(self, requests: Sequence[ChatRequest]) -> list[ChatResult | RequestError]:
        """One turn for each request: a result, or the RequestError that refused it."""
        ...


class InProcessTurnClient:
    """Turns served by a `ChatCompletionService` in this process (no HTTP)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def complete(self, requests: Sequence[ChatRequest]) -> list[ChatResult | RequestError]:
        return self.service.complete_many(requests)


class HttpTurnClient:
    """Turns served over HTTP by an OpenAI-compatible server (ours), all requests at once.

    Over https the server's certificate is verified against `ca_file` (the server's
    ``ca_file``: its own certificate when self-signed), else the system's trust store."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        ca_file: str | None = None,
    ) -> None:
        import ssl

        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.ssl: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            self.ssl = ssl.create_default_context(cafile=ca_file)
        elif ca_file is not None:
            raise ValueError(f"HttpTurnClient: ca_file={ca_file!r} given for {base_url}, which "
                             "is not https; drop ca_file or use the server's https URL")  # fmt: skip

    def complete(self, requests: Sequence[ChatRequest]) -> list[ChatResult | RequestError]:
        import asyncio

        from tempering.utils.aio import run_async

        async def all_turns() -> list[ChatResult | RequestError]:
            return list(await asyncio.gather(*(self._one(r) for r in requests)))

        return run_async(all_turns())

    async def _one(self, request: ChatRequest) -> ChatResult | RequestError:
        import aiohttp

        from tempering.utils.aio import http_session

        if request.prompt_ids is not None:
            raise ValueError(
                "HttpTurnClient cannot send raw prompt ids (the server builds prompts from "
                "messages); use the chat template for the first turn (data.use_chat_template)"
            )
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": request.messages,
            "temperature": 0.0 if request.greedy else s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_new_tokens,
            "logprobs": True,
            "top_logprobs": 0,
        }
        if s.top_k is not None:
            body["top_k"] = s.top_k
        if s.stop_strings:
            body["stop"] = list(s.stop_strings)
        if request.tools:
            body["tools"] = request.tools
            body["tool_choice"] = "auto" if request.parse_tools else "none"
        headers = dict(self.headers)
        if request.session_id:
            headers["X-Session-ID"] = request.session_id
        session = await http_session()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        tls = {"ssl": self.ssl} if self.ssl is not None else {}
        async with session.post(
            self.url, json=body, headers=headers, timeout=timeout, **tls
        ) as resp:
            payload = await resp.json(content_type=None)
        if resp.status != 200:
            err = payload.get("error", {}) if isinstance(payload, dict) else {}
            error = RequestError(
                str(err.get("message", payload)), err.get("param"), resp.status, err.get("code")
            )
            if error.code == CONTEXT_LENGTH_EXCEEDED:
                return error
            raise RuntimeError(f"{self.url} answered {resp.status}: {error.message}")
        return result_from_response(payload)


def result_from_response(payload: dict[str, Any]) -> ChatResult:
    """A chat completion (training mode) back into a ChatResult."""
    from tempering.models.generation.chat import ParsedToolCalls

    choice = payload["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    return ChatResult(
        prompt_ids=list(message["prompt_token_ids"]),
        generation_ids=list(message["generation_token_ids"]),
        generation_logprobs=list(message["generation_log_probs"]),
        top_logprobs=None,
        text=message.get("content") or "",
        parsed=ParsedToolCalls(message.get("content"), calls),
        finish_reason=choice["finish_reason"],
        weight_version=int(payload.get("weight_version", -1)),
        replica=None,
        generation_weight_versions=message.get("generation_weight_versions"),
    )


# --------------------------------------------------------------------------- the loop
@dataclass
class _Episode:
    sample: RolloutSample
    messages: list[dict[str, Any]]
    metadata: dict[str, Any]
    sampling: SamplingConfig
    spans: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
    versions: list[list[int] | None] = field(default_factory=list)  # per span, per token
    last: ChatResult | None = None
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    cut: bool = False  # ended by the batch's deadline
    too_long: str | None = None  # the first prompt left no room to generate: why


def run_rollouts(
    client: TurnClient,
    samples: Sequence[RolloutSample],
    environments: Mapping[str, Any],
    *,
    sampling: SamplingConfig,
    max_turns: int,
    max_seq_len: int,
    greedy: bool = False,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> BatchedDataDict:
    """Roll every sample out to the end of its episode (see the module docstring).

    ``deadline_s`` (async GRPO's ``group_timeout_s``): no turn after the first starts once
    this many seconds have passed since the call; episodes still running end there, truncated,
    and the batch gains ``deadline_cut`` [B] (1 where the deadline ended the episode), counted
    and logged. A turn in flight is bounded by the generation and environment deadlines."""
    from tempering.environments.registry import route_step

    episodes = [
        _Episode(s, list(s.messages), dict(s.metadata), sampling) for s in samples
    ]  # fmt: skip
    start = clock()
    for turn in range(max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        if turn and deadline_s is not None and clock() - start > deadline_s:
            _cut(active, turn, deadline_s)
            break
        requests = [_request(e, greedy, turn == 0, max_seq_len) for e in active]
        results = client.complete(requests)
        stepped: list[_Episode] = []
        for ep, result in zip(active, results, strict=True):
            if isinstance(result, RequestError):  # the observation left no room to generate
                ep.done = ep.truncated = True
                ep.too_long = None if turn else str(result)  # the prompt itself: no turn at all
                continue
            _add_turn(ep, result)
            stepped.append(ep)
        if not stepped:
            break
        ret = route_step(
            environments,
            [e.messages for e in stepped],
            [e.metadata for e in stepped],
            [e.sample.task_name for e in stepped],
        )
        for j, ep in enumerate(stepped):
            ep.reward += float(ret.rewards[j])
            ep.metadata = ret.metadata[j] if ret.metadata[j] is not None else ep.metadata
            if bool(ret.terminateds[j]):
                ep.done = True
                continue
            ep.messages.append(dict(ret.observations[j]))
            if ret.next_stop_strings[j] is not None:
                ep.sampling = dataclasses.replace(sampling, stop_strings=ret.next_stop_strings[j])
            if len(ep.last.prompt_ids) + len(ep.last.generation_ids) >= max_seq_len:  # type: ignore[union-attr]
                ep.done = ep.truncated = True
    for ep in episodes:
        if not ep.done:  # the turn limit ended an episode its environment had not ended
            ep.truncated = True
    batch = build_batch([_record(e) for e in episodes])
    batch["prompt_too_long"] = torch.tensor([int(e.too_long is not None) for e in episodes])
    _warn_too_long(episodes, max_seq_len)
    if deadline_s is not None:
        batch["deadline_cut"] = torch.tensor([int(e.cut) for e in episodes])
    return batch


def _cut(active: list[_Episode], turn: int, deadline_s: float) -> None:
    """End the episodes still running when the batch's deadline passed (truncated, counted)."""
    for ep in active:
        ep.done = ep.truncated = ep.cut = True
    log.warning(
        "rollouts: %d episode(s) still running after %d turn(s) passed the batch deadline of "
        "%.0f s (grpo.async_grpo.group_timeout_s); ended there as truncated",
        len(active), turn, deadline_s,
    )  # fmt: skip


def _warn_too_long(episodes: Sequence[_Episode], max_seq_len: int) -> None:
    """Episodes whose first prompt alone filled the sequence budget generated nothing and are
    masked out (they score and teach nothing): counted in the batch, logged here."""
    too_long = [e for e in episodes if e.too_long is not None]
    if too_long:
        log.warning(
            "rollouts: %d of %d episode(s) got no turn: the prompt left no room to generate "
            "within max_seq_len=%d (policy.max_total_sequence_length), e.g. %r (%s); they are "
            "masked out. Raise the limit, or shorten or filter those prompts",
            len(too_long), len(episodes), max_seq_len,
            message_text(too_long[0].messages[-1].get("content"))[:60], too_long[0].too_long,
        )  # fmt: skip


def _request(ep: _Episode, greedy: bool, first: bool, max_seq_len: int) -> ChatRequest:
    return ChatRequest(
        max_total_tokens=max_seq_len,
        messages=ep.messages,
        sampling=ep.sampling,
        greedy=greedy,
        tools=ep.sample.tools,
        parse_tools=bool(ep.sample.tools),
        prompt_ids=ep.sample.prompt_ids if first else None,
    )


def _add_turn(ep: _Episode, result: ChatResult) -> None:
    """Record a turn; its prompt must extend everything generated so far (the splice)."""
    if ep.last is not None:
        before = ep.last.prompt_ids + ep.last.generation_ids
        if result.prompt_ids[: len(before)] != before:
            raise RuntimeError(
                f"turn {ep.turns + 1} of a {ep.sample.task_name!r} episode does not start with "
                "the previous turn's prompt + generation ids; its tokens would train off-policy"
            )
    ep.spans.append((len(result.prompt_ids), result.generation_ids, result.generation_logprobs))
    ep.versions.append(result.generation_weight_versions)
    ep.last = result
    ep.turns += 1
    ep.messages.append(result.message)


def _record(ep: _Episode) -> EpisodeRecord:
    last = ep.last
    return EpisodeRecord(
        ids=(last.prompt_ids + last.generation_ids) if last else list(ep.sample.prompt_ids or []),
        spans=ep.spans,
        reward=ep.reward,
        turns=ep.turns,
        truncated=ep.truncated,
        finish_reason=last.finish_reason if last else "length",
        messages=ep.messages,
        masked=last is None,
        versions=ep.versions if all(v is not None for v in ep.versions) else None,
    )
