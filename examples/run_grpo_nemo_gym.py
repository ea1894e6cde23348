"""GRPO against NeMo Gym environments: Gym's agents call tempering's generation server.

    uv run examples/run_grpo_nemo_gym.py [--config examples/configs/grpo_nemo_gym_tiny.yaml] [key=value ...]

The default launches the real NeMo Gym on CPU (its own venv, built on first use) with the
equivalence_rule environment scoring tiny-arith answers. Attach to a Gym you started yourself
with ``env.nemo_gym.config_paths=[] env.nemo_gym.head_server_url=http://HOST:11000``;
`grpo_nemo_gym_smollm2.yaml` trains on your own Gym JSONL rows (math_with_judge,
workplace_assistant, example_single_tool_call). See docs/nemo_gym.md.
"""

import sys
from pathlib import Path

from tempering.algorithms.launch import run_grpo_example

DEFAULT = Path(__file__).parent / "configs" / "grpo_nemo_gym_tiny.yaml"

if __name__ == "__main__":
    run_grpo_example(sys.argv[1:], DEFAULT)
