"""Rollouts/s through the HTTP server and through NeMo Gym vs in-process, and single-turn GRPO
step time against the code before the rollout loop existed.

    uv run bench/bench_rollouts.py [--repeats 5] [--steps 16] [--baseline-ref 30a85ff]
                                   [--smollm2] [--gym real|standin|none]

1. **HTTP vs in-process** (same run, same policy workers, alternating): `grpo.rollouts` on
   32 prompts x 8 episodes, sampled, for two workloads — single-turn tiny-arith
   (grpo_math_tiny.yaml) and the 3-turn retry task (grpo_multiturn_tiny.yaml). In-process,
   each turn is one `ChatCompletionService.complete_many` call; over HTTP, every episode's
   turn is its own POST /v1/chat/completions (aiohttp, all at once) that the server batches.
   Printed: median rollouts/s of each with the spread (min-max), and HTTP / in-process.
   `--smollm2` adds grpo_math_smollm2.yaml's workload (SmolLM2-135M, 4 prompts x 4, up to
   128 new tokens, chat template), where generation, not the ~1 ms per request of HTTP,
   dominates.
2. **NeMo Gym vs in-process** (`--gym real`, the default: the real nemo-gym 0.7.0 launched in
   its venv, equivalence_rule + simple_agent + vllm_model; `--gym standin`: our
   protocol-level stand-in): the same 32 tiny-arith prompts x 8, each rollout a `/run` through
   Gym's servers that calls our generation server, vs the in-process rollout loop, in one run.
3. **Single-turn GRPO step time before vs after** (grpo_math_tiny.yaml's workload, 32x8,
   median of 2 x `--steps` steps, each run after one warm-up step): this checkout, and
   `--baseline-ref` checked out into a temporary git worktree with its own environment
   (`uv run` there), each in a subprocess, alternating before/after/before/after. The default ref is the last commit before the
   rollout loop (tempering/experience/rollouts.py) replaced GRPO's single-turn generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP_SCRIPT = r"""
import json, sys, time
from pathlib import Path
from tempering.algorithms import grpo
from tempering.losses import ClippedPGLoss
from tempering.config import GRPOMasterConfig, load_config
steps, log_dir = int(sys.argv[1]), sys.argv[2]
cfg, resolved = load_config(Path("examples/configs/grpo_math_tiny.yaml"), [
    "grpo.val_period=0", "checkpointing.enabled=false", "logger.tensorboard_enabled=false",
    f"logger.log_dir={log_dir}"], schema=GRPOMasterConfig)
run = grpo.setup(cfg, resolved)
times = []
try:
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        grpo.grpo_step(run, ClippedPGLoss())
        times.append(time.perf_counter() - t0)
finally:
    run.close()
