"""Logger: metrics.jsonl, config.yaml, TensorBoard/W&B/MLflow read back; console helpers; atomic writes.

The atomic-write helpers (tempering/utils/atomic.py) are tested here too: the logger's
config.yaml is their first user.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import yaml

from tempering.utils.atomic import TMP_MARKER, atomic_directory, atomic_write_text
from tempering.utils.logger import (
    REDACTED,
    Logger,
    format_step_summary,
    is_secret_key,
    print_step_summary,
    track,
)

CONFIG = {
    "policy": {"model_name": "tiny", "tokenizer": {"pad_token": "<pad>"}, "max_new_tokens": 8},
    "logger": {"wandb": {"api_key": "sk-123", "name": "x"}, "hf_token": "hf_abc"},
    "env": {"db_password": "hunter2", "client_secret": "s3", "token": "t0k"},
}


def _run(logger: Logger, steps: int = 3) -> None:
    for step in range(1, steps + 1):
        logger.log_metrics(
            {"loss": 1.0 / step, "reward_mean": torch.tensor(0.1 * step)}, step, prefix="train"
        )
    logger.log_metrics({"accuracy": 0.75}, steps, prefix="val")


def test_jsonl_config_and_tensorboard_readback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Logger(tmp_path / "run", config=CONFIG) as logger:
        _run(logger)
        with caplog.at_level(logging.WARNING):
            logged = logger.log_metrics(
                {"ok": 2, "nan": float("nan"), "inf": float("inf"), "vec": torch.ones(3), "s": "x"},
                step=4,
                prefix="train",
            )
            logger.log_metrics({"nan": float("nan")}, step=5, prefix="train")
        assert logged == {"train/ok": 2, "nonfinite/train/nan": 1, "nonfinite/train/inf": 1}
        # NaN / Inf are written (null) and counted; what is not a scalar is dropped, counted
        assert logger.nonfinite_metric_counts == {"train/nan": 2, "train/inf": 1}
        assert logger.dropped_metric_counts == {"train/vec": 1, "train/s": 1}
        assert "train/nan" in caplog.text and "train/vec" in caplog.text

    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "train/loss": 1.0, "train/reward_mean": pytest.approx(0.1)}
    assert lines[3] == {"step": 3, "val/accuracy": 0.75}
    assert lines[4] == {"step": 4, "train/nan": None, "train/inf": None, "train/ok": 2,
                        "nonfinite/train/nan": 1, "nonfinite/train/inf": 1}  # fmt: skip
    assert lines[5] == {"step": 5, "train/nan": None, "nonfinite/train/nan": 2}

    cfg = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert cfg["policy"] == CONFIG["policy"]  # tokenizer settings are not secrets
    assert cfg["logger"]["wandb"] == {"api_key": REDACTED, "name": "x"}
    assert cfg["logger"]["hf_token"] == REDACTED
    assert cfg["env"] == {"db_password": REDACTED, "client_secret": REDACTED, "token": REDACTED}
    assert "sk-123" not in (tmp_path / "run/config.yaml").read_text()

    acc = EventAccumulator(str(tmp_path / "run/tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/reward_mean", "val/accuracy", "train/ok"} <= set(
        acc.Tags()["scalars"]
    )
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert acc.Scalars("val/accuracy")[0].value == pytest.approx(0.75)

    with pytest.raises(RuntimeError, match="is closed"):
        logger.log_metrics({"x": 1}, 6)


def test_jsonl_appends_across_loggers(tmp_path: Path) -> None:
    """A resumed run appends to the same metrics.jsonl instead of truncating it."""
    with Logger(tmp_path, tensorboard_enabled=False) as a:
        a.log_metrics({"x": 1}, 1)
    with Logger(tmp_path, tensorboard_enabled=False, resume_step=1) as b:
        b.log_metrics({"x": 2}, 2)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert not (tmp_path / "tensorboard").exists()


def test_resume_drops_steps_past_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    with Logger(tmp_path, tensorboard_enabled=False) as a:
        for step in range(1, 6):
            a.log_metrics({"x": step}, step)
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:  # a writer killed mid-line
        f.write('{"step": 6, "x": ')
    with Logger(tmp_path, tensorboard_enabled=False, resume_step=3) as b:
        b.log_metrics({"x": 40}, 4)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 40)]


def test_fresh_run_moves_an_earlier_runs_metrics_aside(tmp_path: Path) -> None:
    with Logger(tmp_path, tensorboard_enabled=False) as a:
        a.log_metrics({"x": 1}, 1)
    with Logger(tmp_path, tensorboard_enabled=False) as b:
        b.log_metrics({"x": 9}, 1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["x"] == 9
    assert json.loads((tmp_path / "metrics.jsonl.prev-1").read_text())["x"] == 1


def test_is_secret_key() -> None:
    for k in ["api_key", "OPENAI_API_KEY", "apikey", "hf_token", "access_token", "token", "password", "secret", "aws_secret_access_key", "private_key"]:  # fmt: skip
        assert is_secret_key(k), k
    for k in ["pad_token", "eos_token", "max_tokens", "max_new_tokens", "tokenizer", "tokens_per_s", "key", "length_key", "model_name"]:  # fmt: skip
        assert not is_secret_key(k), k


def test_wandb_offline_writes_run_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb is in the lock: an offline run that cannot start is a broken integration, a
    # failure, never a skip.
    logger = Logger(
        tmp_path, tensorboard_enabled=False, wandb_enabled=True, wandb_name="t", config=CONFIG
    )
    _run(logger)
    logger.close()
    # run.finish() returns once the service has the records, not once its writer has closed
    # the run file (CI saw a header-only file on a loaded machine). teardown() waits for the
    # service to exit, which is what a controller's exit does through wandb's atexit hook.
    import wandb

    wandb.teardown()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").rglob("*"))
    # The run file is a protobuf record log: our metric names and the config are in it,
    # the secret is not.
    data = runs[0].read_bytes()
    assert b"train/loss" in data and b"val/accuracy" in data
    assert b"hf_abc" not in data and b"sk-123" not in data


def test_mlflow_file_store_readback(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    logger = Logger(
        tmp_path,
        tensorboard_enabled=False,
        mlflow_enabled=True,
        mlflow_experiment="exp",
        config=CONFIG,
    )
    _run(logger)
    run_id = logger.mlflow_run_id
    logger.close()
    assert (tmp_path / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 1.0),
        (2, 0.5),
        (3, pytest.approx(1 / 3)),
    ]
    assert client.get_metric_history(run_id, "val/accuracy")[0].value == 0.75
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_experiment_by_name("exp") is not None


def test_broken_backends_are_errors_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A missing wandb package is simulated by hiding the module (it is installed here).
    # LoggerBackendError is a UserInputError: the scripts print it as one line, exit 2.
    from tempering.utils.logger import LoggerBackendError

    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    with pytest.raises(LoggerBackendError, match=r"wandb.*logger\.wandb_enabled=false"):
        Logger(tmp_path / "a", tensorboard_enabled=False, wandb_enabled=True)
    with pytest.raises(
        LoggerBackendError,
        match=r"MLflow could not start at tracking URI 'bogus://nowhere'.*mlflow_enabled=false",
    ):
        Logger(
            tmp_path / "b",
            tensorboard_enabled=False,
            mlflow_enabled=True,
            mlflow_tracking_uri="bogus://nowhere",
        )


def test_step_summary_and_track(capsys: pytest.CaptureFixture[str]) -> None:
    line = format_step_summary(
        10,
        100,
        {"train/loss": 0.123456, "timing/step_s": 2.0, "misc/other": 5, "val/accuracy": 0.5},
    )
    assert (
        line == "step 10/100 | train/loss 0.1235 | val/accuracy 0.5 | timing/step_s 2 | eta 3m00s"
    )
    assert format_step_summary(1, 2, {"a": 1, "b": 2.5}) == "step 1/2 | a 1 | b 2.5"
    assert "eta 1h" in format_step_summary(0, 4000, {"timing/step_s": 1.0})
    printed = print_step_summary(1, 2, {"train/loss": 1.0})
    assert capsys.readouterr().out == printed + "\n"

    # stdout is captured (not a TTY): the bar is silent but every item comes through.
    assert list(track(range(5), description="quiet")) == list(range(5))
    assert capsys.readouterr().out == ""
    with track(iter(range(4)), total=4, description="loud", enabled=True) as t:
        assert list(t) == [0, 1, 2, 3]
    out = capsys.readouterr().out
    assert "loud" in out and "4/4" in out


def test_atomic_write_text(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["f.txt"]  # no temp files left


def test_atomic_directory_commit_failure_and_overwrite(tmp_path: Path) -> None:
    final = tmp_path / "step_1"
    with atomic_directory(final) as tmp:
        assert tmp.name == f"step_1{TMP_MARKER}{os.getpid()}"
        (tmp / "model.pt").write_text("weights")
        assert not final.exists()  # invisible until complete
    assert (final / "model.pt").read_text() == "weights" and not tmp.exists()

    failed = tmp_path / "step_2"
    with pytest.raises(ZeroDivisionError), atomic_directory(failed) as tmp2:
        (tmp2 / "partial").write_text("x")
        1 / 0  # noqa: B018
    assert not failed.exists() and not tmp2.exists()

    with pytest.raises(FileExistsError, match="overwrite=True"):
        with atomic_directory(final):
            pass
    with atomic_directory(final, overwrite=True) as tmp3:
        (tmp3 / "model.pt").write_text("new")
    assert (final / "model.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_resource_monitor_turns_samples_into_rates_per_role():
    from tempering.utils.resources import ResourceMonitor, process_usage

    samples = iter(
        [
            [{"cpu_s": 1.0, "wall_s": 10.0, "peak_rss_gb": 0.5}, {"cpu_s": 0.0, "wall_s": 10.0, "peak_rss_gb": 0.7}],
            [{"cpu_s": 3.0, "wall_s": 12.0, "peak_rss_gb": 0.6, "threads": 1, "thread_changes": 1},
             {"cpu_s": 1.0, "wall_s": 12.0, "peak_rss_gb": 0.7, "peak_gpu_mem_gb": 3.0, "gpu_util": 0.5,
              "threads": 2, "thread_changes": 2}],
            [{"cpu_s": 4.0, "wall_s": 13.0, "peak_rss_gb": 0.6}],  # a worker fewer: no rate
        ]
    )  # fmt: skip
    monitor = ResourceMonitor({"policy": lambda: next(samples)})  # takes the first as baseline
    m = monitor.sample()
    assert m["resources/policy/cpu_cores"] == 1.5  # (2 + 1) CPU-s over 2 s of wall time
    assert m["resources/policy/peak_rss_gb"] == 0.7
    assert m["resources/policy/peak_gpu_mem_gb"] == 3.0 and m["resources/policy/gpu_util"] == 0.5
    assert (m["resources/policy/threads"], m["resources/policy/thread_changes"]) == (3, 3)
    m = monitor.sample()
    assert "resources/policy/cpu_cores" not in m and m["resources/policy/peak_rss_gb"] == 0.6
    here = process_usage()
    assert here["cpu_s"] > 0 and here["peak_rss_gb"] > 0.01 and "peak_gpu_mem_gb" not in here
