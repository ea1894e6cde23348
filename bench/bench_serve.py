"""Serving under load: `tempering serve` against vLLM's own OpenAI server, same model, same prompts.

Starts both servers once as child processes on this machine (``tempering serve MODEL``
in this venv, torch backend; ``vllm serve`` from the vLLM extra's worker venv, which
``tempering envs --build`` makes), then for every run and every concurrency level (1, 4, 16, 64
by default) measures each server in turn, interleaved: N clients each send streaming chat
requests back to back for ``--duration`` seconds (a closed loop; requests in flight when time
is up finish and count), then the next server gets the same load. Per level and server:

- requests/s and output tokens/s (``usage.completion_tokens`` from ``stream_options.
  include_usage``, over the wall time from the first request to the last answer),
- time to first token (request sent to the first content chunk) and inter-token latency
  (between a stream's content chunks), p50 and p99,
- errors: a non-200, a stream without ``[DONE]``, or a transport failure.

Medians over ``--runs`` runs with their range; the ratio is tempering / vLLM for tokens/s
(above 1: tempering is faster). Rows go to ``bench/results/serve.json`` (output tokens/s per
level, rendered on the docs' Benchmarks page) and every figure of every run to
``bench/results/serve/<workload>.json``. The prompts: short chat questions
(``--max-tokens`` 64 new tokens, temperature 0, so both servers decode the same kind of text);
the client runs on the same cores as the server it measures, at the same cost for both.
Both servers use fp32 weights and two threads; vLLM runs with ``--enforce-eager`` and its V1
engine core in the server process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what the training
worker does), ``VLLM_CPU_KVCACHE_SPACE=1`` GiB.

    uv run --frozen python bench/bench_serve.py                       # SmolLM2-135M, both servers
    uv run --frozen python bench/bench_serve.py --servers tempering --model tiny-arith \
        --clients 1,4 --duration 5 --runs 1                             # a quick look, ours only

A benchmark prints ratios; it never passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from result_files import RESULTS, commit, machine, record  # noqa: E402

VLLM_FQN = "tempering.models.generation.vllm_worker.VllmGenerationWorker"
QUESTIONS = [
    "What is 23 + 45? Explain step by step.",
    "Name three uses of a paperclip and say why each works.",
    "Write a short poem about the sea.",
    "Why is the sky blue? Answer in two sentences.",
    "List the planets of the solar system in order.",
    "How do I boil an egg?",
    "What is the capital of France, and what is it known for?",
    "Give me a tip for learning to program.",
]


# ------------------------------------------------------------------------------ servers
def start_server(kind: str, model_dir: str, port: int, max_len: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    if kind == "tempering":
        cmd = [sys.executable, "-m", "tempering.cli", "serve", model_dir, "--port", str(port),
               "--served-model-name", "bench", "--max-model-len", str(max_len)]  # fmt: skip
    else:
        from tempering.distributed.actor_environments import get_actor_executable, resolve_python

        env.pop("VIRTUAL_ENV", None)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        python = resolve_python(VLLM_FQN, get_actor_executable(VLLM_FQN))  # builds it once
        # `vllm serve` is this module; the CLI wrapper looks up the distribution "vllm", and
        # the CPU build is installed as "vllm-cpu"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "bench", "--dtype", "float32", "--max-model-len",
               str(max_len), "--enforce-eager", "--no-enable-log-requests"]  # fmt: skip
    log = open(f"/tmp/bench_serve_{kind}.log", "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")


def wait_ready(proc: subprocess.Popen, port: int, kind: str, timeout_s: float = 600) -> float:
    start = time.time()
    while time.time() - start < timeout_s:
        if proc.poll() is not None:
            sys.exit(f"{kind} server exited ({proc.returncode}); see /tmp/bench_serve_{kind}.log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return time.time() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"{kind} server not ready after {timeout_s} s; see /tmp/bench_serve_{kind}.log")


# ------------------------------------------------------------------------------- load
async def one_request(client: httpx.AsyncClient, url: str, question: str, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    arrivals, tokens, done = [], 0, False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        arrivals.append(time.perf_counter())
    except httpx.HTTPError as err:
        return {"error": type(err).__name__}
    if not done or not arrivals:
        return {"error": "no [DONE]" if not done else "no content"}
    return {"tokens": tokens, "ttft": arrivals[0] - sent,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]}  # fmt: skip


async def load(port: int, clients: int, duration: float, max_tokens: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def worker(i: int) -> None:
            k = i
            while time.perf_counter() - start < duration:
                results.append(await one_request(client, url, QUESTIONS[k % len(QUESTIONS)],
                                                 max_tokens))  # fmt: skip
                k += clients

        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    itl = sorted(x for r in ok for x in r["itl"])
    ttft = sorted(r["ttft"] for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_kinds": sorted({r["error"] for r in results if "error" in r}),
        "wall_s": wall, "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
    }  # fmt: skip


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


# ------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--servers", default="tempering,vllm")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per level")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args()
    from tempering.models.registry import resolve_model_path

    model_dir = str(resolve_model_path(args.model))
    servers = args.servers.split(",")
    levels = [int(c) for c in args.clients.split(",")]
    ports = {kind: 8300 + i for i, kind in enumerate(servers)}
    procs = {
        kind: start_server(kind, model_dir, ports[kind], args.max_model_len) for kind in servers
    }
    try:
        for kind in servers:
            print(f"{kind} server ready in {wait_ready(procs[kind], ports[kind], kind):.0f} s",
                  flush=True)  # fmt: skip
        for kind in servers:  # one untimed request each: first-call compilation, caches
            asyncio.run(load(ports[kind], 1, 0.0, 8))
        runs: dict[str, dict[int, list[dict]]] = {k: {c: [] for c in levels} for k in servers}
        for run in range(args.runs):
            for c in levels:
                order = servers if run % 2 == 0 else servers[::-1]
                for kind in order:
                    r = asyncio.run(load(ports[kind], c, args.duration, args.max_tokens))
                    runs[kind][c].append(r)
                    print(f"run {run + 1} {kind:9s} {c:3d} clients: {r['output_tokens_per_s']:7.1f}"
                          f" tok/s {r['requests_per_s']:5.2f} req/s ttft p50 {r['ttft_p50_s']:.3f}"
                          f" p99 {r['ttft_p99_s']:.3f} itl p50 {r['itl_p50_s'] * 1e3:.1f} ms"
                          f" p99 {r['itl_p99_s'] * 1e3:.1f} ms errors {r['errors']}/{r['requests']}",
                          flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
    report(args, servers, levels, runs)


def report(args: argparse.Namespace, servers: list[str], levels: list[int], runs: dict) -> None:
    keys = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
            "itl_p99_s")  # fmt: skip
    summary: dict = {}
    print(f"\n{args.model}, {args.max_tokens} new tokens, {args.duration:.0f} s per level, "
          f"{args.runs} runs: median (min-max)")  # fmt: skip
    for c in levels:
        for kind in servers:
            rs = runs[kind][c]
            row = {k: {"median": statistics.median(r[k] for r in rs),
                       "min": min(r[k] for r in rs), "max": max(r[k] for r in rs)} for k in keys}  # fmt: skip
            row["errors"] = sum(r["errors"] for r in rs)
            row["requests"] = sum(r["requests"] for r in rs)
            summary.setdefault(str(c), {})[kind] = row
            tok = row["output_tokens_per_s"]
            print(f"  {c:3d} clients {kind:9s}: {tok['median']:7.1f} ({tok['min']:.1f}-"
                  f"{tok['max']:.1f}) tok/s, {row['requests_per_s']['median']:.2f} req/s, "
                  f"ttft p50/p99 {row['ttft_p50_s']['median']:.3f}/{row['ttft_p99_s']['median']:.3f}"
                  f" s, itl p50/p99 {row['itl_p50_s']['median'] * 1e3:.1f}/"
                  f"{row['itl_p99_s']['median'] * 1e3:.1f} ms, errors {row['errors']}/"
                  f"{row['requests']}")  # fmt: skip
        if set(servers) == {"tempering", "vllm"}:
            ours = [r["output_tokens_per_s"] for r in runs["tempering"][c]]
            peer = [r["output_tokens_per_s"] for r in runs["vllm"][c]]
            ratios = [o / p for o, p in zip(ours, peer, strict=True)]
            print(f"      tempering / vLLM output tokens/s: {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
            if not args.no_record:
                record("serve", "tempering serve against vllm serve (streaming chat, CPU)",
                       f"{_workload(args.model)}, {c} clients", "output tokens/s", ours, peer,
                       "vllm serve (vllm-cpu 0.32)", higher_is_better=True)  # fmt: skip
    if not args.no_record:
        out = RESULTS / "serve" / f"{_workload(args.model)}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                   "duration_s": args.duration, "machine": machine(),
                                   "commit": commit(), "date": time.strftime("%Y-%m-%d"),
                                   "summary": summary, "runs": runs}, indent=1))  # fmt: skip
        print(f"wrote {out}")


def _workload(model: str) -> str:
    return {"smollm2-135m-instruct": "smollm2", "tiny-arith": "tiny"}.get(model, Path(model).name)


if __name__ == "__main__":
    main()
