"""The store: specs, recipes, CEL, git, the workspace, its lock and the lineage of versions."""
