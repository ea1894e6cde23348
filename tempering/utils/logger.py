"""Metric logging for every run: metrics.jsonl + config.yaml, TensorBoard, W&B, MLflow.

    logger = Logger(cfg.logger.log_dir, tensorboard_enabled=True, config=resolved_cfg)
    logger.log_metrics({"loss": 0.7, "reward_mean": 0.2}, step=3, prefix="train")
    print_step_summary(3, 100, {"train/loss": 0.7, "timing/step_s": 1.2})
    for batch in track(loader, total=len(loader), description="validation"): ...
    logger.close()

Always written (the contract that tests, benchmarks and ``tempering plot`` rely on):
``<log_dir>/metrics.jsonl`` — one JSON object per ``log_metrics`` call,
``{"step": N, "<prefix>/<key>": value, ...}``, appended and flushed per call — and
``<log_dir>/config.yaml`` — the resolved config with secret-looking values redacted, written
atomically. Optional backends, each switched on by a constructor flag:

- TensorBoard (``torch.utils.tensorboard``) under ``<log_dir>/tensorboard/`` (or
  ``tensorboard_dir``, ``logger.tensorboard.log_dir``);
- Weights & Biases under ``<log_dir>/wandb`` (``WANDB_MODE=offline`` is honoured);
- MLflow, to ``file:<log_dir>/mlruns`` unless a tracking URI is given.

W&B and MLflow are imported only when enabled (they are slow to import). A backend that is
enabled but cannot start is an error that names it and the fix, never a silent skip. A NaN or
Inf is written to metrics.jsonl as ``null`` with a ``nonfinite/<name>`` count beside it (counted
in ``Logger.nonfinite_metric_counts``); a value that is not a scalar is dropped with a warning
and counted in ``Logger.dropped_metric_counts``; neither crashes a run.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

from tempering.errors import UserInputError
from tempering.utils.atomic import atomic_write_text

_log = logging.getLogger(__name__)
T = TypeVar("T")

REDACTED = "***REDACTED***"
_SECRET_WORDS = {"password", "passwd", "secret", "apikey", "credential", "credentials"}
_KEY_QUALIFIERS = {"api", "secret", "private", "access"}
_TOKEN_QUALIFIERS = {"api", "access", "auth", "hf", "bearer", "refresh", "session", "wandb", "github", "secret", "private", "id"}  # fmt: skip


def is_secret_key(key: str) -> bool:
    """True for config keys that look like credentials (``api_key``, ``hf_token``, ``password``).

    Tokenizer settings such as ``pad_token``, ``max_tokens`` or ``tokenizer`` are not secrets.
    """
    parts = [p for p in re.split(r"[_\-.\s]+", key.lower()) if p]
    if not parts:
        return False
    if _SECRET_WORDS & set(parts):
        return True
    if parts[-1] == "token":
        return len(parts) == 1 or parts[-2] in _TOKEN_QUALIFIERS
    if parts[-1] == "key" and len(parts) >= 2:
        return parts[-2] in _KEY_QUALIFIERS
    return False


def redact_secrets(obj: Any) -> Any:
    """A copy of a nested dict/list config with secret-looking values replaced by ``REDACTED``."""
    if isinstance(obj, Mapping):
        return {
            k: (REDACTED if is_secret_key(str(k)) and v not in (None, "") else redact_secrets(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact_secrets(v) for v in obj]
    return obj


def _to_plain_config(config: Any) -> dict[str, Any]:
    """Accept a dict, an OmegaConf DictConfig or a pydantic model; return plain containers."""
    if config is None:
        return {}
    if hasattr(config, "model_dump"):  # pydantic v2 model
        config = config.model_dump(mode="json")
    elif type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise TypeError(f"Logger: config must be a mapping, got {type(config).__name__}")
    # Round-trip through YAML-safe types (tuples -> lists, Paths -> str) so the file re-loads.
    return json.loads(json.dumps(config, default=str))


def _as_finite_scalar(value: Any) -> float | int | None:
    """The value as a Python int/float, or None when it is not a finite scalar."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # 0-dim torch tensor / numpy array or numpy scalar
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


