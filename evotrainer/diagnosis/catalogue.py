"""The metric catalogue: ready-made harness-revision metrics (with their alerts) that a planner
adds to a new revision when a version failed with no alert, or when two hypotheses about a
failure cannot be told apart.

The entries are data (catalogue.yaml beside this module, shipped in the wheel with the
package): a revision copies an entry's metric and alert verbatim, so what a new revision
measures is read in its `git diff`, and a built-in revision never changes meaning."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from evotrainer.errors import EvoError
from evotrainer.store import cel
from evotrainer.store.specs import load_yaml

# What a metric can do for a diagnosis (docs: method.md, the harness evolution protocol):
# explain a failure no alert explained, split two hypotheses that predict the same score, or
# point at the next change to try.
GAPS = ("unexplained_outcome", "indistinguishable_hypotheses", "no_next_step")

CATALOGUE_PATH = Path(__file__).with_name("catalogue.yaml")


@dataclass(frozen=True)
class CatalogueEntry:
    # a harness-revision metric entry (name, layer, split, sql | analyzer, ...)
    metric: dict[str, Any]
    alert: dict[str, Any] | None  # the alert a revision adds with it
    gaps: frozenset[str]  # the gaps (from GAPS) this metric can close
    hypotheses: tuple[str, ...]  # skill names or categories whose hypothesis it can test
    # metric param: the CEL expression over `recipe` its value comes from (the length
    # budget, the reward's weighted components)
    recipe_params: dict[str, str] = field(default_factory=dict)

    def metric_for(self, recipe: dict[str, Any] | None) -> dict[str, Any]:
        """A copy of the metric with its params bound to `recipe`; a field the recipe lacks
        (the expression cannot be decided) leaves the entry's default (the metric says what
        it falls back to)."""
        metric = copy.deepcopy(self.metric)
        for param, expression in self.recipe_params.items():
            value = cel.evaluate_unless_null(expression, {"recipe": recipe})
            if value is not None:
                metric.setdefault("params", {})[param] = value
        return metric


@cache
def catalogue() -> tuple[CatalogueEntry, ...]:
    """Every catalogue entry, in file order (callers copy the dicts before changing them)."""
    source = str(CATALOGUE_PATH)
    data = load_yaml(CATALOGUE_PATH.read_bytes(), source)
    entries = []
    for index, raw in enumerate(data["entries"]):
        gaps = frozenset(raw.get("gaps") or ())
        unknown = sorted(gaps - set(GAPS))
        if unknown:
            raise EvoError(
                f"catalogue entry {index} ({raw['metric'].get('name')}) names unknown gaps "
                f"{unknown}", where=source, hint=f"a gap is one of {', '.join(GAPS)}",
            )
        entries.append(CatalogueEntry(
            metric=raw["metric"], alert=raw.get("alert"), gaps=gaps,
            hypotheses=tuple(raw.get("hypotheses") or ()),
            recipe_params=dict(raw.get("recipe_params") or {}),
        ))
    return tuple(entries)
