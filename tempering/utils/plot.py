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
    fig.tight_layout()
    out_path = Path(out) if out is not None else log_dir / "metrics.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
