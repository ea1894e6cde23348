"""Reward-model training (Bradley-Terry on a sequence-classification head).

    uv run examples/run_rm.py [--config examples/configs/rm.yaml] [dotted.key=value ...]

The default config trains a reward model from tiny-arith on SYNTHETIC pairs (correct answer vs
corrupted number) on CPU and exports it to <checkpointing.checkpoint_dir>/final_hf, the folder
that GRPO's `env.reward_model_path` (task "reward_model") takes.
"""

import sys
from pathlib import Path

from tempering.config import RMMasterConfig, parse_args_and_load
from tempering.errors import exit_on_user_error
from tempering.utils.stopping import stop_cleanly

DEFAULT = Path(__file__).parent / "configs" / "rm.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, RMMasterConfig)  # fails fast
    from tempering.algorithms import rm  # heavy imports only after the config is valid

    with stop_cleanly(cfg.checkpointing):  # Ctrl-C / SIGTERM: workers freed, exit 130 / 143
        with exit_on_user_error():  # a missing model or a bad data row: one message, exit 2
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
