"""The promotion gate: a version's decision against its parent (decision.py) under the
harness's gate rules (rules.py), the outcome it records (outcomes.py), and harness revisions
re-gating recorded history (harness_backtest.py)."""
