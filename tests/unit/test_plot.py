"""`tempering plot`: runs the real CLI on a metrics.jsonl and inspects the PNG it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tempering.cli import main
from tempering.utils.plot import plot_metrics, read_metrics


def _write_metrics(log_dir: Path, steps: int = 20) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(
                json.dumps({"step": s, "train/loss": 2.0 / s, "train/reward_mean": s / steps})
                + "\n"
            )
            f.write(json.dumps({"step": s, "timing/step_s": 1.0 + 0.01 * s}) + "\n")
            if s % 5 == 0:
                f.write(json.dumps({"step": s, "val/accuracy": s / (2 * steps)}) + "\n")
        f.write('{"step": 21, "train/lo')  # last line cut short by a crash


def _read_png(path: Path) -> np.ndarray:
    import matplotlib.image as mpimg

    return mpimg.imread(path)  # float RGBA in [0, 1]


def test_read_metrics_skips_truncated_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_metrics(tmp_path)
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert set(series) == {"train/loss", "train/reward_mean", "timing/step_s", "val/accuracy"}
    assert series["val/accuracy"] == ([5, 10, 15, 20], [0.125, 0.25, 0.375, 0.5])
    assert series["train/loss"][1][:2] == [2.0, 1.0]
    assert "skipped 1 malformed line" in capsys.readouterr().err


def test_cli_plot_writes_png(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "plot", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    png = tmp_path / "run" / "metrics.png"
    assert f"wrote {png}" in result.stdout
    img = _read_png(png)
    # 3 namespaces -> 3 rows; train has 2 metrics -> 2 columns of 4.5 x 3.0 inches at 100 dpi.
    assert img.shape[:2] == (900, 900)
    non_white = (img[..., :3] < 0.95).any(axis=-1)
    assert non_white.mean() > 0.01  # axes, text and curves were drawn


def test_plot_keys_and_out(tmp_path: Path) -> None:
    _write_metrics(tmp_path)
    out = tmp_path / "pics" / "loss.png"
    assert (
        main(["plot", str(tmp_path), "--out", str(out), "--keys", "train/loss,val/accuracy"]) == 0
    )
    img = _read_png(out)
    assert img.shape[:2] == (600, 450)  # two namespaces -> two rows, one column
    assert (img[..., :3] < 0.95).any(axis=-1).mean() > 0.01
    # Same call via the function gives the same layout.
    assert plot_metrics(tmp_path, out=tmp_path / "b.png", keys=["train/loss"]).is_file()


def test_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    _write_metrics(tmp_path)
    assert main(["plot", str(tmp_path), "--keys", "train/nope"]) == 2
    err = capsys.readouterr().err
    assert "--keys train/nope not found" in err and "train/loss" in err
    assert not (tmp_path / "metrics.png").exists()


def test_timeline_draws_each_role_and_names_a_missing_file(tmp_path, capsys):
    from tempering.utils.plot import plot_timeline, read_timeline

    with pytest.raises(FileNotFoundError, match="async_grpo.enabled"):
        plot_timeline(tmp_path)
    rows = [
        {"role": "collector", "phase": "generation", "step": 1, "start": 0.0, "end": 1.0},
        {"role": "trainer", "phase": "train", "step": 1, "start": 0.5, "end": 1.5},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"role": "trainer", "pha'
    (tmp_path / "timeline.jsonl").write_text(text)
    assert [r["role"] for r in read_timeline(tmp_path / "timeline.jsonl")] == [
        "collector",
        "trainer",
    ]
    assert "skipped malformed line(s) [3]" in capsys.readouterr().err
    out = plot_timeline(tmp_path)
    assert out == tmp_path / "timeline.png" and out.read_bytes()[:4] == b"\x89PNG"