print("RESULT " + json.dumps(times[1:]))
"""


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def rollouts_per_s(config: str, repeats: int) -> tuple[list[float], list[float]]:
    """(in-process, HTTP) rollouts/s, `repeats` alternating measurements each."""
    from tempering.algorithms import grpo
    from tempering.config import GRPOMasterConfig, load_config
    from tempering.experience.rollouts import HttpTurnClient

    cfg, resolved = load_config(
        REPO / "examples/configs" / config,
        [
            "policy.generation.http_server.enabled=true",
            "grpo.val_period=0",
            "checkpointing.enabled=false",
            "logger.tensorboard_enabled=false",
            "logger.log_dir=/tmp/tempering_bench_rollouts",
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    G = cfg.grpo.num_generations_per_prompt
    problems = run.train_problems[: cfg.grpo.num_prompts_per_step]
    clients = {
        "in_process": run.turns,
        "http": HttpTurnClient(run.server.base_url, run.chat.settings.model_name),
    }
    rates: dict[str, list[float]] = {k: [] for k in clients}
    try:
        for i in range(repeats + 1):
            for name, client in clients.items():
                run.turns = client
                t0 = time.perf_counter()
                batch = grpo.rollouts(run, problems, greedy=False, repeat=G)
                if i:  # the first round warms both paths up
                    rates[name].append(batch.size / (time.perf_counter() - t0))
        turns = float(batch["turns"].float().mean())
        print(f"  {config}: {batch.size} episodes per round, {turns:.2f} turns/episode")
    finally:
        run.close()
    return rates["in_process"], rates["http"]


def gym_rollouts_per_s(mode: str, repeats: int) -> tuple[list[float], list[float]]:
    """(in-process, NeMo Gym) rollouts/s on grpo_math_tiny's workload."""
    from tempering.algorithms import grpo
    from tempering.config import GRPOMasterConfig, load_config
    from tempering.config.schemas import NemoGymConfig
    from tempering.data.nemo_gym import problem_row
    from tempering.environments.nemo_gym import (
        NemoGymClient,
        NemoGymEnvironment,
    )
    from tempering.environments.nemo_gym_instances import build_nemo_gym_environment
    from tempering.environments.nemo_gym_standin import GymStandIn

    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        ["policy.generation.http_server.enabled=true", "grpo.val_period=0",
         "checkpointing.enabled=false", "logger.tensorboard_enabled=false",
         "logger.log_dir=/tmp/tempering_bench_gym"],
        schema=GRPOMasterConfig,
    )  # fmt: skip
    run = grpo.setup(cfg, resolved)
    G = cfg.grpo.num_generations_per_prompt
    problems = run.train_problems[: cfg.grpo.num_prompts_per_step]
    rows = [problem_row(p.prompt, p.answer) for p in problems]
    sampling = run.chat.settings.default_sampling
    standin = None
    try:
        if mode == "real":
            gym = build_nemo_gym_environment(
                NemoGymConfig(
                    config_paths=["resources_servers/equivalence_rule/configs/lc.yaml"],
                    default_route="lc_equivalence_rule_environment_server",
                ),
                policy_base_url=run.server.base_url,
                policy_model_name=run.chat.settings.model_name,
                policy_api_key=None,
                max_seq_len=cfg.policy.max_total_sequence_length,
                pad_token_id=0,
                work_dir="/tmp/tempering_bench_gym/nemo_gym",
            )
        else:
            standin = GymStandIn(run.server.base_url, run.chat.settings.model_name).start()
            client = NemoGymClient(standin.head_url, default_route=standin.ENVIRONMENT_SERVER)
            gym = NemoGymEnvironment(client, max_seq_len=cfg.policy.max_total_sequence_length)
        rates: dict[str, list[float]] = {"in_process": [], "gym": []}
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            n = grpo.rollouts(run, problems, greedy=False, repeat=G).size
            local = n / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            n = gym.rollouts(rows, sampling=sampling, repeat=G).size
            remote = n / (time.perf_counter() - t0)
            if i:  # the first round warms both paths up
                rates["in_process"].append(local)
                rates["gym"].append(remote)
        gym.shutdown()
    finally:
        if standin is not None:
            standin.stop()
        run.close()
    return rates["in_process"], rates["gym"]


def step_times(cwd: Path, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as log_dir:
        r = subprocess.run(
            ["uv", "run", "--locked", "python", "-c", STEP_SCRIPT, str(steps), log_dir],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "TEMPERING_VENVS_DIR": str(cwd / "venvs")},
        )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise SystemExit(f"GRPO step timing in {cwd} failed:\n{r.stderr[-3000:]}")
    return json.loads(line[0][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--baseline-ref", default="30a85ff")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--smollm2", action="store_true", help="also the SmolLM2-135M workload")
    p.add_argument("--gym", choices=["real", "standin", "none"], default="real")
    a = p.parse_args()

    print("Rollouts/s, HTTP vs in-process (median, min-max):")
    rows = []
    configs = ["grpo_math_tiny.yaml", "grpo_multiturn_tiny.yaml"]
    for config in configs + (["grpo_math_smollm2.yaml"] if a.smollm2 else []):
        local, http = rollouts_per_s(config, a.repeats if "tiny" in config else 2)
        rows.append((config, local, http))
    for config, local, http in rows:
        ratio = statistics.median(http) / statistics.median(local)
        print(f"  {config:28s} in-process {spread(local)}  http {spread(http)}  "
              f"http/in-process {ratio:.2f}x")  # fmt: skip
    if a.gym != "none":
        local, gym = gym_rollouts_per_s(a.gym, a.repeats)
        ratio = statistics.median(gym) / statistics.median(local)
        print(
            f"\nNeMo Gym ({a.gym}) vs in-process, grpo_math_tiny 32x8 (rollouts/s, median, min-max):"
        )
        print(f"  in-process {spread(local)}  gym {spread(gym)}  gym/in-process {ratio:.2f}x")
    if a.skip_baseline:
        return
    print(f"\nSingle-turn GRPO s/step (grpo_math_tiny, median of 2x{a.steps}, min-max):")
    with tempfile.TemporaryDirectory(prefix="tempering_baseline_") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), a.baseline_ref],
            check=True,
            capture_output=True,
        )
        before: list[float] = []
        after: list[float] = []
        try:  # alternate, so that machine load drifting over time hits both sides alike
            for _ in range(2):
                before += step_times(base, a.steps)
                after += step_times(REPO, a.steps)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)])
    print(f"  before ({a.baseline_ref}) {spread(before)}")
    print(f"  after  (this checkout) {spread(after)}")
    ratio = statistics.median(before) / statistics.median(after)
    print(f"  before/after {ratio:.2f}x (>1: this checkout is faster)")


if __name__ == "__main__":
    main()
