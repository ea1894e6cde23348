"""Direct Preference Optimisation.

    uv run examples/run_dpo.py [--config examples/configs/dpo.yaml] [dotted.key=value ...]

The default config runs DPO on tiny-arith with SYNTHETIC preference pairs (correct answer vs
the same answer with a corrupted number) on CPU in a few minutes. The report puts each
preference figure next to what the frozen reference already gets (its log-prob accuracy on
the same held-out pairs), and, for tiny-arith data, the held-out task accuracy before and
after, measured by `tempering eval` on the same problems (with its 95% interval).
`dpo_parity.yaml` trains a preference the reference does not hold.
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import training_run
from tempering.config import DPOMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "dpo.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, DPOMasterConfig)  # fails fast
    from tempering.algorithms import dpo  # heavy imports only after the config is valid
    from tempering.evaluation import arithmetic_before_after

    with training_run(cfg):  # Ctrl-C, a folder in use, a bad row: one line, no traceback
        run = dpo.setup(cfg, resolved)
        try:
            summary = dpo.train(run)
        finally:
            run.close()
        print(dpo.report(summary, cfg, arithmetic_before_after(summary["final_model"], cfg)))


if __name__ == "__main__":
    main()
