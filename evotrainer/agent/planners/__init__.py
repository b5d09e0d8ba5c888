"""Planners: propose the next policy versions and harness revisions (see base.py)."""
