"""Diagnosis: harness revisions and the metric engine over stored rollouts, the skill library
and reward backtests."""
