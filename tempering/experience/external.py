"""Episodes from an external harness: the trainer hands out prompts, the harness makes its own
model calls, the server records them by rollout id, and the trainer rebuilds the episodes.

``grpo.rollout_transport=external`` (docs/agentic.md, "External harnesses"). For each batch,
`ExternalHarness.rollouts` opens one rollout id per episode on the server's `RolloutCapture`
and gives the harness one task per episode (a JSON object):

    {"rollout_id": "...", "base_url": "http://127.0.0.1:PORT/rollouts/<id>/v1",
     "model": "policy", "messages": [{"role": "user", "content": "Q: 23+45=? A:"}],
     "answer": "68", "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6}}

The harness points any OpenAI client at ``base_url`` (or sends ``X-Rollout-ID`` to the plain
``/v1`` URL) and reports one result per task: ``{"rollout_id": "...", "reward": 1.0}``, or
``{"rollout_id": "...", "error": "..."}`` when its episode failed. Transport: a command (one
task per stdin line, one result per stdout line; `run_harness_command`, confined as below) or
an endpoint (``POST {"tasks": [...]}`` answered with ``{"results": [...]}``).

Reassembly (`assemble`): an episode's calls, ordered by prompt length, must chain -- each
call's prompt starts with the previous call's prompt + generated ids (the server's splice
makes it so for a history sent back as served, `RolloutCapture.attach` for plain assistant
messages). The episode is then ONE training row: the last call's prompt + generation, with
every call's generated tokens trained on (token_mask 1, the sampler's log-probs) and
everything else (prompt, tool results, template tokens) masked. What cannot be trained on is
masked (sample_mask 0: no loss, out of its group's baseline) and counted, never dropped:

- ``failed``: the harness reported an error, no result, a result without a finite reward,
  or the episode made no model call (or more than ``max_calls_per_episode``);
- ``noncontiguous``: some call's prompt does not extend the previous call (the harness
  rewrote, summarised or forked the history): the policy here is to mask the whole episode,
  since the reward belongs to all of its turns;
- ``mixed_weight_versions``: its tokens came from more than one weight version.

Confinement of a harness command (house rule: code that handles model output runs in a
subprocess with limits): its own session (the whole process group is killed at the deadline),
``RLIMIT_AS`` and ``RLIMIT_CPU``, an environment of PATH, HOME, LANG and VIRTUAL_ENV plus
the configured ``env`` (the server's API key as ``OPENAI_API_KEY``; no other secret of the
trainer's), stdin/stdout as its only channel, its output read up to a byte limit and parsed
as untrusted JSON. It keeps the network: it must reach the server.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import subprocess
import tempfile
import threading
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tempering.data.episodes import EpisodeRecord, build_batch
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.rollout_capture import CapturedCall, RolloutCapture

if TYPE_CHECKING:
    from tempering.config.schemas import GRPOMasterConfig

log = logging.getLogger(__name__)

__all__ = ["COUNTERS", "ExternalHarness", "HarnessSettings", "assemble", "run_harness_command"]

# what each step logs as rollouts/external_<name> (tempering.utils.metric_docs)
COUNTERS = ("episodes", "model_calls", "failed", "noncontiguous", "mixed_weight_versions",
            "ids_attached")  # fmt: skip
_ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "VIRTUAL_ENV", "TMPDIR")


@dataclass(frozen=True)
class HarnessSettings:
    """Plain arguments (the GRPO builder reads them from ``grpo.external_harness``)."""

    command: list[str] | None = None
    endpoint: str | None = None
    processes: int = 1
    timeout_s: float = 300.0
    memory_limit_mb: int = 4096
    cpu_limit_s: int = 600
    max_output_bytes: int = 16 * 1024 * 1024
    env: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- reassembly
def assemble(
    calls: Sequence[CapturedCall], result: dict[str, Any] | None, pad_token_id: int = 0
) -> tuple[EpisodeRecord, str | None]:
    """One episode from its recorded calls and the harness's result: the record, and why it
    is masked (``failed``, ``noncontiguous``, ``mixed_weight_versions``) or None."""
    reward, why = _reward(result)
    ordered = sorted(calls, key=lambda c: len(c.prompt_ids))  # stable: served order on ties
    messages = [c.message for c in ordered]
    if why is None and not ordered:
        why = "failed"  # nothing to train on: the harness never called the model
    seen: list[int] = []
    spans: list[tuple[int, list[int], list[float]]] = []
    for c in ordered:
        if c.prompt_ids[: len(seen)] != seen:
            why = why or "noncontiguous"
            break
        spans.append((len(c.prompt_ids), c.generation_ids, c.logprobs))
        seen = c.prompt_ids + c.generation_ids
    versions = {v for c in ordered for v in c.weight_versions}
    if why is None and len(versions) > 1:
        why = "mixed_weight_versions"
    last = ordered[-1] if ordered else None
    record = EpisodeRecord(
        ids=(last.prompt_ids + last.generation_ids) if last else [pad_token_id],
        spans=[] if why else spans,  # a masked episode trains no token
        reward=reward if why != "failed" else 0.0,
        turns=len(ordered),
        truncated=last is not None and last.finish_reason == "length",
        finish_reason=last.finish_reason if last else "error",
        messages=messages,
        masked=why is not None,
    )
    return record, why


def _reward(result: dict[str, Any] | None) -> tuple[float, str | None]:
    if result is None or result.get("error") is not None:
        return 0.0, "failed"
    reward = result.get("reward")
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        return 0.0, "failed"
    return float(reward), None


# ---------------------------------------------------------------------------- harness
@dataclass(eq=False)
class ExternalHarness:
    """GRPO's rollout source with ``grpo.rollout_transport=external``: problems -> tasks ->
    the harness -> the recorded calls -> the training batch (`build_batch`'s rows). It sits
    among the run's environments, so its counters are logged each step
    (``rollouts/external_*``, `global_post_process_and_metrics`)."""

    settings: HarnessSettings
    capture: RolloutCapture
    server_url: str  # the generation server's root, e.g. http://127.0.0.1:PORT
    model_name: str
    api_key: str | None = None
    ca_file: str | None = None
    pad_token_id: int = 0
    stats: Counter[str] = field(default_factory=Counter, init=False)

    def rollouts(
        self,
        problems: Sequence[Any],
        *,
        sampling: SamplingConfig,
        greedy: bool = False,
        repeat: int = 1,
    ) -> Any:
        """`repeat` episodes per problem (`data.grpo_problems.Problem`), all through the
        harness; one row per episode in problem order."""
        params = {
            "temperature": 0.0 if greedy else sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
        }
        tasks = [self._task(p, params) for p in problems for _ in range(repeat)]
        ids = [t["rollout_id"] for t in tasks]
        attached = self.capture.snapshot().get("ids_attached", 0)
        self.capture.open(ids)
        try:
            results = self.run(tasks)
        finally:
            closed = [self.capture.close(rid) for rid in ids]
        episodes = []
        for rid, (calls, over_limit) in zip(ids, closed, strict=True):
            result = None if over_limit else results.get(rid)
            record, why = assemble(calls, result, self.pad_token_id)
            episodes.append(record)
            self.stats["episodes"] += 1
            self.stats["model_calls"] += len(calls)
            if why is not None:
                if not self.stats[why]:  # the first of each kind in a step, in full
                    log.warning("external harness: episode %s masked (%s): %s", rid, why,
                                str(result)[:300] if why == "failed" else f"{len(calls)} calls")  # fmt: skip
                self.stats[why] += 1
        self.stats["ids_attached"] += self.capture.snapshot().get("ids_attached", 0) - attached
        return build_batch(episodes, self.pad_token_id)

    def _task(self, problem: Any, params: dict[str, Any]) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        messages = [{"role": "user", "content": problem.prompt}]
        if problem.system:
            messages.insert(0, {"role": "system", "content": problem.system})
        return {
            "rollout_id": rid,
            "base_url": f"{self.server_url}/rollouts/{rid}/v1",
            "model": self.model_name,
            "messages": messages,
            "answer": problem.answer,
            "sampling": params,
        }

    def run(self, tasks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The harness's result per rollout id (ids it did not report are absent), from
        `processes` harness processes (or endpoint requests), each given its share."""
        n = min(self.settings.processes, len(tasks)) or 1
        shares = [tasks[i::n] for i in range(n)]
        call = self._post if self.settings.endpoint else self._command
        with ThreadPoolExecutor(n, thread_name_prefix="harness") as pool:
            outputs = list(pool.map(call, shares))
        wanted = {t["rollout_id"] for t in tasks}
        results: dict[str, dict[str, Any]] = {}
        for out in outputs:
            for item in out:
                rid = item.get("rollout_id") if isinstance(item, dict) else None
                if rid in wanted and rid not in results:
                    results[rid] = item
                else:
                    self.stats["bad_results"] += 1
        return results

    def _command(self, tasks: list[dict[str, Any]]) -> list[Any]:
        s = self.settings
        assert s.command is not None
        env = {k: os.environ[k] for k in _ENV_KEPT if k in os.environ}
        env["OPENAI_API_KEY"] = self.api_key or "not-needed"  # clients insist on one
        if self.ca_file:
            env["SSL_CERT_FILE"] = self.ca_file
        env.update(s.env)
        stdin = "".join(json.dumps(t) + "\n" for t in tasks)
        return run_harness_command(s.command, stdin, env, s.timeout_s, s.memory_limit_mb,
                                   s.cpu_limit_s, s.max_output_bytes)  # fmt: skip

    def _post(self, tasks: list[dict[str, Any]]) -> list[Any]:
        s = self.settings
        assert s.endpoint is not None
        body = json.dumps({"tasks": tasks}).encode()
        req = urllib.request.Request(s.endpoint, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=s.timeout_s) as resp:  # noqa: S310
                raw = resp.read(s.max_output_bytes + 1)
        except OSError as err:
            log.warning("external harness %s: %s; its %d episodes fail", s.endpoint, err,
                        len(tasks))  # fmt: skip
            return []
        if len(raw) > s.max_output_bytes:
            log.warning("external harness %s answered more than %d bytes; its episodes fail",
                        s.endpoint, s.max_output_bytes)  # fmt: skip
            return []
        try:
            results = json.loads(raw).get("results")
        except (ValueError, AttributeError):
            results = None
        if not isinstance(results, list):
            log.warning('external harness %s: the answer is not {"results": [...]}; its '
                        "episodes fail", s.endpoint)  # fmt: skip
            return []
        return results

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        metrics = {f"rollouts/external_{k}": float(self.stats[k]) for k in COUNTERS}
        self.stats.clear()
        return batch, metrics

    def shutdown(self) -> None:
        pass


def run_harness_command(
    command: list[str],
    stdin: str,
    env: dict[str, str],
    timeout_s: float,
    memory_limit_mb: int,
    cpu_limit_s: int,
    max_output_bytes: int,
) -> list[Any]:
    """Run a harness once, confined (module docstring): its stdout's JSON lines (lines that
    are not JSON are skipped and logged). A harness that fails, overruns its deadline or
    writes too much gets its process group killed; what it reported before counts."""

    def limits() -> None:  # in the child, before exec
        mem = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit_s, cpu_limit_s))

    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
            env=env, start_new_session=True, preexec_fn=limits,  # noqa: PLW1509
        )  # fmt: skip
        out, killed = _communicate(proc, stdin, timeout_s, max_output_bytes)
        err_file.seek(0)
        tail = err_file.read()[-2000:].decode(errors="replace")
    if killed or proc.returncode:
        what = killed or f"exited with status {proc.returncode}"
        log.warning("external harness %s %s; stderr ends: %s", command, what, tail.strip())
    items = []
    for line in out.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except ValueError:
            log.warning("external harness %s wrote a line that is not JSON: %r", command,
                        line[:200])  # fmt: skip
    return items


