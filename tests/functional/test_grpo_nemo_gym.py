"""GRPO through the NeMo Gym HTTP path learns as the in-process path does (slow tier).

The same config (grpo_math_tiny.yaml: tiny-arith, 32 prompts x 8, exact-answer reward) runs
40 GRPO steps twice: in-process, and with every rollout (train and validation) going through
Gym's protocol — `/run` on an environment server, an agent calling tempering's generation
server over HTTP, `/verify` for the reward — served by our protocol-level stand-in
(tempering/environments/nemo_gym_standin.py; the real package is run in
test_nemo_gym_real.py and, for the numbers in the README, by examples/run_grpo_nemo_gym.py).
Both start from 39.8% held-out greedy accuracy (256 problems); each must gain at least 10
points, and the two gains must agree within 5 points.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tempering.config import GRPOMasterConfig, load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).parents[2]
STEPS = 40


def _train(tmp: Path, extra: list[str]) -> dict:
    from tempering.algorithms import grpo

    cfg, resolved = load_config(
        REPO / "examples/configs/grpo_math_tiny.yaml",
        [
            f"grpo.max_num_steps={STEPS}",
            f"grpo.val_period={STEPS}",
            "checkpointing.enabled=false",
            f"logger.log_dir={tmp}",
            *extra,
        ],
        schema=GRPOMasterConfig,
    )
    run = grpo.setup(cfg, resolved)
    try:
        return grpo.train(run)
    finally:
        run.close()


def test_gym_path_gain_matches_in_process_gain(ray_session, tmp_path):
    from tempering.environments.nemo_gym_standin import GymStandIn

    local = _train(tmp_path / "local", [])
    with socket.socket() as s:  # the stand-in must know our server's URL before it starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with GymStandIn(f"http://127.0.0.1:{port}/v1", "policy") as gym:
        via_gym = _train(
            tmp_path / "gym",
            [
                "env.task_name=nemo_gym",
                f"env.nemo_gym.head_server_url={gym.head_url}",
                f"env.nemo_gym.default_route={gym.ENVIRONMENT_SERVER}",
                "policy.generation.http_server.enabled=true",
                f"policy.generation.http_server.port={port}",
            ],
        )
        assert len(gym.chat_requests) >= STEPS * 256  # every rollout went through Gym
    gains = {}
    for name, s in (("in-process", local), ("gym", via_gym)):
        assert s["steps"] == STEPS
        assert abs(s["start_accuracy"] - 0.398) < 0.01, s  # the committed model's
        gains[name] = s["end_accuracy"] - s["start_accuracy"]
        print(
            f"{name}: {s['start_accuracy']:.1%} -> {s['end_accuracy']:.1%} in {s['wall_time_s']:.0f} s"
        )
    assert min(gains.values()) >= 0.10, gains
    assert abs(gains["gym"] - gains["in-process"]) <= 0.05, gains
