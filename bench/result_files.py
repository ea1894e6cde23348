"""Result files: what a benchmark measured, where and when, as JSON the docs site renders.

A benchmark that compares against a peer calls `record(...)` once per workload it measured;
the row lands in ``bench/results/<benchmark>.json`` (replacing the row of the same workload,
written atomically) with the date, the machine and the commit it ran on. The site's
Benchmarks page is built from these files (tools/mkdocs_hooks.py), so the figures a user
reads are the ones a run wrote; how a figure moved over time goes to CHANGELOG.md.

A file's ``rows`` each hold: ``workload``, ``metric`` (what was timed, e.g. ``s/step``),
``ours`` / ``peer`` (medians), ``ratio`` with ``ratio_min`` / ``ratio_max`` (the spread over
``runs`` interleaved runs; > 1 means tempering is faster), ``date``, ``machine``, ``commit``,
and ``source`` (``measured``, or where a figure measured before these files came from).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    """``<cores>-core <CPU model>`` from /proc/cpuinfo (the platform's name elsewhere)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}"


def commit() -> str:
    """The checkout's short commit, with ``+dirty`` when it has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(
    benchmark: str,
    title: str,
    workload: str,
    metric: str,
    ours: list[float],
    peer: list[float],
    peer_name: str,
    *,
    higher_is_better: bool = False,
) -> Path:
    """Write one workload's comparison: per-run figures of both sides, interleaved runs."""
    ratios = [(o / p) if higher_is_better else (p / o) for o, p in zip(ours, peer, strict=True)]
    row = {
        "workload": workload, "metric": metric, "peer_name": peer_name,
        "ours": statistics.median(ours), "peer": statistics.median(peer),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "runs": len(ratios), "date": date.today().isoformat(), "machine": machine(),
        "commit": commit(), "source": "measured",
    }  # fmt: skip
    path = RESULTS / f"{benchmark}.json"
    data = json.loads(path.read_text()) if path.exists() else {"title": title, "rows": []}
    data["title"] = title
    data["rows"] = [r for r in data["rows"] if r["workload"] != workload] + [row]
    RESULTS.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=RESULTS, suffix=".tmp", delete=False) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(f.name, path)
    print(f"result recorded in {path.relative_to(Path(__file__).parents[1])}")
    return path
