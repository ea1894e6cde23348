"""Direct Preference Optimisation.

    uv run examples/run_dpo.py [--config examples/configs/dpo.yaml] [dotted.key=value ...]

The default config runs DPO on tiny-arith with SYNTHETIC preference pairs (correct answer vs
the same answer with a corrupted number) on CPU in a few minutes, reporting held-out
preference accuracy and greedy accuracy at the start and the end.
"""

import sys
from pathlib import Path

from tempering.config import DPOMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "dpo.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, DPOMasterConfig)  # fails fast
    from tempering.algorithms import dpo  # heavy imports only after the config is valid

    run = dpo.setup(cfg, resolved)
    try:
        summary = dpo.train(run)
        export = Path(cfg.checkpointing.checkpoint_dir) / "final_hf"  # written by train()
        print(
            f"DPO done: {summary['steps']} steps; val at start {summary['start']}; "
            f"val at end {summary['end']}; HF model exported to {export}"
        )
    finally:
        run.close()


if __name__ == "__main__":
    main()
