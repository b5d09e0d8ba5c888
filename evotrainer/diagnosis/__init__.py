"""Diagnosis: harness revisions, statistics, the gate, the skill library and backtests over
stored rollouts."""
