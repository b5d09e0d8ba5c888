"""The `anthropic` planner: Claude with tools over the same read-only views as `rules`.

Read tools: lineage, diagnosis, harness, skill search and detail, bounded read-only SQL over
a version's rollouts (the harness's locked-down DuckDB connection), filter and reward
backtests, and `retrieve` (agent/retrieval.py: past decisions, recurring cases and skill
evidence of this and the listed workspaces and of the shared library, each with its
citation). A proposal's `cites` must be citations a `retrieve` call of the same decision
returned; they are appended to its rationale, and the decision's search trace (queries,
sources, what came back) is recorded with it (`proposal.retrieval`).

Write tools: `propose_version`, `propose_harness_revision` and `propose_gate_revision`,
whose inputs are checked against the schemas and a policy before anything is kept: allowed
recipe keys only, one factor, known non-negative skills that change the parent's recipe, a
CEL criterion over known names, a parent that did not fail, harness SQL that is one SELECT,
gate fields that gate.schema.json knows, within its bounds. A gate revision is drafted and
backtested as the rules planner's are (gate_revisions.py); the model hears the verdicts it
flips. Nothing is written to git until the decision ends (then `write_proposals` does it, as
for every planner).

Tool inputs are untrusted too: each one is checked against its tool's JSON Schema (no other
keys, names that are names, `split` one of train/val) before a handler runs; no input is ever
pasted into SQL (the split filters the Arrow table the locked-down DuckDB reads) and
harness names resolve only inside the workspace or the built-in library.

Rollout text is untrusted: every tool result goes back inside an <untrusted-data> block
whose JSON cannot close the block early, and the system prompt says so. The API key comes
only from ANTHROPIC_API_KEY; tokens are counted per decision and bounded by
`planner.max_tokens_per_decision` and what is left of `autonomy.max_llm_tokens`.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import jinja2
import jsonschema

from evotrainer import API_VERSION
from evotrainer.agent.planners.base import (
    HarnessProposal,
    PlannerResult,
    Proposal,
    View,
    next_name,
    policy_violation,
)
from evotrainer.agent.planners.gate_revisions import GATE_SCHEMA, flipped, gate_revision
from evotrainer.agent.planners.revisions import in_force_document
from evotrainer.agent.retrieval import Query, SearchTrace, retrieve
from evotrainer.diagnosis.harness import (
    GATE_VARIABLES,
    HarnessRevision,
    load_harness,
    parse_harness,
)
from evotrainer.diagnosis.sql import ReadOnlyQuery, check_select
from evotrainer.errors import EvoError
from evotrainer.evidence.io import read_rollouts
from evotrainer.evidence.layout import RunArtifacts
from evotrainer.gate.harness_backtest import backtest_harness
from evotrainer.gate.rules import metric_values
from evotrainer.skills.replay import (
    backtest_filter,
    backtest_reward,
    skill_filter,
    skill_reward,
    version_rollouts,
)
from evotrainer.skills.skill import get_skill, resolve_skill, search
from evotrainer.store import cel, specs
from evotrainer.store.builtin import HARNESS_FOLDER, builtin_dir, harness_file
from evotrainer.store.lineage import lineage_rows
from evotrainer.store.recipe import set_dotted

DEFAULT_MODEL = "claude-sonnet-5"
DEFAULT_TOKENS_PER_DECISION = 100_000
MAX_OUTPUT_TOKENS = 4096
MAX_TURNS = 16
MAX_ROWS = 50
MAX_CELL_CHARS = 400
MAX_RETRIEVED = 20
# Recipe settings a planner may change, each one factor. Nothing here names a path, a
# command, a backend or a model: those stay with the humans who own the project spec.
ALLOWED_KEYS = (
    "grpo.steps", "grpo.lr", "grpo.clip_low", "grpo.clip_high", "grpo.kl_coef",
    "grpo.kl_estimator", "grpo.loss_agg", "grpo.normalize_std", "grpo.ppo_epochs",
    "grpo.grad_clip", "grpo.max_response_tokens", "grpo.temperature", "grpo.top_p",
    "grpo.group_size", "grpo.prompts_per_step", "reward.components", "group_filter",
    "environment.max_turns", "environment.tools", "seeds",
)
PROMPTS = Path(__file__).resolve().parent / "prompts"
SPLITS = ("train", "val")

_STR = {"type": "string"}
# Versions, skills and harness revisions: the specs' own name rule (no '/', no '..').
_NAME = json.loads((builtin_dir("spec/schemas") / "common.schema.json").read_text(
    encoding="utf-8"))["$defs"]["name"]


def _inputs(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    """A tool's input schema: these properties only."""
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    return {**schema, "required": list(required)} if required else schema


