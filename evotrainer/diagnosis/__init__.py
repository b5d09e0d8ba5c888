"""Diagnosis: harness revisions, CEL, statistics and backtests over stored rollouts."""
