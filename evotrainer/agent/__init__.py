"""The trainer agent: planners and the skill library."""
