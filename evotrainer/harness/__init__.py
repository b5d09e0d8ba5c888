"""The harness engine: revisions as data, sandboxed SQL metrics, analyzers, alerts, gate."""
