"""One run at a time in a folder (`tempering.utils.run_lock`): the lock holds while its run
lives, however the run ends it goes with it, and a run's own two folders never conflict.
The refusal as a user sees it (an example script, exit 2) is in test_user_errors.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tempering.utils.run_lock import LOCK_FILE, RunDirInUseError, lock_run_dirs


def _cfg(logs: Path, ckpt: Path, checkpointing: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        logger=SimpleNamespace(log_dir=str(logs)),
        checkpointing=SimpleNamespace(enabled=checkpointing, checkpoint_dir=str(ckpt)),
    )


HOLDER = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    from tempering.utils.run_lock import lock_run_dirs

    cfg = SimpleNamespace(logger=SimpleNamespace(log_dir=sys.argv[1]),
                          checkpointing=SimpleNamespace(enabled=True, checkpoint_dir=sys.argv[2]))
    with lock_run_dirs(cfg):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes stdin, or kills this process
    """
)


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_the_lock_holds_while_its_run_lives_and_goes_with_it(tmp_path, end):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(logs), str(ckpt)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        for cfg, key in ((_cfg(logs, tmp_path / "other"), "logger.log_dir"),
                         (_cfg(tmp_path / "other", ckpt), "checkpointing.checkpoint_dir")):  # fmt: skip
            with pytest.raises(RunDirInUseError) as err, lock_run_dirs(cfg):
                pass
            assert f"{key}=" in str(err.value) and f"pid {holder.pid} on " in str(err.value)
        if end == "exits":
            holder.stdin.close()
        else:
            holder.send_signal(signal.SIGKILL)  # kill -9: no cleanup runs, the kernel frees it
        holder.wait(timeout=60)
    finally:
        holder.kill()
    with lock_run_dirs(_cfg(logs, ckpt)):
        assert (logs / LOCK_FILE).is_file() and (ckpt / LOCK_FILE).is_file()


def test_a_run_s_own_folders_do_not_conflict_and_an_unused_one_is_not_locked(tmp_path):
    with lock_run_dirs(_cfg(tmp_path / "same", tmp_path / "same")):  # one folder for both
        pass
    with lock_run_dirs(_cfg(tmp_path / "logs", tmp_path / "ckpt", checkpointing=False)):
        assert not (tmp_path / "ckpt").exists()
        with lock_run_dirs(_cfg(tmp_path / "logs2", tmp_path / "ckpt")):
            pass  # the first run does not checkpoint, so its checkpoint folder is free
