"""A protocol-level stand-in for NeMo Gym, for fast tests and benchmarks (never a substitute:
the slow tier and `examples/run_grpo_nemo_gym.py` run the real `nemo-gym` package).

It speaks Gym 0.7's wire protocol as measured against the real package (docs/nemo_gym.md):

- a **head server**: ``GET /global_config_dict_yaml`` -> a JSON string holding the YAML of
  every server instance (``<name>: {<server type>: {<impl>: {host, port, ...}}}``);
- a **resources server** (``standin_resources``, like ``equivalence_rule`` with ``grading_rule:
  exact``): ``/seed_session``, a ``/calculator`` tool route and ``/verify`` (reward 1 when the
  assistant's text, stripped, equals ``expected_answer``; ``reward_components``; a row with
  ``"standin": {"mask_sample": true}`` comes back with ``mask_sample``);
- an **agent** (``standin_agent``, like ``simple_agent`` + ``vllm_model``): ``POST /run``
  seeds the session, then calls the policy's ``/chat/completions`` the way Gym's vllm_model
  does (``logprobs: true``, ``top_logprobs: 0``, ``return_tokens_as_token_ids: true``, the
  three token-id fields re-attached to earlier assistant messages), runs tool calls against
  the resources server, stops on a turn without tool calls or on ``finish_reason: length``,
  and returns the ``/verify`` result with the Responses-API ``response`` (token ids on the last
  output item of each model call);
- an **environment server** (``standin_environment_server``, like ``legacy_agent``) that
  relays ``/run`` to the agent.

Faults for tests: ``fail_runs`` (the next N ``/run`` calls answer 500) and ``jitter_s`` (a
random delay per ``/run``, so results complete out of order).

    with GymStandIn(server.base_url, "policy") as gym:
        client = NemoGymClient(gym.head_url, default_route=gym.ENVIRONMENT_SERVER)

`StandInProcess` runs it in a child process instead (``python -m
tempering.environments.nemo_gym_standin``), as Gym's servers run beside a trainer: for learning
runs whose every rollout goes through it. In the trainer's process its four servers took three
quarters of that process's one interpreter lock, and a step through it twice as long.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tempering.environments.calculator import evaluate_expression
from tempering.utils.serving import BackgroundServer

__all__ = ["GymStandIn", "StandInProcess", "chat_messages_and_tools"]


def chat_messages_and_tools(params: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """A row's ``responses_create_params`` as the chat request Gym's vllm_model sends the
    policy: its input as messages (a string input: one user message) and its Responses-API
    tools in chat's ``{"type": "function", "function": {...}}`` shape."""
    value = params["input"]
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else [
        {"role": m["role"], "content": m.get("content")} for m in value
    ]  # fmt: skip
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k not in ("type", "strict")}}
        for t in params.get("tools") or []
    ]  # fmt: skip
    return messages, tools


