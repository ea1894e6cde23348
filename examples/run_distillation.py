"""On-policy distillation: the student samples, a frozen teacher scores each sampled token.

    uv run examples/run_distillation.py [--config examples/configs/distillation_math_tiny.yaml] [key=value ...]

The default distils `models/tiny-arith-grpo` (tiny-arith after the main GRPO job) into the
base tiny-arith on 2-digit addition, on CPU, in a few minutes.
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import run_distillation_example

DEFAULT = Path(__file__).parent / "configs" / "distillation_math_tiny.yaml"

if __name__ == "__main__":
    run_distillation_example(sys.argv[1:], DEFAULT)
