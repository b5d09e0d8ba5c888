"""Backtests: replay a version's stored rollouts under a candidate change, without training.

- `backtest_reward`: re-score every rollout with an extra reward component and count the dead
  groups that regain variance (the method's dead-group rescue: 45% with the IF judge). The
  component may be a judge's (`judge:<name>`, with its `reward.judges` entry): the judge is
  asked about every stored response, in batches, before any training.
- `backtest_filter`: replay a group filter over the groups in step order, as the engine would
  have called it, and report what it keeps.

Both take a rollout table (or a path `read_rollouts` understands) and return a plain dict of
numbers and strings, so a planner can embed the result in a proposal. A group is the rows of
one (version, seed, step, group_id) with at least two samples; it is dead by the one
definition every `dead_group_ratio` uses (evidence/groups.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from evotrainer.contract.filters import Trajectory, filter_batch, make_filter
from evotrainer.domains import JudgedDomain, ServedEndpoint, make_domain
from evotrainer.domains.judge import COMPONENT_PREFIX
from evotrainer.errors import EvoError
from evotrainer.evidence.groups import dead_groups
from evotrainer.evidence.io import read_rollouts
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.skills.skill import Skill
from evotrainer.store.recipe import BASE_RECIPE

GroupKey = tuple[str, int, int, str]  # version, seed, step, group_id


def _select(rollouts: pa.Table | str | Path, split: str) -> pa.Table:
    table = rollouts if isinstance(rollouts, pa.Table) else read_rollouts(rollouts, split=split)
    table = table.filter(pc.equal(table["split"], split))
    if table.num_rows == 0:
        raise EvoError(f"no {split!r} rollouts to replay", field="--split",
                       hint="train groups are what a filter or reward change acts on; "
                       "check the version trained")
    if table["reward"].null_count:
        raise EvoError(f"{table['reward'].null_count} {split} rollouts have no reward",
                       hint="re-ingest the run; a backtest needs every rollout's reward")
    return table


def _groups(table: pa.Table) -> dict[GroupKey, list[int]]:
    """Row indices per group, in replay order: by version, seed and step, then in the order the
    groups were written within a step (the order the engine handed them to the filter)."""
    columns = [table[c].to_pylist() for c in ("version", "seed", "step", "group_id")]
    groups: dict[GroupKey, list[int]] = {}
    for i, key in enumerate(zip(*columns, strict=True)):
        groups.setdefault(key, []).append(i)
    ordered = sorted((k for k, rows in groups.items() if len(rows) >= 2),
                     key=lambda k: (k[0], k[1], k[2]))  # stable: keeps the order within a step
    return {k: groups[k] for k in ordered}


def _trajectories(table: pa.Table) -> list[Trajectory]:
    """What the trajectory level reads of each row. A table none of whose rollouts called a
    tool or took a second turn is a single-turn domain's: its rules about acting on the task
    do not apply (turns and calls None), as the engine passes them."""
    calls = table["tool_calls"].to_pylist()
    turns = table["turns"].to_pylist()
    multi_turn = any(calls) or any((t or 0) > 1 for t in turns)
    return [
        Trajectory(correct or 0.0, t if multi_turn else None, (c or []) if multi_turn else None,
                   truncated)
        for correct, t, c, truncated in zip(table["correct"].to_pylist(), turns, calls,
                                            table["truncated"].to_pylist(), strict=True)
    ]


def _stds(values: np.ndarray, groups: Mapping[GroupKey, list[int]]) -> np.ndarray:
    return np.array([float(np.std(values[rows])) for rows in groups.values()])


def _mean(values: np.ndarray) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


# ----------------------------------------------------------------------------------- reward


def _domain_config(domain: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    if domain is None:
        return None
    cfg = {"name": domain} if isinstance(domain, str) else dict(domain)
    return {**BASE_RECIPE["domain"], **cfg}


def component_values(
    table: pa.Table,
    component: str,
    domain: str | Mapping[str, Any] | None,
    *,
    judges: list[Mapping[str, Any]] | None = None,
    cache_dir: Path | None = None,
    endpoints: Mapping[str, ServedEndpoint] | None = None,
) -> tuple[np.ndarray, str]:
    """Each rollout's raw value of `component` and where it came from: `recorded` (the
    rollout's `reward_components`), `recomputed` (the domain's scorer over the stored
    response), or `mixed`. `domain` is the recipe's `domain` section (or just its name): its
    train/val split reconstructs the tasks the rollouts were sampled from. A judge's
    component (`judge:<name>`) needs its entry among `judges` (the recipe's
    `reward.judges`); the judge alone is asked, all missing rows in one batch, and the
    domain's own scoring does not run."""
    recorded = [dict(c or []).get(component) for c in table["reward_components"].to_pylist()]
    missing = [i for i, v in enumerate(recorded) if v is None]
    if not missing:
        return np.array(recorded, dtype=float), "recorded"
    cfg = _domain_config(domain)
    if cfg is None:
        raise EvoError(f"component {component!r} is not recorded in {len(missing)} rollouts, "
                       "and no domain was named to recompute it", field="--component",
                       hint="backtest a version (its recipe names the domain) or pass --domain")
    judged = component.startswith(COMPONENT_PREFIX)
    scorer = make_domain(cfg, judges if judged else None, cache_dir=cache_dir,
                         endpoints=endpoints)
    if component not in scorer.components:
        hint = (f"give the judge {component.removeprefix(COMPONENT_PREFIX)!r} (--judge FILE, "
                "or the version's reward.judges)" if judged
                else f"known components: {', '.join(scorer.components)}")
        raise EvoError(f"domain {scorer.name!r} has no reward component {component!r}",
                       field="--component", hint=hint)
    train, val = scorer.split(cfg["train_size"], cfg["val_size"])
    tasks = {t.task_id: t for t in train + val}
    task_ids, responses = table["task_id"].to_pylist(), table["response"].to_pylist()
    calls = table["tool_calls"].to_pylist()
    items = []
    for i in missing:
        task = tasks.get(task_ids[i])
        if task is None:
            raise EvoError(f"task {task_ids[i]!r} is not among the domain's tasks",
                           field="domain", hint="the rollouts were sampled with another "
                           "domain configuration; pass the one they were made with")
        items.append((task, responses[i] or "", calls[i] or [], None))
    if isinstance(scorer, JudgedDomain):
        values = scorer.judge_values([component], items)[component]
    else:
        values = [scorer.score(*item).components[component] for item in items]
    for i, value in zip(missing, values, strict=True):
        recorded[i] = value
    source = "recomputed" if len(missing) == len(recorded) else "mixed"
    return np.array(recorded, dtype=float), source


