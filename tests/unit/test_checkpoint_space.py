"""A checkpoint that does not fit on its disk is named, with the fix, and nothing is lost.

On a real full disk: a 2 MiB tmpfs mounted for this module (the suite runs as root on its
machines, as CI does). torch's own writer reports a full disk as ``unexpected pos 704 vs
598``; the run said nothing more before (found filling a 10 MiB checkpoint folder by hand).
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from tempering.utils.checkpoint import CheckpointManager, CheckpointSpaceError


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory) -> Path:
    mount = tmp_path_factory.mktemp("small_disk")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def ckpt(small_disk) -> CheckpointManager:
    subprocess.run(f"rm -rf {small_disk}/*", shell=True, check=True)
    return CheckpointManager(small_disk / "ckpt", save_period=1, keep_top_k=2)


def _write(folder: Path, nbytes: int) -> None:
    (folder / "policy").mkdir()
    (folder / "policy" / "shard.bin").write_bytes(b"\0" * nbytes)


def test_a_save_that_would_not_fit_is_refused_before_writing(ckpt):
    with ckpt.save(1) as folder:
        _write(folder, 1_200_000)
    with pytest.raises(CheckpointSpaceError) as err, ckpt.save(2) as folder:
        pytest.fail("the save began although the newest checkpoint does not fit beside it")
    msg = str(err.value)
    assert "checkpoint step_2 would not fit in checkpointing.checkpoint_dir=" in msg
    assert "MiB free; the newest one, step_1, takes 1." in msg
    assert "lower checkpointing.keep_top_k" in msg
    assert f"{ckpt.checkpoint_dir / 'step_1'} is intact" in msg
    assert sorted(p.name for p in ckpt.checkpoint_dir.iterdir()) == ["step_1"]


def test_a_save_that_fills_the_disk_says_so_and_leaves_nothing_half_written(ckpt):
    with pytest.raises(CheckpointSpaceError) as err, ckpt.save(1) as folder:
        _write(folder, 3_000_000)  # the first save: no earlier one to size it by
    assert isinstance(err.value.__cause__, OSError)
    assert err.value.__cause__.errno == errno.ENOSPC
    assert "checkpoint step_1 filled the disk" in str(err.value)
    assert list(ckpt.checkpoint_dir.iterdir()) == []


def test_any_other_failure_inside_a_save_is_left_as_it_is(ckpt):
    with pytest.raises(ValueError, match="not about space"), ckpt.save(1) as folder:
        _write(folder, 1000)
        raise ValueError("not about space")
