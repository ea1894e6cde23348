"""Container version check: match, mismatch (per-key diff, three remedies, non-zero exit),
the force-rebuild and bypass variables, the not-in-a-container no-op, and the build-time recording tool."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tempering.distributed.fingerprint import (
    check_container_fingerprint,
    compute_fingerprint,
    parse_submodule_status,
    write_fingerprint,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    (tmp_path / "uv.lock").write_text("version = 1\n")
    return tmp_path


def _env(fingerprint: Path, **extra: str) -> dict[str, str]:
    return {"NRL_CONTAINER": "1", "TEMPERING_FINGERPRINT_PATH": str(fingerprint), **extra}


def test_match_passes_quietly(repo, tmp_path):
    path = tmp_path / "image" / "fingerprint.json"
    write_fingerprint(path, repo)
    stream = io.StringIO()
    assert check_container_fingerprint(repo, environ=_env(path), stream=stream) == {}
    assert stream.getvalue() == ""


def test_mismatch_lists_keys_and_remedies_and_exits(repo, tmp_path):
    path = tmp_path / "fingerprint.json"
    recorded = write_fingerprint(path, repo)
    (repo / "uv.lock").write_text("version = 2\n")
    current = compute_fingerprint(repo)
    stream = io.StringIO()
    with pytest.raises(SystemExit) as info:
        check_container_fingerprint(repo, environ=_env(path), stream=stream)
    assert info.value.code not in (0, None)
    text = stream.getvalue()
    assert "uv.lock:" in text and "pyproject.toml:" not in text
    assert f"Container: {recorded['uv.lock']}" in text
    assert f"Current:   {current['uv.lock']}" in text
    assert "(1) rebuild the container" in text
    assert "(2) set NRL_FORCE_REBUILD_VENVS=true" in text
    assert "(3) set NRL_IGNORE_VERSION_MISMATCH=1" in text


def test_bypass_warns_and_continues(repo, tmp_path):
    path = tmp_path / "fingerprint.json"
    write_fingerprint(path, repo)
    (repo / "pyproject.toml").write_text('[project]\nname = "y"\n')
    stream = io.StringIO()
    diff = check_container_fingerprint(
        repo, environ=_env(path, NRL_IGNORE_VERSION_MISMATCH="1"), stream=stream
    )
    assert list(diff) == ["pyproject.toml"]
    assert "pyproject.toml:" in stream.getvalue() and "continuing" in stream.getvalue()


def test_force_rebuild_continues_and_says_workers_rebuild(repo, tmp_path):
    path = tmp_path / "fingerprint.json"
    write_fingerprint(path, repo)
    (repo / "uv.lock").write_text("version = 3\n")
    stream = io.StringIO()
    diff = check_container_fingerprint(
        repo, environ=_env(path, NRL_FORCE_REBUILD_VENVS="true"), stream=stream
    )
    assert list(diff) == ["uv.lock"]
    text = stream.getvalue()
    assert "uv.lock:" in text and "NRL_FORCE_REBUILD_VENVS=true: continuing" in text


def test_outside_a_container_nothing_is_checked(repo, tmp_path):
    env = {"TEMPERING_FINGERPRINT_PATH": str(tmp_path / "missing.json")}
    assert check_container_fingerprint(repo, environ=env, stream=io.StringIO()) == {}


def test_missing_fingerprint_in_a_container_is_an_error(repo, tmp_path):
    stream = io.StringIO()
    with pytest.raises(SystemExit):
        check_container_fingerprint(repo, environ=_env(tmp_path / "nope.json"), stream=stream)
    assert "tools/record_fingerprint.py" in stream.getvalue()


def test_submodule_commits_are_compared():
    status = (
        " 1111111111111111111111111111111111111111 3rdparty/Megatron (v1.0)\n"
        "+2222222222222222222222222222222222222222 3rdparty/Gym (heads/main)\n"
        "-3333333333333333333333333333333333333333 3rdparty/Unused\n"
    )
    assert parse_submodule_status(status) == {
        "submodule:3rdparty/Megatron": "1" * 40,
        "submodule:3rdparty/Gym": "2" * 40,
        "submodule:3rdparty/Unused": "3" * 40,
    }


def test_record_tool_writes_this_repos_fingerprint(tmp_path):
    out = tmp_path / "fp.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "record_fingerprint.py"), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NRL_CONTAINER": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == compute_fingerprint(REPO)
    # ... and the start-up check accepts it.
    assert check_container_fingerprint(REPO, environ=_env(out), stream=io.StringIO()) == {}