TOOLS: list[dict[str, Any]] = [
    {"name": "get_lineage", "description": "Every version: parent, status, Avg@k, delta to "
     "the parent with its CI (at the recorded confidence), alerts, verdict, the skills "
     "it applied and why.",
     "input_schema": _inputs({})},
    {"name": "get_diagnosis", "description": "A version's recorded diagnosis: metric values "
     "and trends by layer, fired alerts with example rollout ids, open gaps.",
     "input_schema": _inputs({"version": _NAME}, "version")},
    {"name": "get_harness", "description": "The harness revision in force (or a named one): "
     "metrics with their SQL, alerts with thresholds, gate rules.",
     "input_schema": _inputs({"name": _NAME})},
    {"name": "search_skills", "description": "Skills ranked by relevance to a text query.",
     "input_schema": _inputs({"query": _STR}, "query")},
    {"name": "get_skill", "description": "One skill: trigger, mechanism, criterion, evidence, "
     "and what its (relative) patch would change on the frontier's recipe.",
     "input_schema": _inputs({"name": _NAME}, "name")},
    {"name": "query_rollouts", "description": "One read-only DuckDB SELECT over a version's "
     "stored rollouts (views: rollouts = the split, all_rollouts, steps). At most 50 rows; "
     "long text is cut. Columns: version, seed, step, split, task_id, group_id, sample_idx, "
     "prompt, response, reward, reward_components, correct, response_tokens, truncated, "
     "finish_reason, turns, tool_calls, mean_logprob.",
     "input_schema": _inputs({"version": _NAME, "sql": _STR, "split": {"enum": list(SPLITS)}},
                             "version", "sql")},
    {"name": "backtest_filter", "description": "Replay a group filter (from a filter skill, "
     "or by name and params) over a version's stored train groups.",
     "input_schema": _inputs({"version": _NAME, "skill": _NAME, "filter": _STR,
                              "params": {"type": "object"}}, "version")},
    {"name": "backtest_reward", "description": "Re-score a version's stored train rollouts "
     "with reward + weight × component (from a reward skill, or given).",
     "input_schema": _inputs({"version": _NAME, "skill": _NAME, "component": _STR,
                              "weight": {"type": "number"}}, "version")},
    {"name": "retrieve", "description": "What the project's memory holds: past decisions "
     "(this and other workspaces, other domains too), recurring alert patterns with what was "
     "tried, skills and the evidence they cite. Ranked by shared alerts and metrics, then "
     "text; in-domain first. Each result has a `cite` to put in a proposal's `cites`.",
     "input_schema": _inputs({
         "query": _STR, "alerts": {"type": "array", "items": _STR, "maxItems": 20},
         "metrics": {"type": "array", "items": _STR, "maxItems": 20}, "domain": _STR,
         "limit": {"type": "integer", "minimum": 1, "maximum": MAX_RETRIEVED}})},
    {"name": "propose_version", "description": "Propose one new policy version (an "
     "unapproved branch): one factor — one skill, or settings of one allowed recipe key — "
     "on a parent that did not fail, with a falsifiable CEL criterion; `cites`: the "
     "`retrieve` citations the proposal rests on.",
     "input_schema": _inputs({
         "parent": _NAME,
         "skills": {"type": "array", "items": _NAME},
         "settings": {"type": "object", "description": "dotted recipe key → value"},
         "rationale": _STR, "hypothesis": _STR, "criterion": _STR,
         "cites": {"type": "array", "items": _STR, "maxItems": MAX_RETRIEVED}},
         "parent", "rationale", "hypothesis", "criterion")},
    {"name": "propose_harness_revision", "description": "Propose a harness revision: the "
     "revision in force plus new metrics (SQL, a registered analyzer, or one of the "
     "`analyzers` it declares: {name, inputs, output: {kind}, rows, sql | python}, python "
     "being one standard-library function f(rows, params) run in the sandbox) and alerts, "
     "with backtest cases ({version, expect}). It is backtested on every recorded version; "
     "failing cases reject it.",
     "input_schema": _inputs({
         "metrics": {"type": "array", "items": {"type": "object"}},
         "alerts": {"type": "array", "items": {"type": "object"}},
         "analyzers": {"type": "array", "items": {"type": "object"}, "maxItems": 3},
         "backtest_cases": {"type": "array", "items": {"type": "object"}},
         "rationale": _STR},
         "metrics", "rationale")},
    {"name": "propose_gate_revision", "description": "Propose a revision of the gate's "
     "procedure: the revision in force with the gate fields given here changed (alpha, "
     "min_delta, ci_method, resamples, strata, compare_with, correction, rules; a rule may "
     "read `strata`, each data_source's {data_source, n_tasks, delta, ci_low, ci_high, "
     "p_value}). It is backtested on every recorded version, its cases the recorded "
     "verdicts; the answer lists the verdicts it flips, and a revision that flips one waits "
     "for a reviewer. More resamples make an interval's ends exact, not the interval "
     "narrower: only more seeds or tasks do.",
     "input_schema": _inputs({**GATE_SCHEMA["properties"], "rationale": _STR}, "rationale")},
]
INPUT_VALIDATORS = {tool["name"]: jsonschema.Draft202012Validator(tool["input_schema"])
                    for tool in TOOLS}


