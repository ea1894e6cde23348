"""Supervised fine-tuning.

    uv run examples/run_sft.py [--config examples/configs/sft.yaml] [dotted.key=value ...]

The default config trains tiny-arith from scratch on CPU (the recipe of models/tiny-arith).
"""

import sys
from pathlib import Path

from tempering.config import SFTMasterConfig, parse_args_and_load
from tempering.errors import exit_on_user_error
from tempering.utils.stopping import stop_cleanly

DEFAULT = Path(__file__).parent / "configs" / "sft.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, SFTMasterConfig)  # fails fast
    from tempering.algorithms import sft  # heavy imports only after the config is valid

    with stop_cleanly(cfg.checkpointing):  # Ctrl-C / SIGTERM: workers freed, exit 130 / 143
        with exit_on_user_error():  # a missing model or a bad data row: one message, exit 2
            run = sft.setup(cfg, resolved)
        try:
            val = sft.train(run)
            export = Path(cfg.checkpointing.checkpoint_dir) / "final_hf"  # written by train()
            print(f"SFT done: {run.final_step} steps, val {val}; HF model exported to {export}")
        finally:
            run.close()


if __name__ == "__main__":
    main()
