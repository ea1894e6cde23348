"""Multi-turn GRPO: the model answers, the environment replies, the model tries again.

    uv run examples/run_grpo_multiturn.py [--config examples/configs/grpo_multiturn_tiny.yaml] [key=value ...]

The default trains tiny-arith-chat on `arithmetic_retry` (a wrong answer gets the question
again, up to 3 attempts) on CPU in a few minutes; `grpo_multiturn_smollm2_calculator.yaml`
gives SmolLM2-135M a calculator tool instead. Same loop as run_grpo_math.py; only the
environment and `grpo.max_rollout_turns` differ.
"""

import sys
from pathlib import Path

from tempering.config import GRPOMasterConfig, parse_args_and_load

DEFAULT = Path(__file__).parent / "configs" / "grpo_multiturn_tiny.yaml"


def main() -> None:
    cfg, resolved = parse_args_and_load(sys.argv[1:], DEFAULT, GRPOMasterConfig)  # fails fast
    from tempering.algorithms import grpo  # heavy imports only after the config is valid

    run = grpo.setup(cfg, resolved)
    try:
        s = grpo.train(run)
    finally:
        run.close()
    print(grpo.summary_text(s, cfg))


if __name__ == "__main__":
    main()
