"""Experience: rollouts that turn prompts into training data (`rollouts.py`)."""
