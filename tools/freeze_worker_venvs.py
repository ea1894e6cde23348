"""Build the worker venvs now and write frozen ``python-<WorkerClass>`` launchers for them.

    uv run --frozen python tools/freeze_worker_venvs.py --out /opt/tempering/bin [FQN ...]

For each worker class (default: every ``uv run`` entry of ``ACTOR_ENVIRONMENT_REGISTRY``) the
venv is built under the venvs root (``TEMPERING_VENVS_DIR``) and a launcher
``<out>/python-<WorkerClass>`` is written that execs that venv's python. Use it in a container
image: build once, then set ``TEMPERING_FROZEN_ENVS_DIR=<out>`` so workers start from the
launchers and nothing is synced at run time (the version check in ``fingerprint.py`` tells
you when the code has moved past the frozen venvs).
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
from pathlib import Path

from tempering.distributed.actor_environments import (
    ACTOR_ENVIRONMENT_REGISTRY,
    create_local_venv,
    is_uv_executable,
)


def write_launcher(out_dir: Path, fqn: str, python: str) -> Path:
    """Write ``out_dir/python-<WorkerClass>`` that execs ``python``; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = out_dir / f"python-{fqn.rsplit('.', 1)[-1]}"
    launcher.write_text(f'#!/bin/sh\n# worker venv of {fqn}\nexec {shlex.quote(python)} "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the launchers")
    parser.add_argument("fqns", nargs="*", help="worker classes (default: all uv-based ones)")
    args = parser.parse_args(argv)
    fqns = args.fqns or [
        f for f, exe in ACTOR_ENVIRONMENT_REGISTRY.items() if is_uv_executable(exe)
    ]
    for fqn in fqns:
        executable = ACTOR_ENVIRONMENT_REGISTRY.get(fqn)
        if executable is None or not is_uv_executable(executable):
            parser.error(f"{fqn!r} is not a registered worker class with a 'uv run' executable")
        python = create_local_venv(executable, fqn)
        print(f"{write_launcher(args.out, fqn, python)} -> {python}")
    print(f"export TEMPERING_FROZEN_ENVS_DIR={os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
