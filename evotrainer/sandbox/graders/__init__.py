"""Programs the runner (`evotrainer.sandbox.runner`) starts in a child process, kept as
modules so that ruff and editors read them, and run from their text (`runner.program`):
never imported by evotrainer itself.

- `call_server`: the side of the code under test in a `swe` evaluation or a HumanEval check.
- `pytest_bootstrap`: the test process of a `swe_rebench` evaluation.
"""
