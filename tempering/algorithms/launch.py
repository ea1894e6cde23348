"""What a GRPO (or distillation) example script runs: load and validate the config (failing
fast, before any heavy import), set up, train, restart from the last checkpoint after a worker
death or an expired deadline (`fault_tolerance.max_restarts`, GRPO), free everything, print the
summary. Every training script (SFT, DPO and RM's too) runs its set-up and training inside
:func:`training_run`.

    from tempering.algorithms.launch import run_grpo_example
    run_grpo_example(sys.argv[1:], Path(__file__).parent / "configs" / "grpo_math_tiny.yaml")

Kept apart from `grpo` (which imports torch and the workers) so that a bad config fails in
a second, and from `common` (which `grpo` imports) so that the two do not import each other.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@contextmanager
def training_run(cfg: Any) -> Iterator[None]:
    """Around a training script's set-up and training: Ctrl-C / SIGTERM stop it cleanly
    (workers freed, the checkpoint to resume from named, exit 130 / 143: `utils.stopping`),
    its log and checkpoint folders are its own while it runs (`utils.run_lock`), and a user's
    mistake -- a missing model, a bad data row, a folder in use -- is one message and exit 2."""
    from tempering.errors import exit_on_user_error
    from tempering.utils.run_lock import lock_run_dirs
    from tempering.utils.stopping import stop_cleanly

    # At exit, after every other exit handler (Ray's shutdown among them: registered later,
    # run earlier): the interpreter's last garbage collection walks every object left of
    # torch, transformers and Ray -- 2.8 s of a 31 s GRPO job on the 2-core EPYC, every
    # run and rerun; frozen, it is skipped (0.5 s). A script's files are closed by then
    # (each run's close()).
    atexit.register(gc.freeze)
    with stop_cleanly(cfg.checkpointing), exit_on_user_error(), lock_run_dirs(cfg):
        yield


def run_grpo_example(argv: list[str], default_config: Path) -> None:
    """What every GRPO example script does: load and validate the config (failing fast,
    before any heavy import), set up, train, free everything, print the summary."""
    from tempering.config import GRPOMasterConfig, parse_args_and_load

    cfg, resolved = parse_args_and_load(argv, default_config, GRPOMasterConfig)
    with training_run(cfg):
        _run_grpo(cfg, resolved)


def _run_grpo(cfg: Any, resolved: dict[str, Any]) -> None:
    """Set up, train, restart from the last checkpoint after a worker death or an expired
    deadline (up to ``fault_tolerance.max_restarts``), free everything, print the summary."""
    from tempering.algorithms import grpo  # heavy imports only after the config is valid
    from tempering.distributed.deadlines import DeadlineExceeded
    from tempering.distributed.worker_groups import WorkerDiedError

    if cfg.grpo.async_grpo.enabled:
        from tempering.algorithms.async_grpo import train
    else:
        train = grpo.train
    restarts: list[dict[str, Any]] = []
    while True:
        start = time.perf_counter()
        run = grpo.setup(cfg, resolved)
        if restarts:
            restarts[-1].update(setup_s=time.perf_counter() - start, resumed_at=run.start_step)
        try:
            summary = train(run)
            break
        except (WorkerDiedError, DeadlineExceeded) as exc:
            if len(restarts) >= cfg.fault_tolerance.max_restarts:
                raise
            restarts.append(
                {"error": str(exc).splitlines()[0], "failed_after_step": last_logged_step(cfg)}
            )
            log.warning(
                "restart %d of fault_tolerance.max_restarts=%d after: %s",
                len(restarts), cfg.fault_tolerance.max_restarts, restarts[-1]["error"],
            )  # fmt: skip
        finally:
            run.close()
    summary["restarts"] = restarts
    print(grpo.summary_text(summary, cfg))


def run_distillation_example(argv: list[str], default_config: Path) -> None:
    """What `examples/run_distillation.py` does: load and validate the config (failing fast),
    set up student and teacher, train, free everything, print the summary."""
    from tempering.config import DistillationMasterConfig, parse_args_and_load

    cfg, resolved = parse_args_and_load(argv, default_config, DistillationMasterConfig)
    from tempering.algorithms import distillation  # heavy imports only after the config is valid

    with training_run(cfg):  # a teacher of another vocabulary, too: one message, exit 2
        run = distillation.setup(cfg, resolved)
        try:
            summary = distillation.train(run)
        finally:
            run.close()
    print(distillation.summary_text(summary, cfg))


def last_logged_step(cfg: Any) -> int:
    """The newest step in ``<log_dir>/metrics.jsonl`` (0 when none)."""
    import json

    path = Path(cfg.logger.log_dir) / "metrics.jsonl"
    last = 0
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):
                continue
    return last
