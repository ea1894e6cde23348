"""tempering: post-training for language models on Ray worker groups."""

__version__ = "0.1.0"
