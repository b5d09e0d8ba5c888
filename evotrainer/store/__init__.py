"""The store: specs, recipes, git, the workspace, its lock and validation."""
