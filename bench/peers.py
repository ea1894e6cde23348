"""The peers' environment for benchmarks: TRL and its needs live in `venvs/bench` (the `bench`
dependency group, synced from the lock on first use), never in tempering's own `.venv`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_VENV = REPO / "venvs" / "bench"


def ensure_bench_venv() -> Path:
    """The bench venv's python, building the venv from `uv.lock` if it is missing."""
    python = BENCH_VENV / "bin" / "python"
    if not python.exists():
        env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(BENCH_VENV)}
        subprocess.run(
            ["uv", "sync", "--locked", "--group", "bench", "--no-dev"],
            cwd=REPO,
            env=env,
            check=True,
        )
    return python