class GymStandIn:
    RESOURCES = "standin_resources"
    AGENT = "standin_agent"
    ENVIRONMENT_SERVER = "standin_environment_server"

    def __init__(
        self,
        policy_base_url: str,
        policy_model_name: str,
        policy_api_key: str | None = None,
        max_steps: int = 4,
    ) -> None:
        self.policy_base_url = policy_base_url.rstrip("/")
        self.model = policy_model_name
        self.api_key = policy_api_key
        self.max_steps = max_steps
        self.fail_runs = 0
        self.jitter_s = 0.0
        self.chat_requests: list[dict[str, Any]] = []  # every request sent to the policy
        self._servers = {
            self.RESOURCES: BackgroundServer(self._resources_app(), name="standin-resources"),
            self.AGENT: BackgroundServer(self._agent_app(), name="standin-agent"),
            self.ENVIRONMENT_SERVER: BackgroundServer(self._relay_app(), name="standin-env"),
            "head": BackgroundServer(self._head_app(), name="standin-head"),
        }

    @property
    def head_url(self) -> str:
        return self._servers["head"].url

    def url(self, name: str) -> str:
        return self._servers[name].url

    def start(self) -> GymStandIn:
        for server in self._servers.values():
            server.start()
        return self

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()

    def __enter__(self) -> GymStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- head ----------------------------------------------------------------------------
    def global_config(self) -> dict[str, Any]:
        def where(name: str) -> dict[str, Any]:
            return {"host": "127.0.0.1", "port": self._servers[name].port}

        return {
            "policy_base_url": self.policy_base_url,
            self.RESOURCES: {"resources_servers": {"equivalence_rule": where(self.RESOURCES)}},
            self.AGENT: {
                "responses_api_agents": {
                    "simple_agent": {
                        **where(self.AGENT),
                        "resources_server": {"type": "resources_servers", "name": self.RESOURCES},
                        "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    }
                }
            },
            self.ENVIRONMENT_SERVER: {
                "environment_servers": {
                    "legacy_agent": {
                        **where(self.ENVIRONMENT_SERVER),
                        "agent_server": {"type": "responses_api_agents", "name": self.AGENT},
                    }
                }
            },
        }

    def _head_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/readyz")
        async def ready() -> Any:
            return {"status": "ok"}

        @app.get("/global_config_dict_yaml")
        async def config() -> Any:
            return JSONResponse(yaml.safe_dump(self.global_config()))

        @app.get("/standin/stats")  # the stand-in's own, for StandInProcess (not Gym's)
        async def stats() -> Any:
            return {"chat_requests": len(self.chat_requests)}

        return app

    # ---- resources -----------------------------------------------------------------------
    def _resources_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/seed_session")
        async def seed(request: Request) -> Any:
            response = JSONResponse({})
            response.set_cookie("session", uuid.uuid4().hex)
            return response

        @app.post("/calculator")
        async def calculator(request: Request) -> Any:
            body = await request.json()
            try:
                return {"value": str(evaluate_expression(str(body.get("expression", ""))))}
            except ValueError as err:
                return {"error": str(err)}

        @app.post("/verify")
        async def verify(request: Request) -> Any:
            body = await request.json()
            text = "".join(
                part.get("text", "")
                for item in body["response"]["output"]
                if item.get("type") == "message"
                for part in item.get("content") or []
            )
            reward = float(text.strip() == str(body.get("expected_answer", "")).strip())
            standin = body.pop("standin", None) or {}
            return {
                **body,
                "reward": reward,
                "reward_components": {"exact": reward, "answered": float(bool(text.strip()))},
                "mask_sample": bool(standin.get("mask_sample")),
            }

        return app

    # ---- agent ---------------------------------------------------------------------------
    @staticmethod
    def _app_with_client() -> tuple[FastAPI, Callable[[], aiohttp.ClientSession]]:
        """An app and its one HTTP client, opened and closed with the app's server (kept-alive
        connections, as Gym's servers keep theirs; a client per request opened a new TCP
        connection for each of a rollout's calls, which dominated a step through the stand-in)."""
        clients: list[aiohttp.ClientSession] = []

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with aiohttp.ClientSession() as http:
                clients.append(http)
                yield

        return FastAPI(lifespan=lifespan), lambda: clients[0]

    def _agent_app(self) -> FastAPI:
        app, client = self._app_with_client()

        @app.post("/run")
        async def run(request: Request) -> Any:
            if self.fail_runs > 0:
                self.fail_runs -= 1
                return JSONResponse({"detail": "injected failure"}, status_code=500)
            if self.jitter_s:
                await asyncio.sleep(random.random() * self.jitter_s)
            return await self._run(await request.json(), client())

        return app

    async def _run(self, row: dict[str, Any], http: aiohttp.ClientSession) -> dict[str, Any]:
        params = row["responses_create_params"]
        messages, tools = chat_messages_and_tools(params)
        resources = self._servers[self.RESOURCES].url
        headers = {"Authorization": f"Bearer {self.api_key or 'none'}"}
        output: list[dict[str, Any]] = []
        status = "completed"
        async with http.post(f"{resources}/seed_session", json=row) as seeded:
            seeded.raise_for_status()
        for _ in range(self.max_steps):
            body: dict[str, Any] = {
                "model": self.model,
                "messages": messages,
                "logprobs": True,
                "top_logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                                 ("max_output_tokens", "max_tokens")):  # fmt: skip
                if params.get(ours) is not None:
                    body[theirs] = params[ours]
            if tools:
                body["tools"] = tools
            self.chat_requests.append(json.loads(json.dumps(body)))  # a snapshot
            url = f"{self.policy_base_url}/chat/completions"
            async with http.post(url, json=body, headers=headers) as resp:
                reply = await resp.json()
            if resp.status == 400 and "context_length" in str(reply):
                status = "incomplete"  # Gym: an over-long prompt ends the episode
                break
            if resp.status != 200:
                raise RuntimeError(f"policy server answered {resp.status}: {reply}")
            choice = reply["choices"][0]
            msg = choice["message"]
            tokens = {k: msg[k] for k in ("prompt_token_ids", "generation_token_ids",
                                          "generation_log_probs")}  # fmt: skip
            calls = msg.get("tool_calls") or []
            messages.append({"role": "assistant", "content": msg.get("content"),
                             **({"tool_calls": calls} if calls else {}), **tokens})  # fmt: skip
            if calls:
                for i, call in enumerate(calls):
                    fn = call["function"]
                    item = {"type": "function_call", "id": call["id"], "call_id": call["id"],
                            "name": fn["name"], "arguments": fn["arguments"]}  # fmt: skip
                    output.append({**item, **tokens} if i == len(calls) - 1 else item)
                for call in calls:
                    fn = call["function"]
                    async with http.post(
                        f"{resources}/{fn['name']}", json=json.loads(fn["arguments"])
                    ) as tool_resp:
                        result = await tool_resp.text()
                    output.append({"type": "function_call_output", "call_id": call["id"],
                                   "output": result})  # fmt: skip
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": result})  # fmt: skip
            else:
                text = msg.get("content") or ""
                output.append({"type": "message", "role": "assistant", "status": "completed",
                               "content": [{"type": "output_text", "text": text}], **tokens})  # fmt: skip
            if choice["finish_reason"] == "length":
                status = "incomplete"
                break
            if not calls:
                break
        response = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "status": status,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "output": output}  # fmt: skip
        async with http.post(f"{resources}/verify", json={**row, "response": response}) as r:
            return await r.json()

    # ---- environment server --------------------------------------------------------------
    def _relay_app(self) -> FastAPI:
        app, client = self._app_with_client()

        @app.post("/run")
        async def run(request: Request) -> Any:
            body = await request.body()
            async with client().post(
                f"{self._servers[self.AGENT].url}/run", data=body,
                headers={"Content-Type": "application/json"},
            ) as resp:  # fmt: skip
                return JSONResponse(await resp.json(), status_code=resp.status)

        return app


class StandInProcess:
    """`GymStandIn` in a child process: ``head_url`` and ``ENVIRONMENT_SERVER`` as on the
    stand-in, `chat_request_count` for what it has sent the policy. Stopped on exit (the child
    also stops when its stdin closes, so it never outlives this process)."""

    ENVIRONMENT_SERVER = GymStandIn.ENVIRONMENT_SERVER

    def __init__(self, policy_base_url: str, policy_model_name: str) -> None:
        self.policy_base_url, self.model = policy_base_url, policy_model_name
        self.head_url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> StandInProcess:
        cmd = [sys.executable, "-m", __name__, "--policy-base-url", self.policy_base_url,
               "--model", self.model]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait(timeout=30)
            raise RuntimeError(f"the Gym stand-in process exited ({code}) before serving: {cmd}")
        self.head_url = json.loads(line)["head_url"]
        return self

    def chat_request_count(self) -> int:
        with urllib.request.urlopen(f"{self.head_url}/standin/stats", timeout=30) as resp:
            return int(json.loads(resp.read())["chat_requests"])

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv: list[str] | None = None) -> None:
    """Serve the stand-in until stdin closes; the head server's URL first, as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy-base-url", required=True)
    parser.add_argument("--model", default="policy")
    args = parser.parse_args(argv)
    with GymStandIn(args.policy_base_url, args.model) as gym:
        print(json.dumps({"head_url": gym.head_url}), flush=True)
        sys.stdout = sys.stderr  # nobody reads the pipe after that line: never let it fill
        sys.stdin.read()


if __name__ == "__main__":
    main()
