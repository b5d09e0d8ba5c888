"""Control: plan and reconcile, versions, workspace scaffolding, jobs, live diagnosis, retention,
pull requests and validation of the whole workspace."""