def _is_real_scalar(value: Any) -> bool:
    """A real number (or 0-dim array of one) that `_as_finite_scalar` refused: NaN or Inf."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def prepare_metrics_file(path: Path, resume_step: int | None) -> dict[str, int]:
    """Make ``metrics.jsonl`` agree with the checkpoint a run starts from.

    Resuming at step ``k``: keep the whole lines of steps <= ``k`` and drop a torn last line
    (a killed writer) and the lines past ``k`` (steps the checkpoint does not hold, which the
    resumed run will log again), rewriting the file atomically. A fresh run
    (``resume_step`` None or 0) moves an earlier run's non-empty file aside to
    ``metrics.jsonl.prev-<n>``. Returns what was dropped/moved, also logged."""
    counts = {"torn": 0, "past_checkpoint": 0, "moved": 0}
    if not path.is_file() or path.stat().st_size == 0:
        return counts
    if not resume_step:
        n = 1
        while path.with_name(f"{path.name}.prev-{n}").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.prev-{n}"))
        counts["moved"] = 1
        _log.warning("a fresh run in %s: moved the earlier metrics.jsonl to %s.prev-%d",
                       path.parent, path.name, n)  # fmt: skip
        return counts
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            counts["torn"] += 1
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) > resume_step:
            counts["past_checkpoint"] += 1
            continue
        kept.append(line)
    if counts["torn"] or counts["past_checkpoint"]:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
        _log.warning(
            "resuming at step %d: dropped %d line(s) of metrics.jsonl past that step and %d "
            "torn line(s); the resumed run logs those steps again",
            resume_step, counts["past_checkpoint"], counts["torn"],
        )  # fmt: skip
    return counts


class Logger:
    """Writes metrics to metrics.jsonl and to the enabled backends. See the module docstring."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        tensorboard_enabled: bool = True,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        wandb_enabled: bool = False,
        wandb_project: str = "tempering",
        wandb_name: str | None = None,
        mlflow_enabled: bool = False,
        mlflow_experiment: str = "tempering",
        mlflow_tracking_uri: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config = redact_secrets(_to_plain_config(config))
        self.dropped_metric_counts: dict[str, int] = {}  # non-scalars, by name
        self.nonfinite_metric_counts: dict[str, int] = {}  # NaN / Inf, by name
        self._closed = False

        config_text = yaml.safe_dump(self.config, sort_keys=False)
        atomic_write_text(self.log_dir / "config.yaml", config_text)
        self.metrics_path = self.log_dir / "metrics.jsonl"
        prepare_metrics_file(self.metrics_path, resume_step)
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115

        self._tb = None
        self._wandb_run = None
        self._mlflow: tuple[Any, str] | None = None  # (MlflowClient, run_id)
        try:
            if tensorboard_enabled:
                tb_dir = Path(tensorboard_dir) if tensorboard_dir else self.log_dir / "tensorboard"
                self._tb = _start_tensorboard(tb_dir, config_text)
            if wandb_enabled:
                self._wandb_run = _start_wandb(self.log_dir, wandb_project, wandb_name, self.config)
            if mlflow_enabled:
                uri = mlflow_tracking_uri or f"file:{(self.log_dir / 'mlruns').resolve()}"
                self._mlflow = _start_mlflow(uri, mlflow_experiment, wandb_name, self.config)
        except BaseException:
            self.close()
            raise

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run id when MLflow is enabled (read runs back with ``MlflowClient``)."""
        return self._mlflow[1] if self._mlflow is not None else None

    # ----------------------------------------------------------------- logging
    def log_metrics(
        self, metrics: Mapping[str, Any], step: int, prefix: str = ""
    ) -> dict[str, float | int]:
        """Log scalar ``metrics`` at ``step`` as ``<prefix>/<key>``; returns what was logged.

        A NaN or Inf is written to metrics.jsonl as ``null`` beside ``nonfinite/<name>`` (how
        many so far; every backend gets the count); a non-scalar is dropped. Both warn on the
        first and every 100th time and are counted.
        """
        if self._closed:
            raise RuntimeError(
                f"Logger for {self.log_dir} is closed; create a new Logger to log more"
            )
        clean: dict[str, float | int] = {}
        nulls: dict[str, None] = {}
        for key, value in metrics.items():
            name = f"{prefix}/{key}" if prefix else str(key)
            scalar = _as_finite_scalar(value)
            if scalar is not None:
                clean[name] = scalar
                continue
            nonfinite = _is_real_scalar(value)
            counts = self.nonfinite_metric_counts if nonfinite else self.dropped_metric_counts
            count = counts[name] = counts.get(name, 0) + 1
            if nonfinite:  # NaN/Inf: written as null, and how often so far as nonfinite/<name>
                nulls[name] = None
                clean[f"nonfinite/{name}"] = count
            if count == 1 or count % 100 == 0:  # first time, then every 100th: no spam
                _log.warning(
                    "Logger: %s metric %s=%r at step %d (%d so far, see Logger.%s)",
                    "non-finite" if nonfinite else "dropped (not a scalar)",
                    name,
                    value
                    if not hasattr(value, "shape") or not getattr(value, "ndim", 0)
                    else f"<{type(value).__name__} {tuple(value.shape)}>",
                    step,
                    count,
                    "nonfinite_metric_counts" if nonfinite else "dropped_metric_counts",
                )
        self._jsonl.write(json.dumps({"step": int(step), **nulls, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in clean.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(clean, step=step)
        if self._mlflow is not None:
            from mlflow.entities import Metric

            client, run_id = self._mlflow
            now = int(time.time() * 1000)
            client.log_batch(
                run_id, metrics=[Metric(k, float(v), now, int(step)) for k, v in clean.items()]
            )
        return clean

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_jsonl", None) is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._mlflow is not None:
            client, run_id = self._mlflow
            client.set_terminated(run_id)

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- backends
class LoggerBackendError(RuntimeError, UserInputError):
    """A logging backend the config turned on cannot start; the message names the key and
    the fix (a login, an install, a URI)."""


def _start_tensorboard(path: Path, config_text: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(path))
    except Exception as e:
        raise LoggerBackendError(
            f"logger.tensorboard_enabled=true but TensorBoard could not start ({type(e).__name__}: "
            f"{e}); install `tensorboard` (uv sync) or set logger.tensorboard_enabled=false"
        ) from e
    writer.add_text("config", "```\n" + config_text + "\n```", global_step=0)
    _log.info("TensorBoard events go to %s", path)
    return writer


def _start_wandb(log_dir: Path, project: str, name: str | None, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except Exception as e:
        raise LoggerBackendError(
            f"logger.wandb_enabled=true but `wandb` cannot be imported ({type(e).__name__}: {e}); "
            f"install it (uv sync) or set logger.wandb_enabled=false"
        ) from e
    try:
        return wandb.init(
            project=project,
            name=name,
            dir=str(log_dir),  # wandb writes its files under <dir>/wandb
            config=config,  # already redacted
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
    except Exception as e:
        raise LoggerBackendError(
            f"logger.wandb_enabled=true but W&B could not start ({type(e).__name__}: {e}); run "
            f"`wandb login`, or set WANDB_MODE=offline to log locally, or set "
            f"logger.wandb_enabled=false"
        ) from e


def _start_mlflow(
    uri: str, experiment: str, run_name: str | None, config: dict[str, Any]
) -> tuple[Any, str]:
    try:
        from mlflow.tracking import MlflowClient
    except Exception as e:
        raise LoggerBackendError(
            f"logger.mlflow_enabled=true but `mlflow` cannot be imported ({type(e).__name__}: {e}); "
            f"install mlflow-skinny (uv sync) or set logger.mlflow_enabled=false"
        ) from e
    if uri.startswith("file:") or "://" not in uri:
        # MLflow 3.x refuses its file store unless this documented opt-out is set; our default
        # is a local file store because mlflow-skinny has no SQLAlchemy for sqlite:// stores.
        # A user who set it to false explicitly keeps that choice (and gets the error below).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        run = client.create_run(exp_id, run_name=run_name)
        client.log_dict(run.info.run_id, config, "config.yaml")
    except Exception as e:
        raise LoggerBackendError(
            f"logger.mlflow_enabled=true but MLflow could not start at tracking URI {uri!r} "
            f"({type(e).__name__}: {e}); check the URI/server or set logger.mlflow_enabled=false"
        ) from e
    return client, run.info.run_id


# ------------------------------------------------------------- console output
SUMMARY_KEYS = (
    "train/loss",
    "train/reward_mean",
    "train/accuracy",
    "val/loss",
    "val/accuracy",
    "train/grad_norm",
    "throughput/tokens_per_s",
    "timing/step_s",
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_step_summary(
    step: int, max_steps: int, metrics: Mapping[str, Any], max_items: int = 6
) -> str:
    """One compact line: ``step 3/100 | train/loss 0.7 | ... | eta 1m58s``.

    Shows the well-known keys in ``SUMMARY_KEYS`` that are present (else the first few keys);
    the ETA is ``(max_steps - step) * timing/step_s`` when that key is present.
    """
    shown = [k for k in SUMMARY_KEYS if k in metrics][:max_items]
    if not shown:
        shown = list(metrics)[:max_items]
    parts = [f"step {step}/{max_steps}"] + [f"{k} {_fmt(metrics[k])}" for k in shown]
    step_s = _as_finite_scalar(metrics.get("timing/step_s"))
    if step_s is not None and max_steps > step:
        eta = int(round((max_steps - step) * step_s))
        parts.append(
            f"eta {eta // 3600}h{eta % 3600 // 60:02d}m"
            if eta >= 3600
            else f"eta {eta // 60}m{eta % 60:02d}s"
        )
    return " | ".join(parts)


def print_step_summary(step: int, max_steps: int, metrics: Mapping[str, Any]) -> str:
    """Print ``format_step_summary(...)`` (plain text; one line per step, CI-friendly); returns it."""
    line = format_step_summary(step, max_steps, metrics)
    print(line, flush=True)
    return line


class ProgressTracker(Generic[T]):
    """Iterable and context manager around a rich progress bar; build it with ``track``."""

    def __init__(
        self, iterable: Iterable[T], total: int | None, description: str, enabled: bool
    ) -> None:
        self._iterable = iterable
        self.total = total if total is not None else _len_or_none(iterable)
        self.description = description
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressTracker:
        if self.enabled and self._progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __iter__(self) -> Iterator[T]:
        if not self.enabled:
            yield from self._iterable
            return
        owns_bar = self._progress is None
        self.__enter__()
        try:
            for item in self._iterable:
                yield item
                self._progress.advance(self._task)
        finally:
            if owns_bar:
                self.__exit__()


def _len_or_none(obj: object) -> int | None:
    try:
        return len(obj)  # type: ignore[arg-type]
    except TypeError:
        return None


def track(
    iterable: Iterable[T],
    total: int | None = None,
    description: str = "working",
    *,
    enabled: bool | None = None,
) -> ProgressTracker[T]:
    """Progress bar (count, elapsed, ETA) over ``iterable``, shown only when stdout is a TTY.

    Use as ``for x in track(loader, len(loader), "val"):`` or, to be sure the bar is closed
    on ``break``, ``with track(...) as t: for x in t: ...``. Silent when stdout is not a TTY
    (CI logs) unless ``enabled=True``.
    """
    if enabled is None:
        enabled = sys.stdout.isatty()
    return ProgressTracker(iterable, total, description, enabled)
