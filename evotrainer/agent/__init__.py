"""The trainer agent: planners, proposals and the evolve loop (the skill library they read
lives in `evotrainer.skills`)."""
