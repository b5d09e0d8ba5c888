"""`evotrainer harness backtest|adopt|diff`: evolve the harness on recorded history."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import typer
from rich.table import Table

from evotrainer.agent.diff_work import shared_with_children
from evotrainer.agent.stop_replay import describe, stops_may_differ
from evotrainer.diagnosis.harness import resolve_harness
from evotrainer.gate.harness_backtest import adopt_harness, backtest_harness, diff_harness
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import console, safe


def backtest_tables(report: dict[str, Any], changed_only: bool = True) -> list[Table]:
    # Revision, version, alert and metric names are file contents: all through safe().
    candidate, against = safe(report["candidate"]), safe(report["against"])
    versions = Table(title=f"harness backtest: {candidate} against {against} "
                     "(re-diagnosed and re-gated, no retraining)")
    for column in ("version", "recorded", f"verdict {against}", f"verdict {candidate}",
                   "alerts +", "alerts −", "new metrics"):
        versions.add_column(column, overflow="fold")
    for row in report["versions"]:
        if changed_only and not row["changed"] and not row["metrics_added"]:
            continue
        before, after = set(row["alerts_before"]), set(row["alerts_after"])
        verdict = safe(row["verdict_after"] or "—")
        if row["verdict_before"] != row["verdict_after"]:
            verdict = f"[bold yellow]{verdict}[/]"
        versions.add_row(
            safe(row["version"]), safe(row["recorded"] or "—"),
            safe(row["verdict_before"] or "—"), verdict,
            safe(", ".join(sorted(after - before))), safe(", ".join(sorted(before - after))),
            safe(", ".join(_shown(k, v, row) for k, v in row["new_metric_values"].items())),
        )
    cases = Table(title=f"backtest cases of {candidate}")
    for column in ("version", "expect", "verdict", "result"):
        cases.add_column(column)
    for case in report["cases"]:
        cases.add_row(safe(case["version"]), safe(case["expect"]), safe(case["verdict"] or "—"),
                      "[green]pass[/]" if case["passed"] else "[red]FAIL[/]")
    return [versions, cases]


def _shown(metric: str, value: Any, row: dict[str, Any]) -> str:
    """`metric=value`, with a keyed metric's value per key: which key is the minimum."""
    keys = (row.get("new_keyed_values") or {}).get(metric)
    by_key = f" ({', '.join(f'{k}={_fmt(v)}' for k, v in keys.items())})" if keys else ""
    return f"{metric}={_fmt(value)}{by_key}"


@contextmanager
def backtest_progress(show: bool) -> Iterator[Any]:
    """A rich progress bar naming the version being re-diagnosed (on the terminal's stderr,
    and only when it is a terminal and `show`: --json and pipes get none); yields the
    callback `backtest_harness` takes, or None."""
    out = console(stderr=True)
    if not show or not out.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=out,
                  transient=True) as bar:
        task = bar.add_task("re-diagnosing", total=None)

        def update(version: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total,
                       description=f"re-diagnosing {safe(version)}")

        yield update


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
        with backtest_progress(not as_json) as progress:
            report = backtest_harness(Workspace.find(), name, against, progress=progress)
        if as_json:
            print(json.dumps(report, indent=2, default=str))
        else:
            out = console()
            for table in backtest_tables(report):
                out.print(table)
            out.print(f"{len(report['versions'])} recorded version(s); changed: "
                      f"{safe(', '.join(report['changed']) or 'none')}")
            for row in report["versions"]:
                if row["flip"]:  # the numbers that flip it
                    out.print(f"  {safe(row['version'])}: {safe(row['flip']['why'])}")
        if not report["passed"]:
            raise typer.Exit(1)

    @group.command("adopt")
    def adopt(
        name: str = typer.Argument(..., help="Revision committed on main."),
        as_json: bool = typer.Option(False, "--json", help="Print the backtest report as JSON."),
    ) -> None:
        """Put a revision in force (`harness:` in spec/project.yaml, one commit on main)
        once its backtest cases pass; `evotrainer plan` then shows re-diagnoses."""
        ws = Workspace.find()
        report = adopt_harness(ws, name)
        if as_json:
            print(json.dumps(report, indent=2, default=str))
            return
        console().print(f"Adopted harness {safe(name)} (was {safe(report['against'])}); "
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
        thresholds, gate procedure, rules and early stops changed, and the recorded
        decisions the change would flip, each with the numbers that flip it, and the early
        stops it would (not) have made (replayed over the recorded runs)."""
        ws = Workspace.find()
        a, b = resolve_harness(old, ws.root), resolve_harness(new, ws.root)
        result = diff_harness(a, b)
        # The diagnoses and early-stop replays are shared with children, on another core.
        shared = shared_with_children(ws, a, b, replay=stops_may_differ(a, b)) if backtest_ \
            else nullcontext()
        with shared as work, backtest_progress(not as_json) as progress:
            report = backtest_harness(ws, b, a, progress=work.before_each_version(progress)) \
                if work is not None else None
            stops = work.early_stops() if work is not None else []
        if report is not None:
            result["changed_verdicts"] = [
                {**{k: r[k] for k in ("version", "recorded", "verdict_before",
                                      "verdict_after")}, "why": (r["flip"] or {}).get("why"),
                 "before": (r["flip"] or {}).get("before"),
                 "after": (r["flip"] or {}).get("after")}
                for r in report["versions"] if r["verdict_before"] != r["verdict_after"]
            ]
            result["early_stops"] = stops
        if as_json:
            print(json.dumps(result, indent=2, default=str))
            return
        out = console()
        table = Table(title=f"harness diff {safe(old)} → {safe(new)}")
        for column in ("part", "added", "removed", "changed"):
            table.add_column(column, overflow="fold")
        for part in ("metrics", "alerts", "gate_rules", "analyzers"):
            entry = result[part]
            table.add_row(part, safe(", ".join(entry["added"])), safe(", ".join(entry["removed"])),
                          safe("; ".join(f"{n} ({', '.join(f)})"
                                         for n, f in entry["changed"].items())))
        cases = result["backtest_cases"]
        table.add_row("backtest_cases", safe(", ".join(f"{v}:{e}" for v, e in cases["added"])),
                      safe(", ".join(f"{v}:{e}" for v, e in cases["removed"])), "")
        out.print(table)
        for alert, levels in result["thresholds"].items():
            out.print(f"threshold {safe(alert)}: {safe(levels['from'])} → {safe(levels['to'])}")
        for key, values in {**result["gate"], **result["params"]}.items():
            out.print(f"{safe(key)}: {safe(values['from'])} → {safe(values['to'])}")
        if result["rule_order"]:
            out.print(f"gate rule order: {safe(result['rule_order']['from'])} → "
                      f"{safe(result['rule_order']['to'])}")
        for name, rule in result["early_stop"]["changed"].items():
            out.print(f"early_stop {safe(name)}: {safe(rule['from'])} → {safe(rule['to'])}")
        for part in ("added", "removed"):
            if result["early_stop"][part]:
                out.print(f"early_stop {part}: {safe(', '.join(result['early_stop'][part]))}")
        if report is not None:
            flips = result["changed_verdicts"]
            out.print("verdicts that change: " + safe(", ".join(
                f"{f['version']} {f['verdict_before']} → {f['verdict_after']}" for f in flips)
                or "none") + f" (over {len(report['versions'])} recorded version(s))")
            for f in flips:  # the numbers that flip each one, beside the text change above
                out.print(f"  {safe(f['version'])}: {safe(f['why'] or '')}")
            stops = result["early_stops"]
            out.print("early stops that change: " + (safe(", ".join(
                describe(c) for c in stops)) or "none"))
