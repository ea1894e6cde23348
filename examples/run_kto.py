"""Kahneman-Tversky Optimisation: preference learning from rows labelled desirable or not.

    uv run examples/run_kto.py [--config examples/configs/kto.yaml] [dotted.key=value ...]

The default config runs KTO on tiny-arith with SYNTHETIC rows (DPO's arithmetic pairs
unpaired: the correct answer desirable, the same answer with a corrupted number undesirable)
on CPU in a few minutes. Your own rows: ``data.dataset_name=unpaired
data.train_data_path=rows.jsonl`` with ``{"prompt", "completion", "label": true|false}`` per
line. The report gives the held-out rewards by label, the held-out pairs' log-prob accuracy
beside the frozen reference's and, for tiny-arith data, the held-out task accuracy before and
after, measured by `tempering eval` on the same problems (with its 95% interval).
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import training_run
from tempering.config import KTOMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "kto.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, KTOMasterConfig)  # fails fast
    from tempering.algorithms import kto  # heavy imports only after the config is valid
    from tempering.evaluation import arithmetic_before_after

    with training_run(cfg):  # Ctrl-C, a folder in use, a bad row: one line, no traceback
        run = kto.setup(cfg, resolved)
        try:
            summary = kto.train(run)
        finally:
            run.close()
        print(kto.report(summary, cfg, arithmetic_before_after(summary["final_model"], cfg)))


if __name__ == "__main__":
    main()
