"""Supervised fine-tuning.

    uv run examples/run_sft.py [--config examples/configs/sft.yaml] [dotted.key=value ...]

The default config trains tiny-arith from scratch on CPU (the recipe of models/tiny-arith).
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import training_run
from tempering.config import SFTMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "sft.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, SFTMasterConfig)  # fails fast
    from tempering.algorithms import sft  # heavy imports only after the config is valid

    with training_run(cfg):  # Ctrl-C, a folder in use, a bad row: one line, no traceback
        run = sft.setup(cfg, resolved)
        try:
            val = sft.train(run)
            export = Path(cfg.checkpointing.checkpoint_dir) / "final_hf"  # written by train()
            print(f"SFT done: {run.final_step} steps, val {val}; HF model exported to {export}")
        finally:
            run.close()


if __name__ == "__main__":
    main()
