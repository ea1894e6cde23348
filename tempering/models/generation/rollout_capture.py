"""Model calls captured by rollout id: what an external harness's episode asked the server.

An external harness (docs/agentic.md, "External harnesses") makes its own model calls through
the trainer's OpenAI-compatible server. The trainer opens one rollout id per episode
(`RolloutCapture.open`) and hands the harness a base URL that names it,
``http://127.0.0.1:PORT/rollouts/<id>/v1`` (or the harness sends ``X-Rollout-ID: <id>`` to
the plain ``/v1`` routes). For every call under an open id the server records what it served:
the prompt's ids, the generated ids, the sampler's log-probs, each token's weight version and
the reply (content and tool calls). A call under an id that is not open (finished, never
issued) is refused with a 404 before anything is generated.

Plain `openai` clients send a later turn's history back as content and tool calls, without
the token ids the server returned. `attach` gives such an assistant message the ids of the
recorded call whose reply it repeats, so the server's splice (chat.py) continues the turn
from the ids the model generated rather than from a re-encoding of its text. When the harness
reports, the trainer `close`s the id and reassembles the episode from the calls
(`tempering.experience.external`).

    capture = RolloutCapture()
    service.capture = capture                 # the chat service records under open ids
    capture.open(["r1"])
    ... harness calls http://127.0.0.1:PORT/rollouts/r1/v1/chat/completions ...
    calls = capture.close("r1")               # [CapturedCall, ...] in the order served
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CapturedCall", "RolloutCapture", "reply_key"]


@dataclass(frozen=True)
class CapturedCall:
    """One model call the server served under a rollout id."""

    prompt_ids: list[int]
    generation_ids: list[int]
    logprobs: list[float]  # the sampler's, one per generated id
    weight_versions: list[int]  # the weight version of each generated id
    finish_reason: str
    message: dict[str, Any]  # the assistant message returned (content, tool calls, ids)


def reply_key(message: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What identifies an assistant reply across a client's round trip: its content and its
    tool calls' names and argument strings (ids and other fields a client may drop or add)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = (call.get("function") or {}) if isinstance(call, dict) else {}
        calls.append((str(fn.get("name", "")), str(fn.get("arguments", ""))))
    return str(message.get("content") or ""), tuple(calls)


_IDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class RolloutCapture:
    """Calls recorded per open rollout id; thread-safe (the server records from its event
    loop, the trainer opens and closes ids from its own thread).

    ``stats``: ``calls`` recorded, ``ids_attached`` (assistant messages given their recorded
    ids), ``late_calls`` (served after their id closed: not recorded),
    ``over_limit_calls`` (past `max_calls` in one rollout: not recorded, and the episode is
    marked as such)."""

    def __init__(self, max_calls: int = 256) -> None:
        self.max_calls = max_calls
        self.stats: collections.Counter[str] = collections.Counter()
        self._calls: dict[str, list[CapturedCall]] = {}
        self._over: set[str] = set()
        self._lock = threading.Lock()

    def open(self, rollout_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in rollout_ids:
                if rid in self._calls:
                    raise ValueError(f"rollout id {rid!r} is already open")
                self._calls[rid] = []

    def is_open(self, rollout_id: str) -> bool:
        with self._lock:
            return rollout_id in self._calls

    def close(self, rollout_id: str) -> tuple[list[CapturedCall], bool]:
        """The id's calls in the order served, and whether some were over `max_calls`; the
        id is closed (later calls under it are refused)."""
        with self._lock:
            calls = self._calls.pop(rollout_id, [])
            over = rollout_id in self._over
            self._over.discard(rollout_id)
            return calls, over

    def record(self, rollout_id: str, results: Sequence[Any], fallback_version: int = 0) -> None:
        """Record `results` (the `ChatResult`s of one request: its n choices) under the id."""
        with self._lock:
            calls = self._calls.get(rollout_id)
            if calls is None:
                self.stats["late_calls"] += len(results)
                return
            for r in results:
                if len(calls) >= self.max_calls:
                    self.stats["over_limit_calls"] += 1
                    self._over.add(rollout_id)
                    continue
                versions = r.generation_weight_versions
                if versions is None:
                    versions = [int(r.weight_version)] * len(r.generation_ids)
                calls.append(
                    CapturedCall(
                        prompt_ids=list(r.prompt_ids),
                        generation_ids=list(r.generation_ids),
                        logprobs=list(r.generation_logprobs),
                        weight_versions=list(versions),
                        finish_reason=str(r.finish_reason),
                        message=r.message,
                    )
                )
                self.stats["calls"] += 1

    def attach(self, rollout_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with the recorded ids on each assistant message that has none and
        repeats a reply recorded under the id (the latest such reply); others unchanged."""
        with self._lock:
            calls = list(self._calls.get(rollout_id, ()))
        if not calls:
            return messages
        by_reply = {reply_key(c.message): c for c in calls}  # later calls win
        out = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("generation_token_ids") is None:
                call = by_reply.get(reply_key(m))
                if call is not None:
                    m = {**m, **{k: call.message[k] for k in _IDS}}
                    with self._lock:
                        self.stats["ids_attached"] += 1
            out.append(m)
        return out

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)