def backtest_reward(
    rollouts: pa.Table | str | Path,
    component: str,
    weight: float,
    domain: str | Mapping[str, Any] | None = None,
    *,
    split: str = "train",
    judges: list[Mapping[str, Any]] | None = None,
    cache_dir: Path | None = None,
    endpoints: Mapping[str, ServedEndpoint] | None = None,
) -> dict[str, Any]:
    """Re-score each rollout as reward + weight × component and compare the groups. A
    judge's component is asked of the judge among `judges` (see `component_values`)."""
    table = _select(rollouts, split)
    values, source = component_values(table, component, domain, judges=judges,
                                      cache_dir=cache_dir, endpoints=endpoints)
    before = np.array(table["reward"].to_pylist(), dtype=float)
    after = before + weight * values
    groups = _groups(table)
    std_before, std_after = _stds(before, groups), _stds(after, groups)
    dead_before, dead_after = dead_groups(std_before), dead_groups(std_after)
    correct = np.array([np.nan if c is None else c for c in table["correct"].to_pylist()])
    known = ~np.isnan(correct)
    corr = None
    if known.sum() >= 2 and np.std(values[known]) > 0 and np.std(correct[known]) > 0:
        corr = float(np.corrcoef(values[known], correct[known])[0, 1])
    return {
        "component": component,
        "weight": float(weight),
        "split": split,
        "component_source": source,
        "rollouts": table.num_rows,
        "groups": len(groups),
        "component_mean": _mean(values),
        # Low correlation with correctness means the component adds information (IF: 0.12).
        "component_correct_corr": corr,
        "reward_mean_before": _mean(before),
        "reward_mean_after": _mean(after),
        "reward_spread_before": _mean(std_before),
        "reward_spread_after": _mean(std_after),
        "dead_groups_before": int(dead_before.sum()),
        "dead_groups_after": int(dead_after.sum()),
        "dead_group_ratio_before": _ratio(int(dead_before.sum()), len(groups)),
        "dead_group_ratio_after": _ratio(int(dead_after.sum()), len(groups)),
        "rescued_groups": int((dead_before & ~dead_after).sum()),
        "rescue_ratio": _ratio(int((dead_before & ~dead_after).sum()), int(dead_before.sum())),
        # A negative weight can also cancel a group's spread.
        "killed_groups": int((~dead_before & dead_after).sum()),
    }


# ----------------------------------------------------------------------------------- filter


