"""Control: plan and reconcile, the gate, versions, lineage and the evolve loop."""
