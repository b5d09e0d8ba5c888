"""The process sandbox: where model-written programs and harness-declared Python analyzers
run, with OS limits and isolation."""
