"""kill -9 the main job, run the same command again: it resumes, and its summary tells the
whole run's story from the records (slow tier).

The first run is killed (its whole process group, Ray included) once the step-20 checkpoint is
complete; the rerun resumes there. Its summary must give the start accuracy of step 0 (logged
by the killed run, not "n/a"), the total steps and how many this run did, training time that
includes the killed run's, and the last validation as the end. The same command once more,
the run finished, makes no step and still reports both ends (the last from the step-40
checkpoint, not "n/a").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).parents[2]


def test_summary_after_kill_and_resume(tmp_path):
    cmd = [
        sys.executable, str(REPO / "examples/run_grpo_math.py"),
        "grpo.max_num_steps=40", "grpo.val_period=10", "checkpointing.save_period=10",
        "checkpointing.keep_top_k=null", "data.num_val_samples=64", "grpo.max_val_samples=64",
        "grpo.max_wall_time_s=null", f"logger.log_dir={tmp_path}/logs",
        "logger.tensorboard_enabled=false", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while not (tmp_path / "ckpt/step_20/training_info.json").is_file():
        assert first.poll() is None, "the first run ended before its step-20 checkpoint"
        assert time.monotonic() < deadline, "no step-20 checkpoint within 10 minutes"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the driver and the Ray it started
    first.wait()
    killed_time = json.loads((tmp_path / "ckpt/step_20/training_info.json").read_text())[
        "wall_time_s"
    ]
    total, this_run, resumed, seconds, start, end = _summary(cmd, env)
    assert (int(total), int(this_run), int(resumed)) == (40, 20, 20)
    assert int(seconds) >= int(killed_time)  # the killed run's training time counts
    rows = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    assert float(start) == round(100 * vals[0], 1) and vals[0] > 0.3  # the killed run's step 0
    assert float(end) == round(100 * vals[40], 1)
    assert (tmp_path / "ckpt/final_hf/config.json").is_file()

    # the same command once more, the run finished: no step, the same two ends
    again = _summary(cmd, env)
    assert again[:3] == ("40", "0", "40") and again[4:] == (start, end)


def _summary(cmd: list[str], env: dict[str, str]) -> tuple[str, ...]:
    """Run ``cmd`` to the end; its summary's (total steps, steps this run, resumed at, training
    seconds, start %, end %)."""
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = re.search(
        r"GRPO summary: (\d+) steps \((\d+) in this run, resumed at step (\d+)\) in (\d+) s of "
        r"training; held-out greedy accuracy ([\d.]+)% -> ([\d.]+)%",
        done.stdout,
    )
    assert summary, done.stdout[-2000:]
    return summary.groups()
