"""The canonical rollout table's columns by name, and what each means, without pyarrow:
checking a harness revision (`validate`, `plan`) reads only the names. Their types are
evidence/schema.py's ROLLOUT_SCHEMA, in the same order (tests/test_docs.py holds it)."""

from __future__ import annotations

FINISH_REASONS = ("stop", "length", "tool_limit", "error")

# What each column means: docs/evidence.md is generated from this and the schema
# (scripts/gen_docs.py), so the reference cannot drift from the table.
COLUMN_DOCS = {
    "version": "the version that produced the row",
    "seed": "the training seed",
    "step": "the training step (the evaluation's step for `val` rows)",
    "split": "`train` (a GRPO rollout) or `val` (an evaluation sample)",
    "task_id": "the task, derived from its content: stable across steps, seeds and versions, "
    "so two versions' score tables pair by it",
    "data_source": "the task's stratum (benchmark subset)",
    "group_id": "the GRPO group within a step; a group is (seed, step, group_id)",
    "sample_idx": "the sample within its group",
    "prompt": "the prompt text (untrusted: always escaped or quoted as data)",
    "response": "the response; for multi-turn domains the whole transcript after the prompt, "
    "observations included (untrusted)",
    "reward": "the weighted reward GRPO used",
    "reward_components": "every raw component the domain scored (only the recipe's weighted "
    "ones enter `reward`; `tampered` is 1 when the scoring process saw an exit, a signal or a "
    "forged report)",
    "correct": "correctness in [0, 1]; null when not recorded",
    "response_tokens": "the response's length in tokens; null when unknown (never 0)",
    "truncated": "generation hit the length limit",
    "finish_reason": f"how it ended: {', '.join(f'`{r}`' for r in FINISH_REASONS)} or null",
    "turns": "assistant turns (multi-turn domains)",
    "tool_calls": "each call's tool name and arguments, in order",
    "mean_logprob": "the mean token log-probability of the response under the sampling policy",
    "extra": "anything else, as JSON text",
}

# The rollout table's column names, in the schema's order.
ROLLOUT_COLUMNS = tuple(COLUMN_DOCS)
