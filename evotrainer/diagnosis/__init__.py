"""Diagnosis: harness revisions and the metric engine over stored rollouts (catalogue and
declared analyzers, SQL, incremental passes, gaps)."""
