"""A weighted blend, end to end: the shipped ``grpo_blend_tiny.yaml`` (exact arithmetic,
multi-turn retries and a custom reward function on tiny-arith-chat), 4 steps with validation
and a checkpoint every 2, run by the example script in a process of its own.

One uninterrupted run is shared by the assertions: every step logs each entry's reward mean,
sample count and (for the two whose rewards are correct answers) accuracy, the sample counts
add up to the step's prompts and follow the weights' draws, and each validation logs every
entry. Then the same command is killed with SIGKILL as the controller enters step 3's train
phase and run again: it resumes from step 2's checkpoint, whose data loader state holds the
blend sampler's, and its records equal the uninterrupted run's -- the same prompts drawn from
the same entries (their sample counts), the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.grpo_runs import assert_same_run, records, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, G, PROMPTS = 4, 8, 32
ENTRIES = ("exact", "retry", "graded")
ARGS = [
    "--config", "examples/configs/grpo_blend_tiny.yaml",
    f"grpo.max_num_steps={STEPS}", "grpo.val_period=2", "grpo.max_wall_time_s=null",
    "checkpointing.save_period=2",
]  # fmt: skip


def _run(out: Path, env: dict[str, str] | None = None):
    return run_job(
        [*ARGS, f"logger.log_dir={out}/logs", f"checkpointing.checkpoint_dir={out}/ckpt"], env
    )


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("blend")
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data.blend: each prompt drawn from exact 50.0%" in proc.stderr
    return out, records(out)  # records() checks every key is in the metrics reference


def test_each_step_and_validation_log_every_entry(baseline):
    _, rows = baseline
    steps = [r for r in rows if "env/exact/samples" in r or "env/retry/samples" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    drawn = {name: 0.0 for name in ENTRIES}
    for r in steps:
        counts = {n: r.get(f"env/{n}/samples", 0.0) for n in ENTRIES}
        assert sum(counts.values()) == PROMPTS * G, r
        for n in ENTRIES:
            drawn[n] += counts[n]
            if counts[n]:
                assert 0.0 <= r[f"env/{n}/reward_mean"] <= 1.0
                assert (f"env/{n}/accuracy" in r) == (n != "graded"), (n, sorted(r))
    # 4 x 32 prompts drawn 50/25/25%: each entry within 4 standard deviations of its share
    total = STEPS * PROMPTS
    for n, share in zip(ENTRIES, (0.5, 0.25, 0.25), strict=True):
        sd = (total * share * (1 - share)) ** 0.5
        assert abs(drawn[n] / G - total * share) < 4 * sd, (n, drawn[n] / G)
    vals = [r for r in rows if "val/exact/samples" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    for r in vals:
        assert all(r[f"val/{n}/samples"] == 64.0 for n in ENTRIES), r
        assert "val/exact/accuracy" in r and "val/graded/accuracy" not in r
        assert r["val/graded/reward_mean"] > 0.0  # graded: near misses score


def test_kill_9_and_rerun_resumes_the_blend_exactly(baseline, tmp_path):
    _, rows = baseline
    fault = "controller:train:3:0.05"  # step 3's training, after step 2's checkpoint
    killed = _run(tmp_path, env={"TEMPERING_FAULT": fault})
    assert killed.returncode != 0, f"{fault}: the fault never fired"
    info = json.loads((tmp_path / "ckpt" / "step_2" / "training_info.json").read_text())
    assert info["dataloader"]["blend"]["calls"] == 2  # two steps' draws, none since
    assert sorted(info["dataloader"]["entries"]) == sorted(ENTRIES)
    rerun = _run(tmp_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr and "step_2" in rerun.stderr
    assert_same_run(records(tmp_path), rows, f"blend, killed at {fault}")
