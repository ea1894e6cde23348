"""Checkpoints of a training run: ``<checkpoint_dir>/step_<N>/``, written atomically.

A checkpoint folder holds

- ``policy/``: written by the policy workers (`Policy.save_checkpoint`: sharded DCP state);
- ``training_info.json``: step, metric values, dataloader position, and the controller's RNG
  states (python, numpy, torch) so a resumed run draws the same numbers;
- ``config.yaml``: the resolved config of the run.

It is built under a temporary name and renamed to ``step_<N>`` only when everything is written
(`tempering.utils.atomic.atomic_directory`), so a crash mid-save leaves no ``step_<N>`` behind
and `latest_complete` never returns a half-written checkpoint. An algorithm uses it like this:

    ckpt = CheckpointManager(cfg.checkpoint_dir, save_period=10, keep_top_k=3,
                             metric_name="val/loss", higher_is_better=False)
    resumed = ckpt.maybe_resume()            # (step, training_info) or None
    if resumed:
        step, info = resumed
        policy.load_checkpoint(str(ckpt.policy_dir(step)))
        restore_rng_state(info["rng_state"])
    ...
    if ckpt.should_save(step):
        with ckpt.save(step, {"metrics": metrics, "dataloader": pos}, config) as folder:
            policy.save_checkpoint(str(folder / "policy"))
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from tempering.errors import UserInputError
from tempering.utils.atomic import TMP_MARKER, atomic_directory

logger = logging.getLogger(__name__)

TRAINING_INFO = "training_info.json"
CONFIG_FILE = "config.yaml"
POLICY_DIR = "policy"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------ RNG state
def capture_rng_state() -> dict[str, Any]:
    """The controller's python / numpy / torch (CPU) RNG states as JSON-able values."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state(
        (np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss)
    )
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


# ------------------------------------------------------------------------ manager
def change_lines(diff: Mapping[str, tuple]) -> list[str]:
    """A `CheckpointManager.config_diff` as ``key: saved -> now`` lines."""
    return [f"{key}: {saved!r} -> {now!r}" for key, (saved, now) in diff.items()]


class CheckpointMismatchError(ValueError, UserInputError):
    """A checkpoint folder holds another model's run than the one resuming from it."""


class CheckpointSpaceError(OSError, UserInputError):
    """A checkpoint does not fit on its disk (found before writing, or by the disk filling)."""


