"""Control: plan and reconcile, versions, jobs, live diagnosis, retention, pull requests and
validation of the whole workspace."""
