"""The sandbox: where model-written programs and harness-declared Python analyzers run, with
OS limits and isolation (process.py), and the trusted checker that scores code inside it
(runner.py, with the programs it starts in a child: graders/)."""
