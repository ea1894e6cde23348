"""Reward-model training (Bradley-Terry on a sequence-classification head).

    uv run examples/run_rm.py [--config examples/configs/rm.yaml] [dotted.key=value ...]

The default config trains a reward model from tiny-arith on SYNTHETIC pairs (correct answer vs
corrupted number) on CPU and exports it to <checkpointing.checkpoint_dir>/final_hf, the folder
that GRPO's `env.reward_model_path` (task "reward_model") takes.
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import training_run
from tempering.config import RMMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "rm.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, RMMasterConfig)  # fails fast
    from tempering.algorithms import rm  # heavy imports only after the config is valid

    with training_run(cfg):  # Ctrl-C, a folder in use, a bad row: one line, no traceback
        run = rm.setup(cfg, resolved)
        try:
            summary = rm.train(run)
            export = rm.export(run)
            print(
                f"RM done: {summary['steps']} steps; val at start {summary['start']}; "
                f"val at end {summary['end']}; reward model exported to {export}"
            )
        finally:
            run.close()


if __name__ == "__main__":
    main()
