"""GRPO runs in the test process for the slow tier's learning tests: `train` runs an example
config for a number of steps (synchronous or asynchronous, as its config says) and returns
`grpo.train`'s summary; `assert_ran_async` checks from a run's own logs that it overlapped
generation with training with samples one weight version old, so a test fails when an
asynchronous run silently ran the synchronous schedule; `gym_standin` routes a run's rollouts
through our NeMo Gym protocol stand-in. `run_job` runs the GRPO script in a process of its own
(to be killed, resumed, compared): `records` reads its metrics without timings, and
`assert_same_run` compares two runs' records. `assert_documented` checks that every key a
run logged is in the metrics reference (`tempering.utils.metric_docs`); `train` and `records`
check it of every run they read, and the other loops' learning tests call it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tempering.config import GRPOMasterConfig, load_config
from tempering.utils.threads import ENV as ADAPTIVE_THREADS

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
        summary = (async_grpo.train if cfg.grpo.async_grpo.enabled else grpo.train)(run)
    finally:
        run.close()
    assert_documented(out / "logs")
    return summary


def assert_documented(logs: Path) -> None:
    """Every key of ``logs/metrics.jsonl`` has its own entry in the metrics reference (an entry
    that stands for a whole prefix, like ``train/<name>``, does not count)."""
    from tempering.utils.metric_docs import undocumented

    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    missing = undocumented(k for r in rows for k in r)
    assert rows and not missing, f"{logs}: keys missing from metric_docs.METRICS: {missing}"


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


class Finished(subprocess.CompletedProcess):
    left: list[str]  # processes of the run's session still alive after it exited


def run_job(args: list[str], env: dict[str, str] | None = None, script: str = "run_grpo_math.py"
            ) -> Finished:  # fmt: skip
    """``examples/<script> *args`` in its own process group (a fault from ``env``'s
    TEMPERING_FAULT, none by default), killed whole afterwards: a run that hangs, or a killed
    run's stragglers, cannot load the machine under the tests that follow.

    Its workers keep their configured threads (``TEMPERING_ADAPTIVE_THREADS=0``): these runs
    are compared number for number, and a thread change in one run splits its reductions
    differently -- 1e-7 at the change, grown past 1e-5 within 15 steps (CI: the PPO baseline's
    policy dropped to one thread for step 10 on a busy machine, and critic/grad_norm differed
    at step 24, before the kill)."""
    import pytest

    cmd = [sys.executable, f"examples/{script}", *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TEMPERING_FAULT": "", ADAPTIVE_THREADS: "0", **(env or {})},
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=900)
        left = _left_behind(proc.pid)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{cmd} ran past 900 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    done = Finished(cmd, proc.returncode, stdout, stderr)
    done.left = left
    return done


def _left_behind(session: int, wait_s: float = 10.0) -> list[str]:
    """The live processes of `session` (the run's, started in its own), once they have had
    `wait_s` to end after the run exited: Ray's node processes are tied to the driver and end
    within a second of it."""
    from tempering.utils.stopping import process_table

    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid, (state, _ppid, sid) in process_table().items():
            if sid == session and state != "Z":  # not a zombie
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    left.append(f"{pid} {cmdline.decode(errors='replace')[:80]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def records(out: Path) -> list[dict]:
    """A run's metrics.jsonl without what differs run to run (timings, throughput)."""
    assert_documented(out / "logs")
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not _is_timing(k)} for r in rows]


def _is_timing(key: str) -> bool:  # and resource use (CPU time, peak memory)
    return key.startswith(("timing/", "throughput/", "resources/")) or key.endswith(("_s", "per_s"))


def assert_same_run(got: list[dict], want: list[dict], what: str) -> None:
    """Every record of ``want`` once in ``got`` with the same numbers (rel. 1e-5)."""
    key = lambda r: (r["step"], tuple(sorted(r)))  # noqa: E731 - one record per step and kind
    assert sorted(map(key, got)) == sorted(map(key, want)), f"{what}: steps lost or repeated"
    by_key = {key(r): r for r in want}
    for row in got:
        ref = by_key[key(row)]
        for k, v in row.items():
            if isinstance(v, float):
                assert math.isclose(v, ref[k], rel_tol=1e-5, abs_tol=1e-6), (what, row["step"], k)
            else:
                assert v == ref[k], (what, row["step"], k)
