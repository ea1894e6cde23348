"""Multi-turn GRPO: the model answers, the environment replies, the model tries again.

    uv run examples/run_grpo_multiturn.py [--config examples/configs/grpo_multiturn_tiny.yaml] [key=value ...]

The default trains tiny-arith-chat on `arithmetic_retry` (a wrong answer gets the question
again, up to 3 attempts) on CPU in a few minutes; `grpo_multiturn_smollm2_calculator.yaml`
gives SmolLM2-135M a calculator tool instead. Same loop as run_grpo_math.py; only the
environment and `grpo.max_rollout_turns` differ.
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import run_grpo_example

DEFAULT = Path(__file__).parent / "configs" / "grpo_multiturn_tiny.yaml"

if __name__ == "__main__":
    run_grpo_example(sys.argv[1:], DEFAULT)
