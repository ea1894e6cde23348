"""Build the worker venvs now and write frozen ``python-<fqn>`` launchers for them.

    uv run --no-sync python tools/freeze_worker_venvs.py --out /opt/tempering/bin [FQN[=EXE] ...]

For each worker class (default: every entry of ``ACTOR_ENVIRONMENT_REGISTRY`` whose executable
is a venv tempering builds: ``uv run ...`` or ``pip-venv <name>``) the venv is built under the
venvs root (``TEMPERING_VENVS_DIR``) and a launcher ``<out>/python-<fqn>`` is written that
execs that venv's python. The docker/Dockerfile release image runs this at build time and sets
``TEMPERING_FROZEN_ENVS_DIR=<out>``: workers then start from the launchers and nothing is
synced at run time (the version check in ``fingerprint.py`` tells you when the code has moved
past the frozen venvs; ``NRL_FORCE_REBUILD_VENVS=true`` rebuilds the venvs behind them).

Launchers carry the whole class name, so two worker classes with the same class name in
different modules cannot collide. ``python-<fqn> -m pip install X`` works (through ``uv pip``
when the venv has no pip) but warns: such a change is local to this container or node.
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
from pathlib import Path

from tempering.distributed.actor_environments import (
    ACTOR_ENVIRONMENT_REGISTRY,
    build_worker_venv,
    builds_venv,
    launcher_name,
    worker_spec,
)

LOCAL_ONLY_WARNING = (
    "changing a frozen worker venv is local-only: other nodes, a restarted container and the "
    "next image do not see it, and NRL_FORCE_REBUILD_VENVS=true discards it. Put lasting "
    "dependencies in pyproject.toml (and uv.lock), then rebuild the image or the venvs."
)

_LAUNCHER = """#!/bin/sh
# Frozen launcher of worker class {fqn} (tools/freeze_worker_venvs.py).
PY={python}
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo {warning} >&2
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    shift 2
    exec uv pip "$@" --python "$PY"
  fi
fi
exec "$PY" "$@"
"""


def write_launcher(out_dir: Path, fqn: str, python: str) -> Path:
    """Write ``out_dir/python-<fqn>`` that execs ``python``; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = out_dir / launcher_name(fqn)
    warning = shlex.quote(f"{launcher.name}: WARNING: {LOCAL_ONLY_WARNING}")
    launcher.write_text(_LAUNCHER.format(fqn=fqn, python=shlex.quote(python), warning=warning))
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the launchers")
    parser.add_argument(
        "fqns",
        nargs="*",
        metavar="FQN[=EXECUTABLE]",
        help="worker classes (default: all registered with a venv); FQN=EXECUTABLE names a "
        "class this process has not registered (a plugin's, or the tests' isolation probe)",
    )
    args = parser.parse_args(argv)
    specs = args.fqns or [f for f, exe in ACTOR_ENVIRONMENT_REGISTRY.items() if builds_venv(exe)]
    for spec in specs:
        try:
            fqn, executable = worker_spec(spec)
        except KeyError:  # not registered: refused below
            fqn, executable = spec, None
        if executable is None or not builds_venv(executable):
            parser.error(
                f"{fqn!r} is not a registered worker class with a venv to build ('uv run ...' "
                "or 'pip-venv <name>'); see tempering/distributed/actor_environments.py"
            )
        python = build_worker_venv(fqn, executable)
        print(f"{write_launcher(args.out, fqn, python)} -> {python}", flush=True)
    print(f"export TEMPERING_FROZEN_ENVS_DIR={os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
