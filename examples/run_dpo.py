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
from typing import Any

from tempering.algorithms.launch import training_run
from tempering.config import DPOMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "dpo.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, DPOMasterConfig)  # fails fast
    from tempering.algorithms import dpo  # heavy imports only after the config is valid

    with training_run(cfg):  # Ctrl-C, a folder in use, a bad row: one line, no traceback
        run = dpo.setup(cfg, resolved)
        try:
            summary = dpo.train(run)
        finally:
            run.close()
        print(dpo.report(summary, cfg, held_out_task_accuracy(summary, cfg)))


def held_out_task_accuracy(summary: dict[str, Any], cfg: DPOMasterConfig) -> str | None:
    """tiny-arith data: held-out task accuracy before (the base model) and after (the final
    model), measured by `tempering eval` on the same problems; None for other data. Here, in
    the entry point, because evaluation sits above the algorithms."""
    if cfg.data.dataset_name not in ("arithmetic", "arithmetic_parity"):
        return None
    from tempering.evaluation import evaluate, report

    n = cfg.data.num_val_samples
    kwargs = {"samples": n, "seed": cfg.data.seed, "progress": False,
              "max_new_tokens": cfg.policy.generation.max_new_tokens}  # fmt: skip
    after = evaluate(summary["final_model"], "arithmetic", **kwargs)
    before = evaluate(cfg.policy.model_name, "arithmetic", **kwargs)
    note = ""
    if cfg.data.dataset_name == "arithmetic_parity":
        note = (
            "\n  (arithmetic_parity pairs prefer an even number to an odd one, neither the "
            "answer: task accuracy is expected to fall)"
        )
    head = "  held-out task accuracy, before (baseline) and after (model):\n"
    return head + report(after, before, None) + note


if __name__ == "__main__":
    main()
