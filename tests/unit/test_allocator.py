"""The policy workers' allocator (`tempering/utils/allocator.py`): mimalloc is preloaded from
the installed wheel, a user's own LD_PRELOAD is kept, and the worker says what it runs on.
(That Ray workers really run on it: test_lm_policy.py's group.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tempering.utils.allocator import allocator_env, loaded_allocator, mimalloc_library


def test_mimalloc_is_preloaded_into_a_new_process_and_detected() -> None:
    env = allocator_env("mimalloc")
    assert env["LD_PRELOAD"] == str(mimalloc_library()) and mimalloc_library().is_file()
    code = "from tempering.utils.allocator import loaded_allocator; print(loaded_allocator())"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": ""}, text=True,
                         capture_output=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "mimalloc"
    assert loaded_allocator() == "system"  # this test process: glibc


def test_system_and_a_users_preload_are_respected(monkeypatch, caplog) -> None:
    assert "LD_PRELOAD" not in allocator_env("system")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so.2")
    assert "LD_PRELOAD" not in allocator_env("mimalloc")
    assert "LD_PRELOAD=/opt/libjemalloc.so.2 is already set" in caplog.text
    with pytest.raises(ValueError, match="use one of"):
        allocator_env("tcmalloc")
