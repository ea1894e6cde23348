"""Metric curves from a run's ``metrics.jsonl`` (see tempering.utils.logger).

    tempering plot LOG_DIR [--out FILE.png] [--keys train/loss,val/accuracy]

One subplot per metric; metrics are grouped by namespace (``train/``, ``val/``, ``timing/``,
...) and each namespace starts a new row, so related curves sit side by side.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Series = dict[str, tuple[list[int], list[float]]]


def read_metrics(path: str | os.PathLike[str]) -> Series:
    """``{key: (steps, values)}`` from a metrics.jsonl file, in file order.

    Lines that are not valid JSON objects (e.g. a last line cut short by a crash) are skipped
    with one message on stderr naming their line numbers.
    """
    path = Path(path)
    series: Series = {}
    bad: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if not isinstance(record, dict) or "step" not in record:
                bad.append(lineno)
                continue
            step = int(record["step"])
            for key, value in record.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))
    if bad:
        print(
            f"tempering plot: skipped {len(bad)} malformed line(s) in {path}: {bad[:10]}",
            file=sys.stderr,
        )
    return series


_NAMESPACE_ORDER = {"train": 0, "val": 1}  # then the rest (timing, throughput, ...) by name


def _namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def plot_metrics(
    log_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    keys: Sequence[str] | None = None,
    ncols: int = 3,
) -> Path:
    """Draw the curves of ``keys`` (default: all) from ``<log_dir>/metrics.jsonl`` into a PNG.

    Returns the PNG path (default ``<log_dir>/metrics.png``).
    """
    log_dir = Path(log_dir)
    metrics_file = log_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(
            f"{metrics_file} does not exist; pass the run's logger.log_dir (the folder that "
            f"holds metrics.jsonl)"
        )
    series = read_metrics(metrics_file)
    if not series:
        raise ValueError(f"{metrics_file} holds no numeric metrics to plot")
    if keys:
        missing = [k for k in keys if k not in series]
        if missing:
            raise ValueError(
                f"--keys {','.join(missing)} not found in {metrics_file}; available: "
                f"{','.join(sorted(series))}"
            )
        chosen = list(keys)
    else:
        chosen = sorted(
            series, key=lambda k: (_NAMESPACE_ORDER.get(_namespace(k), 2), _namespace(k), k)
        )

    groups: dict[str, list[str]] = {}
    for key in chosen:
        groups.setdefault(_namespace(key), []).append(key)
    ncols = max(1, min(ncols, max(len(g) for g in groups.values())))
    rows = sum(math.ceil(len(g) / ncols) for g in groups.values())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(rows, ncols, figsize=(4.5 * ncols, 3.0 * rows), squeeze=False)
    row = 0
    for group in groups.values():
        for i, key in enumerate(group):
            ax = axes[row + i // ncols][i % ncols]
            steps, values = series[key]
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
            ax.set_title(key, fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        used = len(group)
        group_rows = math.ceil(used / ncols)
        for j in range(used, group_rows * ncols):
            axes[row + j // ncols][j % ncols].set_visible(False)
        row += group_rows
    fig.suptitle(str(log_dir), fontsize=9)
    return _save(fig, Path(out) if out is not None else log_dir / "metrics.png")


def _save(fig: Any, out_path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def read_timeline(path: str | os.PathLike[str]) -> list[dict]:
    """The phase records of ``timeline.jsonl`` (see `tempering.utils.timers.PhaseLog`); a torn
    or malformed line is skipped with one message on stderr naming its line number."""
    rows, bad = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                r = json.loads(line)
                rows.append({"role": str(r["role"]), "phase": str(r["phase"]),
                             "step": int(r["step"]), "start": float(r["start"]),
                             "end": float(r["end"])})  # fmt: skip
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    bad.append(lineno)
    if bad:
        print(f"tempering plot: skipped malformed line(s) {bad[:10]} of {path}", file=sys.stderr)
    return rows


def plot_timeline(
    log_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> Path:
    """A Gantt chart of ``<log_dir>/timeline.jsonl``: one row per role, one bar per phase,
    seconds since the first phase on the x axis, so generation beside training shows as
    bars that overlap in time. Returns the PNG path (default ``<log_dir>/timeline.png``)."""
    log_dir = Path(log_dir)
    path = log_dir / "timeline.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; a run writes it with grpo.async_grpo.enabled=true: pass "
            "that run's logger.log_dir"
        )
    rows = read_timeline(path)
    if not rows:
        raise ValueError(f"{path} holds no phases to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["start"] for r in rows)
    roles = sorted({r["role"] for r in rows})
    phases = sorted({r["phase"] for r in rows})
    colours = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(roles)))
    for y, role in enumerate(roles):
        for p in phases:
            bars = [(r["start"] - t0, r["end"] - r["start"]) for r in rows
                    if r["role"] == role and r["phase"] == p]  # fmt: skip
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colours[p])
    ax.set_yticks(range(len(roles)), roles)
    ax.set_xlabel("seconds since the first phase")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[p]) for p in phases]
    ax.legend(handles, phases, loc="upper right", fontsize=8, ncols=min(len(phases), 6))
    ax.set_title(f"{log_dir}: phases per role", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, Path(out) if out is not None else log_dir / "timeline.png")