FULL_BYTES = 256 * 2**10  # a save that failed with less free than this ran out of space


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether a failed save ran out of disk: ENOSPC anywhere in its chain, or its text (a
    worker's error arrives as text), or -- torch's writer says only ``unexpected pos`` -- a
    disk left all but full."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "No space left on device" in str(exc) or shutil.disk_usage(folder).free < FULL_BYTES


class CheckpointManager:
    """Saves, finds, prunes and resumes ``step_<N>`` checkpoints under `checkpoint_dir`.

    Args:
        checkpoint_dir: the run's checkpoint folder (created on first save).
        save_period: save every this many steps (`should_save`).
        keep_top_k: keep this many best checkpoints by `metric_name` (the newest ones when
            no metric is named), plus always the newest (for resuming). None keeps all.
        metric_name: key in ``training_info["metrics"]`` that ranks checkpoints.
        higher_is_better: rank direction for `metric_name`.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        save_period: int,
        keep_top_k: int | None = None,
        metric_name: str | None = None,
        higher_is_better: bool = False,
    ) -> None:
        if save_period < 1:
            raise ValueError(f"checkpointing.save_period={save_period} must be >= 1")
        if keep_top_k is not None and keep_top_k < 1:
            raise ValueError(
                f"checkpointing.keep_top_k={keep_top_k} must be >= 1 or null (keep all)"
            )
        self.checkpoint_dir = Path(checkpoint_dir)
        self.save_period = save_period
        self.keep_top_k = keep_top_k
        self.metric_name = metric_name
        self.higher_is_better = higher_is_better

    # ---------------------------------------------------------------- paths
    def step_dir(self, step: int) -> Path:
        return self.checkpoint_dir / f"step_{step}"

    def policy_dir(self, step: int) -> Path:
        return self.step_dir(step) / POLICY_DIR

    def should_save(self, step: int, *, is_last_step: bool = False) -> bool:
        """True every `save_period` steps, and on the last step of a run."""
        return step > 0 and (step % self.save_period == 0 or is_last_step)

    # ---------------------------------------------------------------- saving
    @contextlib.contextmanager
    def save(
        self,
        step: int,
        training_info: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> Iterator[Path]:
        """Context manager yielding the temporary checkpoint folder to write `policy/` into.

        On a clean exit it writes ``training_info.json`` (with ``step`` and the controller's
        RNG states added) and ``config.yaml``, renames the folder to ``step_<step>`` and prunes
        to `keep_top_k`. On an exception nothing named ``step_<step>`` is left behind.
        An existing ``step_<step>`` is replaced.
        """
        info = dict(training_info or {})
        info["step"] = step
        info.setdefault("metrics", {})
        info["rng_state"] = capture_rng_state()
        newest = self.latest_complete()
        need = _folder_bytes(newest) if newest is not None else 0
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(self.checkpoint_dir).free < need:
            raise self._space_error(step, newest, need, "would not fit")  # before writing
        with atomic_directory(self.step_dir(step), overwrite=True) as tmp:
            try:
                yield tmp
                from tempering.utils.logger import redact_secrets  # none in checkpoints

                plain = redact_secrets(_plain(config or {}))
                (tmp / CONFIG_FILE).write_text(yaml.safe_dump(plain, sort_keys=False))
                # Written last: its presence marks a finished folder even before the rename.
                (tmp / TRAINING_INFO).write_text(json.dumps(_plain(info)))
            except Exception as exc:
                if _out_of_space(exc, self.checkpoint_dir):
                    raise self._space_error(step, newest, need, "filled the disk") from exc
                raise
        self._prune()

    def _space_error(
        self, step: int, newest: Path | None, need: int, what: str
    ) -> CheckpointSpaceError:
        free = shutil.disk_usage(self.checkpoint_dir).free
        size = f"; the newest one, {newest.name}, takes {need / 2**20:.1f} MiB" if newest else ""
        kept = "every checkpoint" if self.keep_top_k is None else f"{self.keep_top_k}"
        intact = (
            f" {newest} is intact: the same command, run again, resumes from it."
            if newest else ""
        )  # fmt: skip
        return CheckpointSpaceError(
            f"checkpoint step_{step} {what} in checkpointing.checkpoint_dir="
            f"'{self.checkpoint_dir}': {free / 2**20:.1f} MiB free{size}, and "
            f"checkpointing.keep_top_k={self.keep_top_k} keeps {kept} beside the one being "
            "written. Free space there, lower checkpointing.keep_top_k, or point "
            f"checkpointing.checkpoint_dir at a larger disk.{intact}"
        )

    # ---------------------------------------------------------------- finding
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, folder)`` of every complete checkpoint, oldest first.

        Complete = named exactly ``step_<N>`` (temporary names carry a ``.tmp-`` marker and
        never match) and holding ``training_info.json``.
        """
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for child in self.checkpoint_dir.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and TMP_MARKER not in child.name and (child / TRAINING_INFO).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_complete(self) -> Path | None:
        """The newest complete checkpoint folder, or None."""
        complete = self.complete_checkpoints()
        return complete[-1][1] if complete else None

    def load_training_info(self, folder: str | Path) -> dict[str, Any]:
        return json.loads((Path(folder) / TRAINING_INFO).read_text())

    def maybe_resume(self) -> tuple[int, dict[str, Any]] | None:
        """``(step, training_info)`` of the newest complete checkpoint, or None for a fresh run.

        The caller restores its policy from ``policy_dir(step)`` and, if it wants identical
        random draws, ``restore_rng_state(training_info["rng_state"])``.
        """
        self.remove_partial_checkpoints()
        latest = self.latest_complete()
        if latest is None:
            return None
        info = self.load_training_info(latest)
        logger.info("resuming from %s (step %s)", latest, info["step"])
        return int(info["step"]), info

    def config_diff(self, folder: str | Path, config: Mapping[str, Any]) -> dict[str, tuple]:
        """``{dotted key: (saved, now)}`` for each config entry that differs between the
        checkpoint's ``config.yaml`` and ``config`` (redacted alike; ``"(absent)"`` where a
        side lacks the key): a resumed run is told what it changed, e.g. a longer
        ``max_num_steps`` or, by mistake, another model."""
        from tempering.utils.logger import redact_secrets

        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            return {}
        saved = _flatten(yaml.safe_load(path.read_text()) or {})
        now = _flatten(redact_secrets(_plain(config)))
        return {
            key: (saved.get(key, "(absent)"), now.get(key, "(absent)"))
            for key in sorted(saved.keys() | now.keys())
            if saved.get(key) != now.get(key)
        }

    def remove_partial_checkpoints(self) -> list[Path]:
        """Delete the temporary folders of saves that never finished (``step_<N>.tmp-<pid>``
        of a process that is gone: a crash or kill mid-save); return what was removed."""
        removed = []
        if not self.checkpoint_dir.is_dir():
            return removed
        for child in self.checkpoint_dir.iterdir():
            name, _, pid = child.name.rpartition(TMP_MARKER)
            if not (name.startswith("step_") and pid.isdigit() and child.is_dir()):
                continue
            if int(pid) != os.getpid() and _process_alive(int(pid)):
                continue  # another live process is writing it
            final = self.checkpoint_dir / name.removesuffix(".old")
            if name.endswith(".old") and not final.exists():
                # Killed between moving the old step_<N> aside and renaming the new one in:
                # the old folder is the only complete copy; put it back.
                os.replace(child, final)
                logger.warning("restored %s from %s (a save interrupted mid-rename)", final, child)
                continue
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
            logger.warning("removed %s: a checkpoint save that never finished", child)
        return removed

    # ---------------------------------------------------------------- pruning
    def _prune(self) -> None:
        if self.keep_top_k is None:
            return
        complete = self.complete_checkpoints()
        if len(complete) <= self.keep_top_k:
            return
        latest_step = complete[-1][0]
        if self.metric_name is None:
            keep = {step for step, _ in complete[-self.keep_top_k :]}
        else:
            keep = {latest_step} | set(self._best_steps(complete))
        for step, folder in complete:
            if step not in keep:
                shutil.rmtree(folder, ignore_errors=True)
                logger.info("removed checkpoint %s (keep_top_k=%d)", folder, self.keep_top_k)

    def _best_steps(self, complete: list[tuple[int, Path]]) -> list[int]:
        """The `keep_top_k` best steps by metric; checkpoints without it rank last."""
        assert self.keep_top_k is not None and self.metric_name is not None
        scored, unscored = [], []
        for step, folder in complete:
            value = self.load_training_info(folder).get("metrics", {}).get(self.metric_name)
            if value is None:
                unscored.append(step)
            else:
                scored.append((float(value), step))
        if unscored:
            logger.warning(
                "checkpoints at steps %s have no metric %r; they rank last for keep_top_k",
                unscored,
                self.metric_name,
            )
        # Best first; among equal values the newer step wins.
        scored.sort(
            key=lambda vs: (vs[0] if self.higher_is_better else -vs[0], vs[1]), reverse=True
        )
        ranked = [s for _, s in scored] + sorted(unscored, reverse=True)
        return ranked[: self.keep_top_k]


def run_folder_hint(folder: str | Path) -> str | None:
    """What to pass instead when `folder` is a run's checkpoint_dir, not one of its steps."""
    found = CheckpointManager(folder, save_period=1).complete_checkpoints()
    if not found:
        return None
    names = ", ".join(path.name for _, path in found)
    final = Path(folder) / "final_hf"
    final_hint = f" or its final model, {final}" if (final / "config.json").is_file() else ""
    return (
        f"{folder} is a run's checkpoint folder, not one step: it holds {names}; pass one of "
        f"them, e.g. the newest, {found[-1][1]}{final_hint}"
    )


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay whole)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _plain(value: Any) -> Any:
    """JSON/YAML-safe copy: tensors and numpy scalars become Python numbers/lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