def untrusted(payload: Any) -> str:
    """Tool output as a data block: JSON with `<` and `>` escaped, so nothing inside can
    close the block or open another one."""
    text = json.dumps(payload, ensure_ascii=False, default=str)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e")
    return f"<untrusted-data>\n{text}\n</untrusted-data>"


def render(template: str, **values: Any) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(PROMPTS),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template(template).render(**values)


def tokens_spent(view: View) -> int:
    """LLM tokens recorded in the proposals on every version branch, one count per decision."""
    decisions: dict[str, int] = {}
    for state in view.states.values():
        proposal = (state.spec or {}).get("proposal") or {}
        if proposal.get("decision"):
            decisions[proposal["decision"]] = int(proposal.get("tokens") or 0)
    return sum(decisions.values())


class AnthropicPlanner:
    name = "anthropic"

    def __init__(self, client: Any = None) -> None:
        self.client = client

    def _client(self) -> Any:
        if self.client is not None:
            return self.client
        try:
            import anthropic
        except ImportError:
            raise EvoError("the anthropic planner needs the Anthropic SDK",
                           hint="pip install 'evotrainer[anthropic]', or use --planner rules"
                           ) from None
        key = os.environ.get("ANTHROPIC_API_KEY")
        if not key:
            raise EvoError("ANTHROPIC_API_KEY is not set", field="planner.name",
                           hint="export ANTHROPIC_API_KEY=... (the key is read from the "
                           "environment only and never written), or use --planner rules")
        # ANTHROPIC_BASE_URL, when set, points the SDK at another endpoint (tests: loopback).
        return anthropic.Anthropic(api_key=key)

    def budget(self, view: View) -> int:
        per_decision = int(view.planner_config.get("max_tokens_per_decision")
                           or DEFAULT_TOKENS_PER_DECISION)
        total = view.autonomy.get("max_llm_tokens")
        if total is None:
            return per_decision
        return max(0, min(per_decision, int(total) - tokens_spent(view)))

    def propose(self, view: View, max_proposals: int) -> PlannerResult:
        budget = self.budget(view)
        result = PlannerResult()
        if budget <= 0:
            result.notes.append("LLM token budget (autonomy.max_llm_tokens) is spent")
            return result
        client = self._client()
        frontier = view.frontier()
        streak = view.failure_streak()
        escalation = ""
        if len(streak) >= view.escalate_after():
            escalation = (f"{len(streak)} consecutive failed versions ({', '.join(streak)}); "
                          f"the last good version is {frontier}.")
        recipe = view.ws.resolved_recipe(frontier, view.states)
        system = render("system.j2", project=view.ws.project.get("name", "?"),
                        domain=recipe["domain"]["name"], escalation=escalation,
                        allowed_keys=ALLOWED_KEYS, max_proposals=max_proposals)
        children = [c for c in view.children(frontier) if view.verdict(c)]
        prompt = render("decision.j2", frontier=frontier, harness=view.harness.name,
                        streak=streak, budget=budget, children=children,
                        refuted=sorted(view.refuted_skills(frontier)))
        tools = _Tools(view, frontier, max_proposals)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        model = view.planner_config.get("model") or DEFAULT_MODEL
        used = last_input = 0
        for _ in range(MAX_TURNS):
            # The next request re-sends everything so far: it costs at least the last input.
            if used + last_input + 1 > budget:
                result.notes.append(f"stopped at the token budget ({used} of {budget} used)")
                break
            response = self._call(client, model=model, system=system, tools=TOOLS,
                                  messages=messages,
                                  max_tokens=max(1, min(MAX_OUTPUT_TOKENS,
                                                        budget - used - last_input)))
            last_input = int(response.usage.input_tokens)
            used += last_input + int(response.usage.output_tokens)
            content = [block.model_dump(exclude_none=True) for block in response.content]
            messages.append({"role": "assistant", "content": content})
            calls = [b for b in response.content if b.type == "tool_use"]
            if not calls:
                result.notes += [b.text for b in response.content if b.type == "text"]
                break
            messages.append({"role": "user", "content": [tools.run(call) for call in calls]})
        else:
            result.notes.append(f"stopped after {MAX_TURNS} turns")
        decision = uuid.uuid4().hex[:12]
        for proposal in tools.proposals:
            proposal.proposal.update(planner="anthropic", model=model, tokens=used,
                                     decision=decision)
        result.proposals, result.harness, result.tokens = tools.proposals, tools.harness, used
        result.notes += tools.rejected
        return result

    @staticmethod
    def _call(client: Any, **request: Any) -> Any:
        try:
            return client.messages.create(**request)
        except Exception as err:  # the SDK's errors share no base class we may import eagerly
            if type(err).__module__.startswith("anthropic"):
                raise EvoError(f"the Anthropic API call failed: {type(err).__name__}: {err}",
                               hint="check ANTHROPIC_API_KEY and the network, or use "
                               "--planner rules") from None
            raise


