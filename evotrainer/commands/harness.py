"""`evotrainer harness backtest|adopt|diff`: evolve the harness on recorded history."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.diagnosis.harness_backtest import adopt_harness, backtest_harness, diff_harness
from evotrainer.store.workspace import Workspace


def backtest_tables(report: dict[str, Any], changed_only: bool = True) -> list[Table]:
    versions = Table(title=f"harness backtest: {report['candidate']} against "
                     f"{report['against']} (re-diagnosed and re-gated, no retraining)")
    for column in ("version", "recorded", f"verdict {report['against']}",
                   f"verdict {report['candidate']}", "alerts +", "alerts −", "new metrics"):
        versions.add_column(column, overflow="fold")
    for row in report["versions"]:
        if changed_only and not row["changed"] and not row["metrics_added"]:
            continue
        before, after = set(row["alerts_before"]), set(row["alerts_after"])
        verdict = row["verdict_after"] or "—"
        if row["verdict_before"] != row["verdict_after"]:
            verdict = f"[bold yellow]{verdict}[/]"
        versions.add_row(
            row["version"], row["recorded"] or "—", row["verdict_before"] or "—", verdict,
            ", ".join(sorted(after - before)) or "", ", ".join(sorted(before - after)) or "",
            ", ".join(f"{k}={_fmt(v)}" for k, v in row["new_metric_values"].items()),
        )
    cases = Table(title=f"backtest cases of {report['candidate']}")
    for column in ("version", "expect", "verdict", "result"):
        cases.add_column(column)
    for case in report["cases"]:
        cases.add_row(case["version"], case["expect"], case["verdict"] or "—",
                      "[green]pass[/]" if case["passed"] else "[red]FAIL[/]")
    return [versions, cases]


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Backtest, adopt and compare harness revisions.",
                        no_args_is_help=True)
    app.add_typer(group, name="harness")

    @group.command("backtest")
    def backtest(
        name: str = typer.Argument(..., help="Candidate revision (name or YAML file)."),
        against: str = typer.Option(None, "--against", help="Revision to compare with "
                                    "(default: the one in force)."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """Re-diagnose every recorded version from its stored rollouts with both revisions
        and re-gate it: alerts and verdicts that change, and the candidate's backtest
        cases. Exit 1 when a case fails."""
        report = backtest_harness(Workspace.find(), name, against)
        if as_json:
            print(json.dumps(report, indent=2, default=str))
        else:
            console = Console()
            for table in backtest_tables(report):
                console.print(table)
            console.print(f"{len(report['versions'])} recorded version(s); changed: "
                          f"{', '.join(report['changed']) or 'none'}")
        if not report["passed"]:
            raise typer.Exit(1)

    @group.command("adopt")
    def adopt(name: str = typer.Argument(..., help="Revision committed on main.")) -> None:
        """Put a revision in force (`harness:` in spec/project.yaml, one commit on main)
        once its backtest cases pass; `evotrainer plan` then shows re-diagnoses."""
        ws = Workspace.find()
        report = adopt_harness(ws, name)
        Console().print(f"Adopted harness {name} (was {report['against']}); "
                        f"{len(report['cases'])} case(s) pass. Next: `evotrainer plan` "
                        "shows the re-diagnoses (no retraining), `evotrainer reconcile` "
                        "applies them.")

    @group.command("diff")
    def diff(
        old: str = typer.Argument(..., help="Base revision."),
        new: str = typer.Argument(..., help="Revision to compare."),
        backtest_: bool = typer.Option(True, "--backtest/--no-backtest",
                                       help="Also re-gate recorded versions with both."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
    ) -> None:
        """What changes for a reviewer besides `git diff`: metrics added or removed,
        thresholds and gate rules changed, and the verdicts the change would flip."""
        ws = Workspace.find()
        a, b = resolve_harness(old, ws.root), resolve_harness(new, ws.root)
        result = diff_harness(a, b)
        report = backtest_harness(ws, b, a) if backtest_ else None
        if report is not None:
            result["changed_verdicts"] = [
                {k: r[k] for k in ("version", "verdict_before", "verdict_after")}
                for r in report["versions"] if r["verdict_before"] != r["verdict_after"]
            ]
        if as_json:
            print(json.dumps(result, indent=2, default=str))
            return
        console = Console()
        table = Table(title=f"harness diff {old} → {new}")
        for column in ("part", "added", "removed", "changed"):
            table.add_column(column, overflow="fold")
        for part in ("metrics", "alerts", "gate_rules"):
            entry = result[part]
            table.add_row(part, ", ".join(entry["added"]), ", ".join(entry["removed"]),
                          "; ".join(f"{n} ({', '.join(f)})" for n, f in entry["changed"].items()))
        cases = result["backtest_cases"]
        table.add_row("backtest_cases", ", ".join(f"{v}:{e}" for v, e in cases["added"]),
                      ", ".join(f"{v}:{e}" for v, e in cases["removed"]), "")
        console.print(table)
        for alert, levels in result["thresholds"].items():
            console.print(f"threshold {alert}: {levels['from']} → {levels['to']}")
        for key, values in {**result["gate"], **result["params"]}.items():
            console.print(f"{key}: {values['from']} → {values['to']}")
        if result["rule_order"]:
            console.print(f"gate rule order: {result['rule_order']['from']} → "
                          f"{result['rule_order']['to']}")
        if report is not None:
            flips = result["changed_verdicts"]
            console.print("verdicts that change: " + (", ".join(
                f"{f['version']} {f['verdict_before']} → {f['verdict_after']}" for f in flips)
                or "none") + f" (over {len(report['versions'])} recorded version(s))")
