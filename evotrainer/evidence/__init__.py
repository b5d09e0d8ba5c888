"""Evidence: the canonical rollout table and what reads and writes it."""