class _Tools:
    """Executes one decision's tool calls; keeps what the write tools accepted."""

    def __init__(self, view: View, frontier: str, max_proposals: int) -> None:
        self.view, self.frontier, self.max_proposals = view, frontier, max_proposals
        self.proposals: list[Proposal] = []
        self.harness: list[HarnessProposal] = []
        self.rejected: list[str] = []
        self.backtests: dict[str, dict] = {}  # skill → the last backtest of it
        self.trace = SearchTrace()  # every retrieve call of this decision

    def run(self, call: Any) -> dict[str, Any]:
        handler = getattr(self, f"tool_{call.name}", None)
        try:
            if handler is None or call.name not in INPUT_VALIDATORS:
                raise EvoError(f"unknown tool {call.name!r}")
            arguments = {} if call.input is None else call.input
            check_input(call.name, arguments)
            payload = handler(**arguments)
            return {"type": "tool_result", "tool_use_id": call.id, "content": untrusted(payload)}
        except (EvoError, TypeError, ValueError) as err:
            if call.name.startswith("propose_"):
                self.rejected.append(f"rejected {call.name}: {err}")
            return {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                    "content": untrusted({"error": str(err)})}

    # ---- read ------------------------------------------------------------------------

    def tool_get_lineage(self) -> list[dict]:
        rows = []
        for row in lineage_rows(self.view.ws, self.view.states):
            spec = self.view.states[row.name].spec or {}
            intervention = spec.get("intervention") or {}
            rows.append({**row.as_dict(), "skills": intervention.get("skills") or [],
                         "rationale": intervention.get("rationale"),
                         "recipe_overrides": spec.get("recipe") or {}})
        return rows

    def tool_get_diagnosis(self, version: str) -> dict:
        state = self.view.ws.version(version, self.view.states)
        # The records go to the model as recorded (the harness and gaps included), so this
        # tool reads the YAML documents rather than their typed views.
        diagnosis = state.records.get("diagnosis")
        if not diagnosis:
            raise EvoError(f"{version} has no diagnosis yet")
        decision = state.records.get("decision") or {}
        return {"version": version, "harness": diagnosis.get("harness"),
                "metrics": diagnosis.get("metrics"), "alerts": diagnosis.get("alerts"),
                "gaps": diagnosis.get("gaps"),
                "decision": {k: decision.get(k)
                             for k in ("verdict", "reason", "blocked_by", "criterion")}}

    def tool_get_harness(self, name: str | None = None) -> dict:
        harness = self._named_harness(name) if name else self.view.harness
        return {"name": harness.name, "description": harness.description,
                "metrics": [{"name": m.name, "layer": m.layer, "split": m.split, "sql": m.sql,
                             "analyzer": m.analyzer, "description": m.description}
                            for m in harness.metrics],
                "alerts": [{"name": a.name, "metric": a.metric,
                            "levels": [vars(lv) for lv in a.levels]} for a in harness.alerts],
                "gate": [vars(r) for r in harness.gate_rules]}

    def _named_harness(self, name: str) -> HarnessRevision:
        """`harness_revisions/<name>.yaml` of the workspace (a link must stay inside it), else
        the built-in revision of that name."""
        root = self.view.ws.root.resolve()
        path = root / harness_file(name)
        if path.is_symlink() or path.exists():
            resolved = path.resolve()
            if not resolved.is_relative_to(root):
                raise EvoError(f"{harness_file(name)} links outside the workspace")
            return load_harness(resolved)
        builtin = builtin_dir(HARNESS_FOLDER) / f"{name}.yaml"
        if builtin.is_file():
            return load_harness(builtin)
        raise EvoError(f"no harness revision named {name!r}",
                       hint=f"known: {', '.join(self.view.ws.harness_names()) or 'h0'}")

    def tool_search_skills(self, query: str) -> list[dict]:
        return [{"name": s.name, "title": s.title, "category": s.category,
                 "trigger": s.trigger, "criterion": s.data.get("criterion"),
                 "negative": s.negative, "support": len(s.evidence),
                 "against": len(s.negative_evidence), "score": round(score, 3)}
                for s, score in search(self.view.skills, query)[:8]]

    def tool_get_skill(self, name: str) -> dict:
        skill = get_skill(self.view.skills, name)
        resolution = resolve_skill(skill, self.view.ws.resolved_recipe(self.frontier,
                                                                       self.view.states))
        # The mechanism's operations are relative; the concrete values say what a version
        # from the frontier would record.
        return {**skill.data, "on_frontier": {
            "changes": [c.as_dict() for c in resolution.changes],
            "no_change": None if resolution.changes else resolution.reason}}

    def tool_query_rollouts(self, version: str, sql: str, split: str = "train") -> dict:
        check_select(sql, field="sql")
        state = self.view.ws.version(version, self.view.states)
        if state.run is None or not state.run.artifact_dir:
            raise EvoError(f"{version} has no recorded run")
        run_dir = self.view.ws.run_dir(version, state.records["run"])
        table = read_rollouts(RunArtifacts(run_dir).rollouts_dir)
        # ReadOnlyQuery locks DuckDB down before it registers anything, and the split (checked
        # against the tool's schema) reaches it as the filtered rows, never as SQL text.
        connection = ReadOnlyQuery(table, None, split, timeout_s=10.0)
        try:
            columns, rows = connection.query(f"SELECT * FROM ({sql}) LIMIT {MAX_ROWS + 1}", {},
                                             field="sql")
        finally:
            connection.close()
        return {"columns": columns, "rows": [[_cell(v) for v in r] for r in rows[:MAX_ROWS]],
                "truncated": len(rows) > MAX_ROWS}

    def tool_backtest_filter(self, version: str, skill: str | None = None,
                             filter: str | None = None, params: dict | None = None) -> dict:
        if skill:
            filter, params = skill_filter(get_skill(self.view.skills, skill))
        if not filter:
            raise EvoError("name a filter skill or a filter")
        report = backtest_filter(version_rollouts(self.view.ws, version), filter, params or {})
        return self._keep(skill, {"version": version, "kind": "filter", **report})

    def tool_backtest_reward(self, version: str, skill: str | None = None,
                             component: str | None = None, weight: float | None = None) -> dict:
        if skill:
            component, weight = skill_reward(get_skill(self.view.skills, skill))
        if not component or weight is None:
            raise EvoError("name a reward skill, or a component and a weight")
        domain = self.view.ws.resolved_recipe(version, self.view.states)["domain"]
        report = backtest_reward(version_rollouts(self.view.ws, version), component,
                                 float(weight), domain)
        return self._keep(skill, {"version": version, "kind": "reward", **report})

    def tool_retrieve(self, query: str = "", alerts: list | None = None,
                      metrics: list | None = None, domain: str | None = None,
                      limit: int = 8) -> list[dict]:
        asked = Query(text=query, alerts=tuple(alerts or ()), metrics=tuple(metrics or ()),
                      domain=domain or self.view.ws.resolved_recipe(
                          self.frontier, self.view.states)["domain"]["name"])
        if not (asked.text.strip() or asked.alerts or asked.metrics):
            raise EvoError("give a query, alerts or metrics to look for")
        found = retrieve(self.view.ws, asked, limit, trace=self.trace, states=self.view.states)
        return [r.as_dict() for r in found]

    def _keep(self, skill: str | None, report: dict) -> dict:
        if skill:
            self.backtests[skill] = report
        return report

    # ---- write -----------------------------------------------------------------------

    def tool_propose_version(self, parent: str, rationale: str, hypothesis: str,
                             criterion: str, skills: list | None = None,
                             settings: dict | None = None, cites: list | None = None) -> dict:
        view = self.view
        if len(self.proposals) >= self.max_proposals:
            raise EvoError(f"at most {self.max_proposals} proposal(s) per decision")
        cites = [str(c) for c in cites or []]
        unknown_cites = [c for c in cites if c not in self.trace.cites()]
        if unknown_cites:
            raise EvoError(f"cites {unknown_cites[0]!r}, which no retrieve call of this "
                           "decision returned; cite a retrieved item's `cite` as given")
        state = view.ws.version(parent, view.states)
        skills = [str(s) for s in skills or []]
        settings = dict(settings or {})
        factors = {_factor(key) for key in settings}
        if len(factors) > 1:
            raise EvoError("one factor per version: settings of one allowed key "
                           f"(got keys {sorted(factors)})")
        # The proposal policy every planner's proposals pass (failed parent, negative and
        # refuted skills, one factor), asked here too so the model hears why at once.
        violation = policy_violation(view, Proposal(parent, rationale, skills=skills,
                                                    settings=sorted(settings)))
        if violation:
            raise EvoError(violation, hint=f"the frontier is {self.frontier}")
        parent_recipe = view.ws.resolved_recipe(parent, view.states)
        for name in skills:
            skill = get_skill(view.skills, name)
            if skill.unbound:
                # Its setting is what its trigger names on a diagnosis; this tool has none.
                raise EvoError(f"skill {name!r} acts on what its trigger binds "
                               f"({', '.join(skill.bind)}); write that change as settings")
            resolution = resolve_skill(skill, parent_recipe)
            if not resolution.changes:
                raise EvoError(f"skill {name!r} changes nothing on {parent}'s recipe "
                               f"({resolution.reason}); pick another factor")
        for text in (rationale, hypothesis, criterion):
            if not isinstance(text, str) or not text.strip():
                raise EvoError("rationale, hypothesis and criterion must be non-empty text")
        cel.check(criterion)
        known = {m.name for m in view.harness.metrics} | GATE_VARIABLES
        unknown = sorted(cel.names(criterion) - known)
        if unknown:
            raise EvoError(f"criterion reads unknown name(s) {unknown}",
                           hint="use metrics of the harness in force or gate variables")
        overrides: dict = {}
        lines = []
        for key, value in settings.items():
            set_dotted(overrides, key, value)
            lines.append(f"{key}={json.dumps(value)}")
        # The spec as it would be written, checked against the PolicyVersion schema.
        probe = {"apiVersion": API_VERSION, "kind": "PolicyVersion", "name": "proposal",
                 "parent": state.name, "recipe": overrides,
                 "intervention": {"skills": skills, "factors": len(skills) + len(lines),
                                  "rationale": rationale,
                                  "hypothesis": {"statement": hypothesis,
                                                 "criterion": criterion}}}
        specs.load_text(specs.dump(probe), "propose_version input", "PolicyVersion")
        parent_diagnosis = state.records.get("diagnosis") or {}
        values = metric_values(parent_diagnosis)
        meta: dict[str, Any] = {
            "frontier": self.frontier,
            "trigger": {"alerts": [a["name"] for a in parent_diagnosis.get("alerts") or []],
                        "values": {n: values[n] for n in sorted(cel.names(criterion))
                                   if n in values}},
        }
        backtests = [self.backtests[s] for s in skills if s in self.backtests]
        if backtests:
            meta["backtest"] = backtests[0]
        if self.trace.entries:
            meta["retrieval"] = self.trace.as_list()
        rationale = rationale.strip()
        if cites:
            meta["cites"] = cites
            rationale += " Cites: " + "; ".join(cites) + "."
        self.proposals.append(Proposal(parent, rationale, skills=skills,
                                       settings=lines, hypothesis=hypothesis.strip(),
                                       criterion=criterion.strip(), proposal=meta))
        return {"accepted": True, "parent": parent, "skills": skills, "settings": lines}

    def tool_propose_harness_revision(self, metrics: list, rationale: str,
                                      alerts: list | None = None,
                                      backtest_cases: list | None = None,
                                      analyzers: list | None = None) -> dict:
        view = self.view
        if self.harness:
            raise EvoError("one harness revision per decision")
        if not 1 <= len(metrics) <= 3:
            raise EvoError("add one to three metrics per revision")
        base = in_force_document(view)
        name = next_name(view.ws.harness_names(), "h")
        document = {**base, "name": name, "parent": view.harness.name,
                    "description": f"{view.harness.name} plus "
                    f"{', '.join(str(m.get('name')) for m in metrics)}: {rationale}",
                    "metrics": [*base.get("metrics", []), *metrics],
                    "alerts": [*base.get("alerts", []), *(alerts or [])],
                    "backtest_cases": list(backtest_cases or [])}
        if analyzers:  # checked like any revision's: contract, SQL lockdown, Python load check
            document["analyzers"] = [*base.get("analyzers", []), *analyzers]
        revision = parse_harness(document, source=f"proposed {harness_file(name)}")
        report = backtest_harness(view.ws, revision, view.harness)
        if not report["passed"]:
            failed = [c for c in report["cases"] if not c["passed"]]
            raise EvoError(f"backtest cases fail: {failed}")
        self.harness.append(HarnessProposal(document, rationale.strip(), report))
        return {"accepted": True, "name": name, "backtest": report}

    def tool_propose_gate_revision(self, rationale: str, **changes: Any) -> dict:
        if self.harness:
            raise EvoError("one harness revision per decision")
        if not rationale.strip():
            raise EvoError("the rationale must be non-empty text")
        proposal = gate_revision(self.view, changes, rationale.strip())
        self.harness.append(proposal)
        return {"accepted": True, "name": proposal.name, "flips": flipped(proposal.backtest),
                "backtest": proposal.backtest}


def check_input(tool: str, arguments: Any) -> None:
    """EvoError unless `arguments` match the tool's input schema."""
    error = jsonschema.exceptions.best_match(INPUT_VALIDATORS[tool].iter_errors(arguments))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "input"
        raise EvoError(f"{where} does not match the tool's input schema: {error.message}")


def _factor(key: str) -> str:
    """The allowed key a dotted setting falls under (its factor), or a policy error."""
    for allowed in ALLOWED_KEYS:
        if key == allowed or key.startswith(allowed + "."):
            return allowed
    raise EvoError(f"recipe key {key!r} is not one a planner may change",
                   hint=f"allowed: {', '.join(ALLOWED_KEYS)}")


def _cell(value: Any) -> Any:
    if isinstance(value, (str, bytes)):
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + "…"
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return _cell(json.dumps(value, default=str))
