"""`evotrainer diagnose --rollouts PATH`: run a harness revision over rollouts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import typer
import yaml
from rich.table import Table

from evotrainer.control.reconcile import diagnose_version
from evotrainer.diagnosis.diagnose import diagnose as run_diagnosis
from evotrainer.diagnosis.diagnose import diagnosis_document
from evotrainer.diagnosis.harness import LAYERS, resolve_harness
from evotrainer.errors import EvoError, unreadable_table
from evotrainer.evidence.io import find_steps, read_steps
from evotrainer.store.lock import workspace_lock
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe

ROLLOUTS_HINT = "give canonical rollouts (.parquet), a run artifact folder or a verl dump folder"
STEPS_HINT = "give a steps.parquet written by a run, or leave --steps out"
_JSON_KEYS = ("harness", "evidence_digest", "metrics", "series", "alerts", "gaps")


def register(app: typer.Typer) -> None:
    @app.command("diagnose")
    def diagnose(
        name: str = typer.Argument(
            None,
            help="A workspace version: diagnose its recorded run and commit "
            "runs/NAME/diagnosis.yaml.",
        ),
        rollouts: Path = typer.Option(
            None,
            "--rollouts",
            help="Canonical Parquet file or folder, run artifact folder, or verl dump folder.",
        ),
        harness: str = typer.Option(
            "h0",
            "--harness",
            help="Harness revision: a name "
            "(harness_revisions/<name>.yaml, else built-in) or a file.",
        ),
        steps: Path = typer.Option(
            None, "--steps", help="steps.parquet [default: the one beside the rollouts, if any]."
        ),
        split: str = typer.Option("train", "--split", help="Split of a verl dump folder."),
        out: Path = typer.Option(None, "--out", help="Also write the Diagnosis YAML here."),
        as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
    ) -> None:
        """Diagnose a version of the workspace (NAME) or any rollouts standalone (--rollouts):
        metrics by layer, trends, alerts with example rollout ids, and gaps."""
        if name is not None:
            ws = Workspace.find()
            with workspace_lock(ws.state_dir / "lock", f"evotrainer diagnose {name}"):
                diagnosis, revision = diagnose_version(ws, name)
            _show(diagnosis, revision.metrics, as_json)
            return
        if rollouts is None:
            raise EvoError(
                "nothing to diagnose",
                field="--rollouts",
                hint="pass a version NAME, or --rollouts PATH",
            )
        revision = resolve_harness(harness)
        steps_path = steps or find_steps(rollouts)
        with unreadable_table(steps_path, STEPS_HINT):
            steps_table = read_steps(steps_path) if steps_path else None
        with warnings.catch_warnings(record=True) as caught, unreadable_table(
            rollouts, ROLLOUTS_HINT
        ):
            warnings.simplefilter("always")
            diagnosis = run_diagnosis(rollouts, steps_table, revision, split=split)
        if out is not None:
            document = diagnosis_document(diagnosis)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        _show(diagnosis, revision.metrics, as_json)
        for warning in caught:
            console(stderr=True).print(f"[yellow]warning:[/] {safe(warning.message)}")


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _show(diagnosis: dict, metrics, as_json: bool) -> None:
    if as_json:
        keyed = {"keyed": diagnosis["keyed"]} if diagnosis.get("keyed") else {}
        typer.echo(json.dumps({**{k: diagnosis[k] for k in _JSON_KEYS}, **keyed}, indent=2))
    else:
        _print(diagnosis, metrics)


def _print(diagnosis: dict, metrics) -> None:
    # Metric and alert names, messages and example rollout ids come from harness files and
    # rollout data: every one goes through safe().
    out = console()
    table = Table(title=f"Diagnosis with harness {safe(diagnosis['harness']['name'])}")
    for column in ("layer", "metric", "split", "value", "trend/step"):
        table.add_column(column, justify="right" if column in ("value", "trend/step") else "left")
    for layer in LAYERS:
        for metric in (m for m in metrics if m.layer == layer):
            table.add_row(
                layer,
                safe(metric.name),
                metric.split,
                _fmt(diagnosis["metrics"][metric.name]),
                _fmt(diagnosis["trends"].get(metric.name)),
            )
        table.add_section()
    out.print(table)
    # A keyed metric is the minimum over its keys: each key's value, lowest first, says
    # which one it is.
    for name, values in (diagnosis.get("keyed") or {}).items():
        ordered = sorted(values.items(), key=lambda kv: (kv[1] is None, kv[1] or 0.0, kv[0]))
        shown = ", ".join(f"{safe(str(key))} {_fmt(value)}" for key, value in ordered)
        out.print(f"{safe(name)} by key: {shown}")
    for alert in diagnosis["alerts"]:
        color = "red" if alert["severity"] == "critical" else "yellow"
        out.print(
            f"[bold {color}]{safe(alert['severity'].upper())}[/] {safe(alert['name'])}: "
            f"{safe(alert['metric'])} = {_fmt(alert['value'])} "
            f"(threshold {_fmt(alert['threshold'])}). {safe(alert['message'])}"
        )
        for example in alert["examples"]:
            out.print(f"    e.g. {safe(example)}")
    if not diagnosis["alerts"]:
        out.print("No alerts.")
    for gap in diagnosis["gaps"]:
        out.print(f"gap: {safe(gap['metric'])}: {safe(gap['reason'])}")
