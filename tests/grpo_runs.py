"""GRPO runs in the test process for the slow tier's learning tests: `train` runs an example
config for a number of steps (synchronous or asynchronous, as its config says) and returns
`grpo.train`'s summary; `assert_ran_async` checks from a run's own logs that it overlapped
generation with training with samples one weight version old, so a test fails when an
asynchronous run silently ran the synchronous schedule; `gym_standin` routes a run's rollouts
through our NeMo Gym protocol stand-in.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tempering.config import GRPOMasterConfig, load_config

REPO = Path(__file__).parents[1]
# Asynchronous GRPO as the learning tests run it: on split generation workers, and with the
# importance-sampling correction for samples one weight version old: without it some of our
# short runs (40-60 steps) ended 3-7 points below their synchronous runs, and the multi-turn
# job falls 16-22 points behind mid-run, below its start (the docstrings of
# test_grpo_nemo_gym.py and test_grpo_multiturn_async.py give the numbers).
ASYNC = [
    "grpo.async_grpo.enabled=true",
    "policy.generation.colocated.enabled=false",
    "loss_fn.use_importance_sampling_correction=true",
]


def train(config: str, steps: int, out: Path, extra: list[str]) -> dict[str, Any]:
    """`steps` steps of ``examples/configs/<config>`` (no wall-clock cap), validated at the
    start and the end; logs in ``out/logs``, the final model in ``out/ckpt`` (never the
    repo's ``results/``)."""
    from tempering.algorithms import async_grpo, grpo

    cfg, resolved = load_config(
        REPO / "examples/configs" / config,
        [
            f"grpo.max_num_steps={steps}",
            f"grpo.val_period={steps}",
            "grpo.max_wall_time_s=null",  # the steps asked for, however loaded the machine
            "checkpointing.enabled=false",
            f"logger.log_dir={out}/logs",
            f"checkpointing.checkpoint_dir={out}/ckpt",
            *extra,
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    try:
        return (async_grpo.train if cfg.grpo.async_grpo.enabled else grpo.train)(run)
    finally:
        run.close()


def assert_ran_async(out: Path, steps: int) -> None:
    """Step 1 trained on the initial weights' samples and every later step on samples exactly
    one version old (``train/max_trajectory_age``), and the collector started each step's
    batch before the previous step's refit (``timeline.jsonl``): generation overlapped training."""
    logs = out / "logs"
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    ages = [r["train/max_trajectory_age"] for r in rows if "train/max_trajectory_age" in r]
    assert ages == [0.0] + [1.0] * (steps - 1), ages
    phases = [json.loads(x) for x in (logs / "timeline.jsonl").read_text().splitlines()]
    gen = {p["step"]: p for p in phases if p["role"] == "collector"}
    refit = {p["step"]: p for p in phases if (p["role"], p["phase"]) == ("trainer", "refit")}
    assert sorted(gen) == sorted(refit) == list(range(1, steps + 1))
    late = [t for t in range(1, steps) if gen[t + 1]["start"] >= refit[t]["start"]]
    assert not late, f"batches generated only after the previous step's refit: {late}"


@contextlib.contextmanager
def gym_standin() -> Iterator[tuple[Any, list[str]]]:
    """Our NeMo Gym protocol stand-in (tempering/environments/nemo_gym_standin.py), running in
    a process of its own as Gym does: ``(the stand-in, the overrides that send every rollout
    through it)`` -- Gym rows as the task, the trainer's generation server on the port the
    stand-in's agent calls."""
    from tempering.environments.nemo_gym_standin import StandInProcess

    with socket.socket() as s:  # the stand-in must know our server's URL before it starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with StandInProcess(f"http://127.0.0.1:{port}/v1", "policy") as gym:
        yield (
            gym,
            [
                "env.task_name=nemo_gym",
                f"env.nemo_gym.head_server_url={gym.head_url}",
                f"env.nemo_gym.default_route={gym.ENVIRONMENT_SERVER}",
                "policy.generation.http_server.enabled=true",
                f"policy.generation.http_server.port={port}",
            ],
        )
