"""Counterfactual branch families, as the gate reads them from a version's spec.

A family is a few sibling versions proposed together from one base (agent/planners/
counterfactual.py): treatments, each a single factor, and a control — the base retrained
without the factor suspected of the pathology, or as it is on a new seed. Each member's spec
records it under `proposal.family`:

    family: {name: cf-v1-1, role: treatment, control: v4, members: [{name: v3, role:
             treatment}, {name: v4, role: control}], suspected: {...}, tests: "..."}

The gate compares a treatment with its family's control beside its parent (the role
`control` of the comparison family, gate/decision.py), and a treatment waits, undecided,
until its control is scored, as a child waits for its parent. The family's treatments are
all compared with the same control, so the correction counts each of those comparisons, not
only the treatment's own: a family of two treatments gates each at alpha / 3 (parent, control
and the sibling's comparison with the control). A sibling's p-value is not known when a
treatment is gated first, so it counts as 1 (it is never the smallest): the treatment's own
p-values are multiplied as Holm multiplies the smallest ones of m.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from evotrainer.stats import GateProcedure, adjust_p

TREATMENT, CONTROL = "treatment", "control"


def family_of(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The version's `proposal.family`, None when it is in no family."""
    family = ((spec or {}).get("proposal") or {}).get("family")
    return family if isinstance(family, dict) else None


def control_of(spec: Mapping[str, Any] | None) -> str | None:
    """The control a treatment is gated against; None for a control or a version in no
    family."""
    family = family_of(spec)
    if family is None or family.get("role") != TREATMENT:
        return None
    return family.get("control")


def treatments(family: Mapping[str, Any]) -> list[str]:
    return [m["name"] for m in family.get("members") or [] if m.get("role") == TREATMENT]


def with_control(procedure: GateProcedure, spec: Mapping[str, Any] | None) -> GateProcedure:
    """The procedure a treatment is gated by: its control joins the comparison family."""
    if control_of(spec) is None or CONTROL in procedure.compare_with:
        return procedure
    return replace(procedure, compare_with=(*procedure.compare_with, CONTROL))


def comparisons(spec: Mapping[str, Any] | None, references: int) -> int:
    """How many comparisons the correction counts: the version's own references, plus its
    sibling treatments' comparisons with the same control."""
    if control_of(spec) is None:
        return references
    return references + len(treatments(family_of(spec) or {})) - 1


def adjusted(p_values: list[float], correction: str, m: int) -> list[float]:
    """The version's p-values adjusted within a family of `m` comparisons; the siblings'
    unknown p-values count as 1."""
    return adjust_p([*p_values, *[1.0] * (m - len(p_values))], correction)[:len(p_values)]


def record(spec: Mapping[str, Any] | None, references: int) -> dict[str, Any]:
    """What a treatment's decision adds to its `family` record: the counterfactual family and
    the comparisons its correction counted; nothing for a version in no family."""
    if control_of(spec) is None:
        return {}
    family = family_of(spec) or {}
    return {"comparisons": comparisons(spec, references),
            "counterfactual": {"name": family.get("name"), "control": family.get("control"),
                               "treatments": treatments(family)}}
