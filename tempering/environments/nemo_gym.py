"""NeMo Gym as a GRPO environment: rows go to Gym's servers over HTTP, rollouts come back as
training data. Nothing from Gym is imported here (that lives in `nemo_gym_launcher.py`, in
Gym's own Python environment), and nothing in vLLM or Gym is patched: Gym's agents call the
trainer's OpenAI-compatible server (`tempering/models/generation/openai_server.py`), which
returns the token ids and sampler log-probs of every model call.

    client = NemoGymClient("http://127.0.0.1:11000")            # a running Gym head server
    env = NemoGymEnvironment(client, max_seq_len=512)
    batch = env.rollouts(rows, sampling=SamplingConfig(...), repeat=8)   # GRPO's batch layout

- **Attach mode** (`env.nemo_gym.head_server_url`): read ``GET /global_config_dict_yaml`` (a
  JSON string holding YAML), resolve each row's target by instance name —
  ``_ng_environment_server``, else the agent from ``agent_ref.name`` or from ``task_source``
  (the agent whose resources server it names), fronted by its environment server when one
  exists (Gym 0.7), else the agent itself, else ``default_route`` — and ``POST /run`` the
  row there. Bounded concurrency (one shared aiohttp session per process), a timeout per
  request, retries with exponential backoff on connection errors, timeouts and 5xx, then an
  error naming the URL. Results come back in row order.
- **Launch mode** (`env.nemo_gym.config_paths`): `NemoGymLauncher` starts Gym for the run in
  a Ray actor under Gym's own venv, pointed at our server; then the client attaches to it.
- **Results -> training data** (`episode_from_result`): walk ``response.output``, take each
  item carrying ``generation_token_ids`` (the last item of every model call), check that every
  call's ``prompt_token_ids`` extends everything seen so far (else an error, or with
  ``on_noncontiguous="truncate"`` the episode keeps its contiguous calls and is counted), mask
  1 on generated tokens, use ``generation_log_probs`` as the sampler's log-probs and
  ``reward`` as the reward; ``mask_sample: true`` gives sample_mask 0 (counted);
  ``reward_components`` are averaged into metrics; ``status: incomplete`` marks truncation.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import logging
import random
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tempering.data.episodes import EpisodeRecord, build_batch
from tempering.data.nemo_gym import ROUTING_FIELDS, load_gym_rows
from tempering.models.generation.interfaces import SamplingConfig

log = logging.getLogger(__name__)

LAUNCHER_FQN = "tempering.environments.nemo_gym_launcher.NemoGymLauncher"

__all__ = [
    "GymResultError",
    "GymServerError",
    "GymUnreachableError",
    "NemoGymClient",
    "NemoGymEnvironment",
    "episode_from_result",
    "gym_error_reason",
    "write_gym_examples",
]

_RUNNABLE = ("environment_servers", "responses_api_agents")


class GymServerError(RuntimeError):
    """A Gym server could not be reached or kept failing; names the URL and the fix."""


class GymUnreachableError(GymServerError):
    """A Gym server kept failing to answer (connections refused or reset, timeouts, 5xx)
    through every retry: dead, or unreachable; a request it refused (4xx) is not this."""


class GymResultError(ValueError):
    """A /run result cannot become training data (no token ids, non-contiguous calls)."""


# ----------------------------------------------------------------------------- client
@dataclass(eq=False)
class NemoGymClient:
    """POSTs rows to the right Gym server's ``/run`` (see the module docstring)."""

    head_server_url: str
    _: KW_ONLY
    default_route: str | None = None
    concurrency: int = 64
    request_timeout_s: float = 600.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    stats: Counter[str] = field(default_factory=Counter, init=False)
    _config: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _instances: dict[str, tuple[str, dict[str, Any]]] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.head_server_url = self.head_server_url.rstrip("/")

    # ---- the head server's view of the servers ---------------------------------------------
    def global_config(self) -> dict[str, Any]:
        from tempering.utils.aio import run_async

        if self._config is None:
            self._config = run_async(self._fetch_config())
        return self._config

    async def _fetch_config(self) -> dict[str, Any]:
        import yaml

        url = f"{self.head_server_url}/global_config_dict_yaml"
        body = await self._request("GET", url, None)
        text = json.loads(body) if body.lstrip().startswith('"') else body
        config = yaml.safe_load(text)
        if not isinstance(config, dict):
            raise GymServerError(f"{url} did not return Gym's global config (got {text[:80]!r})")
        return config

    def wait_ready(self, timeout_s: float) -> None:
        """Poll the head server's ``/readyz`` (200 once every Gym server is up) for up to
        `timeout_s`; a Gym without that route counts as ready once its config loads."""
        import time
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.head_server_url}/readyz", timeout=5):
                    return
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    self.global_config()
                    return
                last = f"HTTP {err.code}"
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            time.sleep(1.0)
        raise GymServerError(
            f"NeMo Gym at {self.head_server_url} was not ready within {timeout_s:.0f} s "
            f"(last: {last}); start it, or check env.nemo_gym.head_server_url"
        )

    def instances(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """Instance name -> (server type, its config) for every Gym server."""
        if self._instances is not None:
            return self._instances
        out = {}
        for name, value in self.global_config().items():
            if not isinstance(value, dict) or len(value) != 1:
                continue
            (server_type, impls), = value.items()  # fmt: skip
            if isinstance(impls, dict) and len(impls) == 1:
                (conf,) = impls.values()
                if isinstance(conf, dict) and "port" in conf:
                    out[name] = (server_type, conf)
        self._instances = out
        return out

    def route(self, row: dict[str, Any]) -> tuple[str, str]:
        """(agent or environment-server name for metrics, /run URL) for `row`."""
        servers = self.instances()
        name = row.get("_ng_environment_server")
        agent = None
        if not name and row.get("task_source"):
            matches = [
                n for n, (t, c) in servers.items()
                if t == "responses_api_agents"
                and (c.get("resources_server") or {}).get("name") == row["task_source"]
            ]  # fmt: skip
            if len(matches) != 1:
                raise GymResultError(
                    f"task_source={row['task_source']!r} matches {len(matches)} agents "
                    f"({matches}); name the agent with agent_ref or _ng_environment_server"
                )
            agent = matches[0]
        if not name and not agent:
            ref = row.get("agent_ref") or {}
            agent = ref.get("name") if isinstance(ref, dict) else None
        if not name and not agent:
            name = self.default_route
        if not name and not agent:
            raise GymResultError(
                f"row has none of {ROUTING_FIELDS} and env.nemo_gym.default_route is unset"
            )
        if agent:
            fronts = [
                n for n, (t, c) in servers.items()
                if t == "environment_servers" and (c.get("agent_server") or {}).get("name") == agent
            ]  # fmt: skip
            name = fronts[0] if len(fronts) == 1 else agent
        if name not in servers or servers[name][0] not in _RUNNABLE:
            known = sorted(n for n, (t, _) in servers.items() if t in _RUNNABLE)
            raise GymResultError(f"Gym has no agent or environment server {name!r}; known: {known}")
        conf = servers[name][1]
        agent = agent or (conf.get("agent_server") or {}).get("name") or name  # metrics: by agent
        return agent, f"http://{conf.get('host', '127.0.0.1')}:{conf['port']}/run"

    # ---- /run ------------------------------------------------------------------------------
    def run(self, rows: Sequence[dict[str, Any]], group_size: int = 1) -> list[dict[str, Any]]:
        """``POST /run`` for every row (bounded concurrency); results in row order.
        (`group_size`: the rows of one prompt group, which only `ShardedGymClient` reads.)"""
        from tempering.utils.aio import run_async

        return run_async(self.post_rows(rows, [self.route(r)[1] for r in rows]))

    async def post_rows(self, rows: Sequence[dict[str, Any]], urls: list[str]) -> list[Any]:
        """``POST`` each row to its URL (`route`'s, resolved before: `route` may fetch Gym's
        config, which cannot wait on the loop this runs on); results in row order."""
        gate = asyncio.Semaphore(self.concurrency)

        async def one(row: dict[str, Any], url: str) -> dict[str, Any]:
            async with gate:
                return json.loads(await self._request("POST", url, row))

        return list(await asyncio.gather(*(one(r, u) for r, u in zip(rows, urls, strict=True))))

    def take_metrics(self) -> dict[str, float]:
        """Per-instance counters since the last call (one Gym has none beyond `stats`)."""
        return {}

    async def _request(self, method: str, url: str, body: Any) -> str:
        import aiohttp

        from tempering.utils.aio import http_session

        session = await http_session()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(
                    self.retry_backoff_s * 2 ** (attempt - 1) * (1 + random.random())
                )
            try:
                async with session.request(method, url, json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        return text
                    last = f"HTTP {resp.status}: {gym_error_reason(text)[:400]}"
                    if resp.status < 500:  # the request itself is wrong: retrying will not help
                        raise GymServerError(f"{method} {url} answered {last}")
            except (TimeoutError, aiohttp.ClientConnectionError) as err:
                last = f"{type(err).__name__}: {err}"
        raise GymUnreachableError(
            f"{method} {url} failed {self.max_retries + 1} times (last: {last}); check that the "
            f"NeMo Gym servers are up (head server {self.head_server_url}) and reachable"
        )


# One hop of a Gym error: a Gym server whose inner request failed answers 500 with this
# sentence (a JSON string) around the inner body as Python prints bytes (nemo_gym.server_utils).
_GYM_HOP = re.compile(r"Hit an exception in (\S+) calling an inner server: (b(['\"]).*\3)\Z", re.S)


def gym_error_reason(text: str) -> str:
    """The reason inside a Gym error body, with the Gym servers it came through.

    Each Gym server an error passes through wraps the body it got into a sentence of its own
    and escapes it again, so three hops bury the reason (say our generation server's 400
    "the prompt has 4271 tokens ...") under hundreds of backslashes. Unwrapped hop by hop:
    ``"the prompt has ... (through SimpleAgent___x -> VLLMModel___policy_model)"``; an
    OpenAI-shaped ``{"error": {"message": ...}}`` gives its message; a body of any other shape
    comes back as it came."""
    hops, body = [], text
    while True:
        try:
            value = json.loads(body)
        except ValueError:
            break
        if isinstance(value, dict) and isinstance(value.get("error"), dict):
            body = str(value["error"].get("message", body))
            break
        match = _GYM_HOP.match(value) if isinstance(value, str) else None
        if match is None:
            body = value if isinstance(value, str) else body
            break
        hops.append(match.group(1))
        try:
            body = ast.literal_eval(match.group(2)).decode("utf-8", "replace")
        except (ValueError, SyntaxError):
            body = match.group(2)
            break
    return body + (f" (through {' -> '.join(hops)})" if hops else "")


# ------------------------------------------------------------------ results -> episodes
def _messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A readable message log of a Responses-API output (for logs only)."""
    msgs: list[dict[str, Any]] = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            parts = item.get("content") or []
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            msgs.append({"role": item.get("role", "assistant"), "content": text})
        elif kind == "function_call":
            call = {"name": item.get("name"), "arguments": item.get("arguments")}
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "content": str(item.get("output", ""))})
    return msgs


def _reward(value: Any, where: str) -> float:
    """A /run result's reward: a finite number (missing or null is 0); anything else names the
    row, since it would poison every advantage of its group."""
    import math

    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GymResultError(
            f"{where}: the /run result's reward is {str(value)[:80]!r}, not a finite number; "
            "check the Gym resource server's verify()"
        )
    return float(value)


def episode_from_result(
    result: dict[str, Any],
    *,
    where: str,
    max_seq_len: int,
    on_noncontiguous: Literal["error", "truncate"] = "error",
    stats: Counter[str] | None = None,
) -> EpisodeRecord:
    """One /run result -> an EpisodeRecord (see the module docstring). `where` names the row."""
    stats = stats if stats is not None else Counter()
    response = result.get("response") or {}
    output = response.get("output") or [] if isinstance(response, dict) else None
    if not isinstance(output, list):
        raise GymResultError(
            f"{where}: the /run result's response is not an object with an output list (got "
            f"{type(response).__name__})"
        )
    bad = [k for k, item in enumerate(output) if not isinstance(item, dict)]
    if bad:
        raise GymResultError(
            f"{where}: the /run result's output item {bad[0] + 1} is a "
            f"{type(output[bad[0]]).__name__}, not an object (an OpenAI Responses output item)"
        )
    reward = _reward(result.get("reward"), where)
    masked = bool(result.get("mask_sample"))
    seen: list[int] = []
    spans: list[tuple[int, list[int], list[float]]] = []
    cut = False
    calls = [item for item in output if item.get("generation_token_ids") is not None]
    for k, item in enumerate(calls):
        prompt, gen = list(item.get("prompt_token_ids") or []), list(item["generation_token_ids"])
        logprobs = list(item.get("generation_log_probs") or [])
        if len(logprobs) != len(gen):
            raise GymResultError(
                f"{where}: model call {k + 1} has {len(gen)} generation_token_ids but "
                f"{len(logprobs)} generation_log_probs"
            )
        if prompt[: len(seen)] != seen:
            if on_noncontiguous == "error":
                raise GymResultError(
                    f"{where}: model call {k + 1}'s prompt_token_ids do not extend the previous "
                    "call's prompt + generation (the agent rewrote the history); training on it "
                    "would be off-policy. Set env.nemo_gym.on_noncontiguous=truncate to keep "
                    "the contiguous calls"
                )
            stats["noncontiguous_truncated"] += 1
            cut = True
            break
        if len(prompt) + len(gen) > max_seq_len:  # over the trainer's budget: stop here
            stats["over_length_truncated"] += 1
            cut = True
            break
        spans.append((len(prompt), gen, logprobs))
        seen = prompt + gen
    if not spans and not masked:
        raise GymResultError(
            f"{where}: the /run result has no model call with generation_token_ids within the "
            "budget; Gym's model server must call tempering's generation server in training "
            "mode (responses_api_models/vllm_model with return_token_id_information: true)"
        )
    if masked:
        stats["masked_samples"] += 1
    incomplete = response.get("status") == "incomplete" or bool(response.get("incomplete_details"))
    return EpisodeRecord(
        ids=seen or [0],
        spans=spans,
        reward=reward,
        turns=len(spans),
        truncated=cut or incomplete,
        finish_reason="length" if cut or incomplete else "stop",
        messages=_messages(output),
        masked=masked,
    )


# ------------------------------------------------------------------------ environment
@dataclass(eq=False)
class NemoGymEnvironment:
    """GRPO's environment for NeMo Gym: rows -> ``/run`` -> the training batch.

    Unlike step-wise environments (`EnvironmentInterface`), Gym runs whole episodes itself,
    so this one takes rows and returns finished rollouts; per-environment metrics
    (``env/<agent>/reward_mean``, ...) come from `global_post_process_and_metrics`."""

    client: NemoGymClient
    _: KW_ONLY
    max_seq_len: int
    on_noncontiguous: Literal["error", "truncate"] = "error"
    pad_token_id: int = 0
    launcher: Any = None
    stats: Counter[str] = field(default_factory=Counter, init=False)
    _rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list), init=False)
    _components: dict[tuple[str, str], list[float]] = field(
        default_factory=lambda: defaultdict(list), init=False
    )

    def rollouts(
        self,
        rows: Sequence[dict[str, Any]],
        *,
        sampling: SamplingConfig,
        greedy: bool = False,
        repeat: int = 1,
    ) -> Any:
        """`repeat` episodes per row, with the trainer's sampling written into each row."""
        prepared = [self._with_sampling(r, sampling, greedy) for r in rows for _ in range(repeat)]
        results = self.client.run(prepared, group_size=repeat)
        names = [self.client.route(r)[0] for r in prepared]
        episodes = []
        for i, (result, name) in enumerate(zip(results, names, strict=True)):
            ep = episode_from_result(
                result,
                where=f"row {i // repeat} (sample {i})",
                max_seq_len=self.max_seq_len,
                on_noncontiguous=self.on_noncontiguous,
                stats=self.stats,
            )
            episodes.append(ep)
            if not ep.masked:
                self._rewards[name].append(ep.reward)
            for key, value in (result.get("reward_components") or {}).items():
                self._components[(name, key)].append(float(value))
        return build_batch(episodes, self.pad_token_id)

    @staticmethod
    def _with_sampling(
        row: dict[str, Any], sampling: SamplingConfig, greedy: bool
    ) -> dict[str, Any]:
        out = copy.deepcopy(row)
        params = out["responses_create_params"]
        params["temperature"] = 0.0 if greedy else sampling.temperature
        params["top_p"] = sampling.top_p
        own = params.get("max_output_tokens")
        params["max_output_tokens"] = min(own or sampling.max_new_tokens, sampling.max_new_tokens)
        return out

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        metrics: dict[str, float] = {}
        for name, rewards in self._rewards.items():
            metrics[f"env/{name}/reward_mean"] = sum(rewards) / len(rewards)
            metrics[f"env/{name}/samples"] = float(len(rewards))
        for (name, key), values in self._components.items():
            metrics[f"env/{name}/{key}_mean"] = sum(values) / len(values)
        stats = self.stats + self.client.stats
        for key in (
            "masked_samples",
            "noncontiguous_truncated",
            "over_length_truncated",
            "retries",
        ):
            metrics[f"gym/{key}"] = float(stats[key])
        metrics.update(self.client.take_metrics())
        self._rewards.clear()
        self._components.clear()
        self.stats.clear()
        self.client.stats.clear()
        return batch, metrics

    def shutdown(self) -> None:
        if self.launcher is not None:
            self.launcher.shutdown()
            self.launcher = None


def write_gym_examples(out: str | Path, environments: list[str]) -> int:
    """Write the example rows NeMo Gym ships for `environments` (resources-server names) to
    `out`, each routed to ``<environment>_simple_agent``; returns the row count. Uses Gym's
    venv (PY_EXECUTABLES.NEMO_GYM), building it on first use."""
    import subprocess

    from tempering.distributed.actor_environments import get_actor_executable, resolve_python
    from tempering.utils.atomic import atomic_write_text

    python = resolve_python(LAUNCHER_FQN, get_actor_executable(LAUNCHER_FQN))
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    lines = []
    for env in environments:
        path = site / "resources_servers" / env / "data" / "example.jsonl"
        if not path.is_file():
            known = sorted(
                p.parent.parent.name for p in site.glob("resources_servers/*/data/example.jsonl")
            )
            raise FileNotFoundError(f"NeMo Gym has no example rows for {env!r}; known: {known}")
        for row in load_gym_rows(path, default_route=f"{env}_simple_agent"):
            if not any(row.get(k) for k in ROUTING_FIELDS):
                row["agent_ref"] = {"name": f"{env}_simple_agent"}
            lines.append(json.dumps(row))
    atomic_write_text(Path(out), "\n".join(lines) + "\n")
    return len(lines)
