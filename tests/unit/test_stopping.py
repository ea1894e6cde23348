"""Ctrl-C and SIGTERM stop a run cleanly (`tempering.utils.stopping`).

Each case runs a small script under `stop_cleanly` in a subprocess and signals it once the
script says it is inside. The whole job with Ray (interrupted, then resumed to the
uninterrupted run's numbers) is in tests/functional/test_reliability.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tempering.utils.stopping import process_table, stop_cleanly, stop_message

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from types import SimpleNamespace
    from tempering.utils import stopping

    stopping.REPEAT_S = float(sys.argv[2])
    with stopping.stop_cleanly(SimpleNamespace(enabled=True, checkpoint_dir=sys.argv[1])):
        try:
            print("inside", flush=True)
            while True:
                time.sleep(0.01)
        finally:
            if sys.argv[3] == "hang":  # a worker process below, and a cleanup that hangs
                worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                print(worker.pid, flush=True)
            print("cleanup", flush=True)
            while sys.argv[3] == "hang":
                time.sleep(0.01)
    """
)


def _signalled(ckpt: Path, signals: list[int], repeat_s: float = 2.0, cleanup: str = "quick"):
    """Start the child, send it `signals[0]`, then the rest once its cleanup has begun (or at
    once, for a repeat as `uv run` delivers it); return (returncode, stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ckpt), str(repeat_s), cleanup],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "inside\n"
        proc.send_signal(signals[0])
        worker = int(proc.stdout.readline()) if cleanup == "hang" else None
        for sig in signals[1:]:
            if cleanup == "hang":
                assert proc.stdout.readline() == "cleanup\n"
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, (worker if cleanup == "hang" else out), err


def _alive(pid: int) -> bool:
    entry = process_table().get(pid)
    return entry is not None and entry[0] != "Z"  # a zombie: killed, not yet reaped by init


def _checkpoint(ckpt: Path, step: int, complete: bool = True) -> None:
    folder = ckpt / (f"step_{step}" if complete else f"step_{step}.tmp-1-abc")
    folder.mkdir(parents=True)
    if complete:
        (folder / "training_info.json").write_text(json.dumps({"step": step}))


def test_ctrl_c_delivered_twice_runs_cleanup_names_the_checkpoint_and_exits_130(tmp_path):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, complete=False)  # a save that never finished is not the one
    code, out, err = _signalled(tmp_path, [signal.SIGINT, signal.SIGINT])  # terminal + uv
    assert code == 130, err
    assert "cleanup" in out
    assert f"stopped by SIGINT; the same command, run again, resumes from {tmp_path}/step_2 " \
        "(step 2)" in err  # fmt: skip
    assert "Traceback" not in err


def test_sigterm_exits_143_and_says_a_rerun_starts_over_without_a_checkpoint(tmp_path):
    code, out, err = _signalled(tmp_path / "none", [signal.SIGTERM])
    assert code == 143, err
    assert "cleanup" in out
    assert "stopped by SIGTERM; no complete checkpoint in" in err
    assert "starts from the beginning" in err and "Traceback" not in err


def test_a_later_repeat_while_cleanup_hangs_kills_the_workers_and_exits_at_once(tmp_path):
    code, worker, err = _signalled(tmp_path, [signal.SIGINT, signal.SIGINT], 0.0, "hang")
    assert code == 130, err
    assert "SIGINT again while stopping: exiting now; killed 1 processes below this one" in err
    deadline = time.monotonic() + 10  # SIGKILLed before the exit; the kernel ends it
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the worker below the stopped process runs on"


def test_a_keyboard_interrupt_raised_by_code_passes_and_handlers_are_restored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt), stop_cleanly():
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        raise KeyboardInterrupt  # no signal came: not a stop request
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_message_without_checkpointing():
    off = SimpleNamespace(enabled=False, checkpoint_dir="results/x")
    assert stop_message(signal.SIGINT, off) == (
        "stopped by SIGINT; checkpointing.enabled=false, so a rerun starts from the beginning"
    )
    assert stop_message(signal.SIGTERM) == "stopped by SIGTERM"
