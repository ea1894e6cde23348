"""The `tempering` command itself (each subcommand has its own test file)."""

from __future__ import annotations

import pytest

from tempering.cli import main


def test_version_names_tempering_and_the_stack_it_runs_on(capsys):
    import torch

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("tempering 0.1.0 (python 3.")
    assert f"torch {torch.__version__}," in out and "ray " in out and out.count("\n") == 1
