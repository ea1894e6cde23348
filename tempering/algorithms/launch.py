"""What a GRPO (or distillation) example script runs: load and validate the config (failing
fast, before any heavy import), set up, train, restart from the last checkpoint after a worker
death or an expired deadline (`fault_tolerance.max_restarts`, GRPO), free everything, print the
summary.

    from tempering.algorithms.launch import run_grpo_example
    run_grpo_example(sys.argv[1:], Path(__file__).parent / "configs" / "grpo_math_tiny.yaml")

Kept apart from `grpo` (which imports torch and the workers) so that a bad config fails in
a second, and from `common` (which `grpo` imports) so that the two do not import each other.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def run_grpo_example(argv: list[str], default_config: Path) -> None:
    """What every GRPO example script does: load and validate the config (failing fast,
    before any heavy import), set up, train, free everything, print the summary."""
    from tempering.config import GRPOMasterConfig, parse_args_and_load

    cfg, resolved = parse_args_and_load(argv, default_config, GRPOMasterConfig)
    from tempering.utils.stopping import stop_cleanly

    with stop_cleanly(cfg.checkpointing):  # Ctrl-C / SIGTERM: free the workers, say where
        _run_grpo(cfg, resolved)  # to resume, exit 130 / 143


def _run_grpo(cfg: Any, resolved: dict[str, Any]) -> None:
    """Set up, train, restart from the last checkpoint after a worker death or an expired
    deadline (up to ``fault_tolerance.max_restarts``), free everything, print the summary."""
    from tempering.algorithms import grpo  # heavy imports only after the config is valid
    from tempering.distributed.deadlines import DeadlineExceeded
    from tempering.distributed.worker_groups import WorkerDiedError
    from tempering.errors import exit_on_user_error

    if cfg.grpo.async_grpo.enabled:
        from tempering.algorithms.async_grpo import train
    else:
        train = grpo.train
    restarts: list[dict[str, Any]] = []
    while True:
        start = time.perf_counter()
        with exit_on_user_error():  # a missing model or a bad data row: one message, exit 2
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
    from tempering.errors import exit_on_user_error

    cfg, resolved = parse_args_and_load(argv, default_config, DistillationMasterConfig)
    from tempering.algorithms import distillation  # heavy imports only after the config is valid
    from tempering.utils.stopping import stop_cleanly

    with stop_cleanly(cfg.checkpointing):
        with exit_on_user_error():  # a missing model, a teacher of another vocabulary: exit 2
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
