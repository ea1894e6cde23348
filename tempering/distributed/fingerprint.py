"""Container version check: does the code match the environment baked into the image?

At image build, ``tools/record_fingerprint.py`` records md5(pyproject.toml), md5(uv.lock) and
the commit of every git submodule into a JSON file. At start-up, the example scripts call
:func:`check_container_fingerprint`; inside a container (``NRL_CONTAINER=1``) it compares the
recorded fingerprint with the code's, and on a mismatch prints a per-key diff with three
remedies and exits with an error, unless ``NRL_FORCE_REBUILD_VENVS=true`` (the worker venvs are
then rebuilt from the code's lock as workers start) or ``NRL_IGNORE_VERSION_MISMATCH=1``.

Environment variables: ``NRL_CONTAINER``, ``NRL_IGNORE_VERSION_MISMATCH``,
``TEMPERING_FINGERPRINT_PATH`` (default ``/opt/tempering/fingerprint.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

FINGERPRINT_PATH_ENV = "TEMPERING_FINGERPRINT_PATH"
DEFAULT_FINGERPRINT_PATH = "/opt/tempering/fingerprint.json"
CONTAINER_ENV = "NRL_CONTAINER"
IGNORE_ENV = "NRL_IGNORE_VERSION_MISMATCH"
FORCE_REBUILD_ENV = "NRL_FORCE_REBUILD_VENVS"
REPO_ROOT = Path(__file__).resolve().parents[2]


def truthy_env(environ: Mapping[str, str], name: str) -> bool:
    """``name`` set to true/1/yes (any case)."""
    return environ.get(name, "").strip().lower() in ("1", "true", "yes")


REMEDIES = (
    "  (1) rebuild the container to match your code;\n"
    "  (2) set NRL_FORCE_REBUILD_VENVS=true to rebuild the worker venvs from your code's lock;\n"
    "  (3) set NRL_IGNORE_VERSION_MISMATCH=1 to bypass this check (not recommended)."
)


def fingerprint_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where the image's fingerprint lives (``$TEMPERING_FINGERPRINT_PATH`` or the default)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(FINGERPRINT_PATH_ENV) or DEFAULT_FINGERPRINT_PATH)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def submodule_commits(repo_root: Path) -> dict[str, str]:
    """``{"submodule:<path>": <commit>}`` from ``git submodule status`` (empty without git)."""
    try:
        proc = subprocess.run(
            ["git", "submodule", "status", "--recursive"],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if proc.returncode != 0:
        return {}
    return parse_submodule_status(proc.stdout)


def parse_submodule_status(text: str) -> dict[str, str]:
    """Parse ``git submodule status`` lines: ``[ +-U]<sha> <path> [(<describe>)]``."""
    commits = {}
    for line in text.splitlines():
        parts = line[1:].split() if line[:1] in " +-U" else line.split()
        if len(parts) >= 2:
            commits[f"submodule:{parts[1]}"] = parts[0]
    return commits


def compute_fingerprint(repo_root: Path = REPO_ROOT) -> dict[str, str]:
    """The code's fingerprint: md5 of pyproject.toml and uv.lock, plus submodule commits."""
    return {
        "pyproject.toml": _md5(repo_root / "pyproject.toml"),
        "uv.lock": _md5(repo_root / "uv.lock"),
        **submodule_commits(repo_root),
    }


def write_fingerprint(path: Path, repo_root: Path = REPO_ROOT) -> dict[str, str]:
    """Record the fingerprint of ``repo_root`` at ``path`` (JSON); return it."""
    fingerprint = compute_fingerprint(repo_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
    return fingerprint


def diff_fingerprints(
    container: Mapping[str, str], current: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """Keys whose values differ: ``{key: (container value, current value)}``; absent = ``"<none>"``."""
    keys = sorted(set(container) | set(current))
    return {
        k: (container.get(k, "<none>"), current.get(k, "<none>"))
        for k in keys
        if container.get(k) != current.get(k)
    }


def format_mismatch(diff: Mapping[str, tuple[str, str]], path: Path) -> str:
    """The warning banner: one Container/Current pair per differing key, then the remedies."""
    bar = "!" * 78
    lines = [
        bar,
        f"WARNING: the code does not match the container it runs in (fingerprint {path}).",
    ]
    for key, (was, now) in diff.items():
        lines.append(f"  {key}:\n    Container: {was}\n    Current:   {now}")
    lines += ["Remedies:", REMEDIES, bar]
    return "\n".join(lines)


def check_container_fingerprint(
    repo_root: Path = REPO_ROOT,
    *,
    environ: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
) -> dict[str, tuple[str, str]]:
    """Start-up check; returns the differences found (empty when none or not in a container).

    Does nothing unless ``NRL_CONTAINER=1``. On a mismatch prints the banner to ``stream``
    (stderr) and raises ``SystemExit(1)`` unless ``NRL_FORCE_REBUILD_VENVS=true`` or
    ``NRL_IGNORE_VERSION_MISMATCH=1``.
    """
    environ = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    if environ.get(CONTAINER_ENV) != "1":
        return {}
    ignore = environ.get(IGNORE_ENV) == "1"
    path = fingerprint_path(environ)
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(
            f"{CONTAINER_ENV}=1 but the container fingerprint {path} cannot be read ({exc}). "
            f"Run tools/record_fingerprint.py when building the image, set "
            f"{FINGERPRINT_PATH_ENV} to its output, or set {IGNORE_ENV}=1.",
            file=stream,
        )
        if ignore:
            return {}
        raise SystemExit(1) from None
    diff = diff_fingerprints(recorded, compute_fingerprint(repo_root))
    if diff:
        print(format_mismatch(diff, path), file=stream)
        if truthy_env(environ, FORCE_REBUILD_ENV):
            print(
                f"{FORCE_REBUILD_ENV}=true: continuing; each worker venv is rebuilt from the "
                "code's lock as its workers start (the image's frozen launchers are bypassed).",
                file=stream,
            )
        elif ignore:
            print(f"{IGNORE_ENV}=1: continuing despite the mismatch.", file=stream)
        else:
            raise SystemExit(1)
    return diff