def _communicate(
    proc: subprocess.Popen, stdin: str, timeout_s: float, max_bytes: int
) -> tuple[bytes, str | None]:
    """Feed stdin and read stdout up to `max_bytes` until the process ends or the deadline:
    (stdout, why it was killed or None)."""
    assert proc.stdin is not None and proc.stdout is not None

    def feed() -> None:
        try:
            proc.stdin.write(stdin.encode())  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:  # the harness stopped reading (exited): its results say what it did
            pass

    threading.Thread(target=feed, daemon=True, name="harness-stdin").start()
    chunks: list[bytes] = []
    size, killed = 0, None
    done = threading.Event()

    def read() -> None:
        nonlocal size
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                break
        done.set()

    threading.Thread(target=read, daemon=True, name="harness-stdout").start()
    finished = done.wait(timeout_s)
    if not finished:
        killed = f"ran past its {timeout_s:g} s deadline (grpo.external_harness.timeout_s)"
    elif size > max_bytes:
        killed = f"wrote more than {max_bytes} bytes (grpo.external_harness.max_output_bytes)"
    if killed:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=max(1.0, timeout_s if not killed else 5.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = killed or "did not exit after closing its output"
    try:  # whatever it left running in its session goes with it
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return (b"" if size > max_bytes else b"".join(chunks)), killed


def build_external_harness(
    cfg: GRPOMasterConfig, server: Any, chat: Any, pad_token_id: int
) -> ExternalHarness:
    """The run's `ExternalHarness` from ``grpo.external_harness``, recording on the server's
    chat service (`chat.capture`)."""
    ext = cfg.grpo.external_harness
    capture = RolloutCapture(max_calls=ext.max_calls_per_episode)
    chat.capture = capture
    settings = HarnessSettings(
        command=ext.command, endpoint=ext.endpoint, processes=ext.processes,
        timeout_s=ext.timeout_s, memory_limit_mb=ext.memory_limit_mb,
        cpu_limit_s=ext.cpu_limit_s, max_output_bytes=ext.max_output_bytes, env=dict(ext.env),
    )  # fmt: skip
    return ExternalHarness(settings, capture, server.url, chat.settings.model_name,
                           api_key=server.api_key, ca_file=server.ca_file,
                           pad_token_id=pad_token_id)  # fmt: skip
