"""Atomic file and directory writes.

A reader (a resuming run, a plot, another process) must never see a half-written file or
checkpoint. Both helpers write to a temporary name beside the final one (same filesystem)
and rename it into place only when the write finished; on an exception the temporary copy
is removed and the final path is left as it was.

    atomic_write_text(log_dir / "config.yaml", text)

    with atomic_directory(ckpt_dir / "step_100") as tmp:   # tmp = step_100.tmp-<pid>
        torch.save(state, tmp / "model.pt")
    # step_100/ now exists, complete
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_MARKER = ".tmp-"
"""Substring in the name of every in-progress temporary path; readers skip such names."""


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort; some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARKER}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; returns the final path."""
    return atomic_write_bytes(path, text.encode(encoding))


@contextlib.contextmanager
def atomic_directory(final_path: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it to ``final_path`` on success.

    Yields ``<final_path>.tmp-<pid>``. On a clean exit it is renamed to ``final_path``; on an
    exception it is deleted and ``final_path`` is untouched. If ``final_path`` already exists,
    it is replaced when ``overwrite=True`` and otherwise a ``FileExistsError`` is raised
    (before any work is done).
    """
    final = Path(final_path)
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"atomic_directory: {final} already exists; delete it or pass overwrite=True"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{TMP_MARKER}{os.getpid()}")
    if tmp.exists():  # left over from a crashed attempt of this same process id
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(
                f"atomic_directory: {final} appeared while writing; delete it or pass overwrite=True"
            )
        old = final.with_name(f"{final.name}.old{TMP_MARKER}{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
