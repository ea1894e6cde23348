"""SFT runs in the test process for the slow tier's learning tests: `train_sft` runs an example
config through the real loop (Ray worker group, FSDP2 worker) into a test's folder and returns
the exported model's folder, for ``tempering eval`` to score."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tempering.config import SFTMasterConfig, load_config

REPO = Path(__file__).parents[1]


def train_sft(config: str, out: Path, overrides: Sequence[str] = ()) -> Path:
    """Run ``examples/configs/<config>`` with ``overrides`` (logs and checkpoints under
    ``out``, one checkpoint at the end); returns its ``final_hf`` folder."""
    from tempering.algorithms import sft

    cfg, resolved = load_config(
        REPO / "examples/configs" / config,
        [
            *overrides,
            "checkpointing.save_period=1000",
            f"checkpointing.checkpoint_dir={out / 'ckpt'}",
            f"logger.log_dir={out / 'logs'}",
            "logger.tensorboard_enabled=false",
        ],
        schema=SFTMasterConfig,
    )
    run = sft.setup(cfg, resolved)
    try:
        sft.train(run)
    finally:
        run.close()
    return out / "ckpt" / "final_hf"