def backtest_filter(
    rollouts: pa.Table | str | Path,
    filter_name: str,
    params: Mapping[str, Any] | None = None,
    *,
    split: str = "train",
) -> dict[str, Any]:
    """Replay a group filter step by step (a fresh filter per version and seed, as each run
    starts one) and compare the kept groups with all of them."""
    spec = {"name": filter_name, "params": dict(params or {})}
    make_filter(spec)  # an unknown filter or parameter fails before any reading
    table = _select(rollouts, split)
    rewards = np.array(table["reward"].to_pylist(), dtype=float)
    groups = _groups(table)
    batches: dict[tuple[str, int, int], list[GroupKey]] = {}
    for key in groups:
        batches.setdefault(key[:3], []).append(key)
    filters: dict[tuple[str, int], Any] = {}
    trajectories = _trajectories(table)
    keep: list[bool] = []
    step_ratios: list[float] = []
    excluded: Counter = Counter()
    for (version, seed, _step), keys in batches.items():
        if (version, seed) not in filters:
            filters[(version, seed)] = make_filter(spec)
        # Both levels, as the engine applies them: a trajectory-level filter (dual_level)
        # takes anomalous rollouts out before the group test.
        decision = filter_batch(
            filters[(version, seed)], [rewards[groups[k]] for k in keys],
            [[trajectories[i] for i in groups[k]] for k in keys],
        )
        excluded += decision.reasons
        mask = decision.keep_groups
        keep += [bool(x) for x in mask]
        step_ratios.append(float(np.mean(mask)))
    thresholds = [f.threshold() for f in filters.values() if hasattr(f, "threshold")]
    kept = np.array(keep, dtype=bool)
    stds = _stds(rewards, groups)
    dead = dead_groups(stds)
    return {
        "filter": filter_name,
        "params": make_filter(spec).params,  # with the filter's defaults filled in
        "split": split,
        "rollouts": table.num_rows,
        "runs": len(filters),
        "steps": len(batches),
        "groups": len(groups),
        "kept_groups": int(kept.sum()),
        "keep_ratio": _ratio(int(kept.sum()), len(groups)),
        # Below 30% in a step means the filter over-filters (the method's SWE alert).
        "keep_ratio_min_step": min(step_ratios) if step_ratios else None,
        "dead_group_ratio_before": _ratio(int(dead.sum()), len(groups)),
        "dead_group_ratio_after": _ratio(int((dead & kept).sum()), int(kept.sum())),
        "reward_spread_before": _mean(stds),
        "reward_spread_after": _mean(stds[kept]),
        "excluded_trajectories": dict(sorted(excluded.items())),
        # The adaptive std threshold at the end of the replay, averaged over runs.
        "final_threshold": float(np.mean(thresholds)) if thresholds else None,
    }


# ------------------------------------------------------------------------- skills, versions


def _bound(skill: Skill) -> None:
    """A skill that binds its setting when its trigger fires names none until then."""
    if skill.unbound:
        raise EvoError(f"skill {skill.name!r} names its setting only when its trigger fires "
                       f"(bind: {', '.join(skill.bind)})", where=skill.source, field="bind",
                       hint="backtest the version a planner proposed with it, or name the "
                       "component or filter yourself")


def skill_filter(skill: Skill) -> tuple[str, dict[str, Any]]:
    """The group filter a skill installs: its entry point, else its recipe patch."""
    _bound(skill)
    entry = skill.entry_point
    if entry and entry["kind"] == "group_filter":
        return entry["name"], dict(entry.get("params") or {})
    patch = skill.recipe_patch.get("group_filter")
    if patch and patch.get("name"):
        return patch["name"], dict(patch.get("params") or {})
    raise EvoError(f"skill {skill.name!r} installs no group filter", where=skill.source,
                   field="mechanism", hint="pick a filter skill (category: filter)")


def skill_reward(skill: Skill, domain: str | None = None) -> tuple[str, float]:
    """The (component, weight) a skill adds: in a domain with its own patch, the component
    that patch raises (shaped-correctness raises code's `pass_fraction`, not `partial`);
    else its entry point, else a single patched component."""
    _bound(skill)
    by_domain = skill.data["mechanism"].get("domain_patches") or {}
    if domain in by_domain:
        raised = [c for c in ((by_domain[domain] or {}).get("reward") or {}).get("components")
                  or [] if isinstance(c.get("weight"), dict)
                  and c["weight"].get("direction") == "raise"]
        if len(raised) == 1:
            return raised[0]["name"], float(raised[0]["weight"].get("min", 1.0))
    entry = skill.entry_point
    if entry and entry["kind"] == "reward_component":
        return entry["name"], float((entry.get("params") or {}).get("weight", 1.0))
    components = (skill.recipe_patch.get("reward") or {}).get("components") or []
    if len(components) == 1:
        return components[0]["name"], float(components[0].get("weight", 1.0))
    raise EvoError(f"skill {skill.name!r} adds no single reward component", where=skill.source,
                   field="mechanism", hint="pass --component NAME --weight W instead")


def version_rollouts(ws: Any, version: str, split: str = "train") -> Path:
    """The stored rollouts of `version`, found through its run record's `artifact_dir`."""
    run = ws.version(version).run
    if not run or not run.artifact_dir:
        raise EvoError(f"version {version!r} has no run record with an artifact_dir",
                       where=f"evo/{version}:runs/{version}/run.yaml",
                       hint="backtests replay a finished run; run `evotrainer reconcile` first")
    state = ws.version(version)
    path = RunArtifacts(ws.run_dir(version, state.records["run"])).rollouts(split)
    if not path.is_file():
        raise EvoError("the run's rollouts are missing", where=str(path),
                       hint="artifacts live outside git; restore them or re-run the version")
    return path

