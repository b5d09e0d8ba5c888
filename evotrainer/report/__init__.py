"""`evotrainer report`: a static HTML view of the lineage, diagnoses, decisions, harness
revisions and skills (no script, no network; pictures are inline SVG)."""

from evotrainer.report.site import build_report

__all__ = ["build_report"]
