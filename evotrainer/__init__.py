"""EvoTrainer: RL post-training of LLMs as reviewable git history."""

__version__ = "0.1.0"
API_VERSION = "evotrainer/v1"
