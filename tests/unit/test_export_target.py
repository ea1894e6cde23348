"""`tempering export` never replaces a checkpoint folder, nor anything but a previous export
without --overwrite (issue 27: `tempering export results/run/step_600 results/run` had deleted
every checkpoint of the run). The refusals come before the checkpoint is read, so a step
folder with the three files a complete checkpoint has is enough here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tempering.cli import main


def _run_with_a_step(root: Path) -> Path:
    step = root / "run" / "step_600"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / ".metadata").write_text("")
    (step / "training_info.json").write_text('{"step": 600}')
    (step / "config.yaml").write_text("policy: {model_name: tiny-arith}\n")
    return step


@pytest.mark.parametrize("target", ["run", "run/step_600", "other_run"])
def test_export_refuses_checkpoint_folders(tmp_path, capsys, target):
    step = _run_with_a_step(tmp_path)
    other = _run_with_a_step(tmp_path / "x").parent
    (tmp_path / "other_run").symlink_to(other)  # another run's checkpoint folder
    out = tmp_path / target
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(step), str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert str(out) in err and "export to another folder" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_export_refuses_a_folder_that_is_not_a_previous_export(tmp_path, capsys):
    step = _run_with_a_step(tmp_path)
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    assert main(["export", str(step), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "todo.txt").read_text() == "keep me"
