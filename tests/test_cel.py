import lark
import pytest

from evotrainer.errors import EvoError
from evotrainer.store import cel


def test_evaluate_plain_values():
    assert cel.evaluate("x > 0.3 && name == 'a'", {"x": 0.5, "name": "a"}) is True
    assert cel.evaluate("x > 50", {"x": 60.0}) is True  # double vs int literal compares
    assert cel.evaluate("parent.x < x", {"x": 2.0, "parent": {"x": 1.0}}) is True
    assert cel.evaluate("[1, 2].map(v, v * 2)", {}) == [2, 4]
    assert cel.evaluate("'leak' in alerts", {"alerts": ["leak"]}) is True


def test_the_same_expression_over_the_same_values_is_evaluated_once(monkeypatch):
    """Results are kept per expression and values as CEL receives them: an int and a double,
    a bool and an int, or one map in two key orders are other values; a kept list is the
    caller's own copy; values JSON cannot carry exactly are evaluated every time."""
    evaluated = []
    real = cel._evaluate
    monkeypatch.setattr(cel, "_evaluate", lambda e, v: (evaluated.append(v), real(e, v))[1])
    cel._EVALUATED.clear()
    assert cel.evaluate("x / 2", {"x": 3, "unread": 1}) == 1
    assert cel.evaluate("x / 2", {"x": 3, "unread": 2}) == 1  # what it does not read
    with pytest.raises(EvoError, match="failed"):  # a double over an int: no overload
        cel.evaluate("x / 2", {"x": 3.0})
    assert cel.evaluate("type(x) == bool", {"x": True}) is True
    assert cel.evaluate("type(x) == bool", {"x": 1}) is False
    assert cel.evaluate("m.map(k, k)", {"m": {"a": 1, "b": 2}}) == ["a", "b"]
    assert cel.evaluate("m.map(k, k)", {"m": {"b": 2, "a": 1}}) == ["b", "a"]
    first = cel.evaluate("x.map(v, v * 2)", {"x": [1, 2]})
    first.append(99)
    assert cel.evaluate("x.map(v, v * 2)", {"x": (1, 2)}) == [2, 4]
    assert len(evaluated) == 7
    assert cel.evaluate("size(m)", {"m": {1: "a", "b": 2}}) == 2  # a key CEL makes a string
    assert cel.evaluate("size(m)", {"m": {1: "a", "b": 2}}) == 2
    assert len(evaluated) == 9


def test_the_order_names_are_passed_in_does_not_change_what_is_kept(monkeypatch):
    """The same names with the same values, passed in another order (as
    `evaluate_unless_null` binds a frozenset's names), are the same values."""
    evaluated = []
    real = cel._evaluate
    monkeypatch.setattr(cel, "_evaluate", lambda e, v: (evaluated.append(v), real(e, v))[1])
    cel._EVALUATED.clear()
    assert cel.evaluate("x + y", {"x": 1, "y": 2}) == 3
    assert cel.evaluate("x + y", {"y": 2, "x": 1}) == 3
    assert evaluated == [{"x": 1, "y": 2}]


def test_a_failure_is_kept_like_a_value(monkeypatch):
    """An evaluation that fails over some values fails again over the same values without
    being evaluated, with the same error (a fresh one each time), and `evaluate_unless_null`
    still reads it as undecided."""
    evaluated = []
    real = cel._evaluate
    monkeypatch.setattr(cel, "_evaluate", lambda e, v: (evaluated.append(v), real(e, v))[1])
    cel._EVALUATED.clear()
    errors = []
    for _ in range(2):
        with pytest.raises(EvoError, match="failed") as raised:
            cel.evaluate("x > 0.0 || y > 0.0", {"x": 0.0, "y": None})
        errors.append(raised.value)
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])
    assert cel.evaluate_unless_null("x > 0.0 || y > 0.0", {"x": 0.0, "y": None}) is None
    # Each operand once (neither decides: one is false, one fails), then the whole once.
    assert evaluated == [{"x": 0.0}, {"y": None}, {"x": 0.0, "y": None}]
    costly = "xs.all(a, xs.all(b, a + b >= 0))"
    for _ in range(2):  # a kept failure keeps its kind: never read as undecided
        with pytest.raises(cel.CostExceeded):
            cel.evaluate_unless_null(costly, {"xs": list(range(2000))})
    assert len(evaluated) == 4


def test_null_comparison_fails_but_or_absorbs_it():
    with pytest.raises(EvoError, match="failed"):
        cel.evaluate("x > 1.0", {"x": None})
    assert cel.evaluate("x > 0.05 || y > 50.0", {"x": None, "y": 60.0}) is True


def test_a_macro_over_null_is_an_evoerror_and_undecided_where_a_map_lacks_it():
    with pytest.raises(EvoError, match="failed"):
        cel.evaluate("x.filter(c, c > 1)", {"x": None})
    assert cel.evaluate_unless_null("recipe.reward.components.map(c, c.name)",
                                    {"recipe": {"reward": {"components": None}}}) is None


def test_bad_expression_is_an_evoerror():
    with pytest.raises(EvoError, match="invalid CEL expression"):
        cel.check("x >")
    with pytest.raises(EvoError, match="empty"):
        cel.check("  ")


def test_names_excludes_macro_variables_and_functions():
    names = cel.names("parent.x < x && size(alerts) > 0 && [1].exists(v, v > y)")
    assert names == {"parent", "x", "alerts", "y"}


def test_members_tested_are_the_strings_a_list_is_tested_for_and_nothing_else():
    """members_tested: `'leak' in critical` (parenthesised, escaped, raw or triple-quoted
    strings alike) tests the list for those names; any other read of the list (its size,
    an element, a macro over it, a name that is not a literal) is None."""
    tested = cel.members_tested
    assert tested("'leak' in critical && x > 1", "critical") == {"leak"}
    assert tested("'leak' in critical || ('tamper' in (critical))", "critical") == {
        "leak", "tamper"}
    assert tested(r"""'a\'b' in critical || r'\d' in critical || '''m''' in critical""",
                  "critical") == {"a'b", "\\d", "m"}
    assert tested("x > 1", "critical") == frozenset()
    for other in ("size(critical) > 0", "'a' in critical && size(critical) > 1",
                  "critical[0] == 'a'", "critical.exists(c, c == 'a')", "x in critical",
                  "critical == ['a']", "1 in critical"):
        assert tested(other, "critical") is None, other


def test_fields_read_are_the_fields_a_map_is_read_by_and_nothing_else():
    """fields_read: `latest.x` (nested, parenthesised, under has()) reads the map's field
    x; any other read of the map (itself, its size, an index, a macro over it, a macro
    variable of the same name) is None."""
    read = cel.fields_read
    assert read("rows >= params.n && latest.a >= 1.0 && latest.b > -0.05", "latest") == {
        "a", "b"}
    assert read("rows >= params.n && latest.a >= 1.0", "params") == {"n"}
    assert read("latest.a.b > 1 && has(latest.c) && (latest).d > 0", "latest") == {
        "a", "c", "d"}
    assert read("rows > 1", "latest") is None  # not read at all
    for other in ("size(latest) > 0 && latest.x > 1", "latest['x'] > 1",
                  "xs.all(latest, latest.x > 0)", "latest == {}", "latest.exists(k, k == 'a')"):
        assert read(other, "latest") is None, other


def test_an_expression_reads_only_the_fields_it_names(monkeypatch):
    """Two maps that differ only in fields an expression does not read give one
    evaluation: a rule over `latest.dead` is not evaluated again because another metric
    moved."""
    evaluated = []
    real = cel._evaluate
    monkeypatch.setattr(cel, "_evaluate", lambda e, v: (evaluated.append(v), real(e, v))[1])
    cel._EVALUATED.clear()
    rule = "latest.dead >= 1.0"
    assert cel.evaluate(rule, {"latest": {"dead": 1.0, "other": 0.1}}) is True
    assert cel.evaluate(rule, {"latest": {"dead": 1.0, "other": 0.2}}) is True
    assert evaluated == [{"latest": {"dead": 1.0}}]
    with pytest.raises(EvoError, match="failed"):  # an absent field is absent still
        cel.evaluate(rule, {"latest": {"other": 0.2}})


def test_an_operand_that_decides_a_chain_decides_it_without_the_others(monkeypatch):
    """`a && b` with one false operand is false, and `a || b` with one true operand true,
    whatever the other (an error included): an operand whose result is kept decides first,
    and the others are not evaluated."""
    evaluated = []
    real = cel._evaluate
    monkeypatch.setattr(cel, "_evaluate", lambda e, v: (evaluated.append(e), real(e, v))[1])
    cel._EVALUATED.clear()
    rule = "rows >= 100 && latest.dead >= 1.0"
    assert cel.evaluate(rule, {"rows": 120, "latest": {"dead": 0.5}}) is False
    evaluated.clear()
    for rows in (130, 140, 150):  # the kept `latest.dead >= 1.0` decides each one
        assert cel.evaluate(rule, {"rows": rows, "latest": {"dead": 0.5}}) is False
    assert evaluated == []
    assert cel.evaluate("x > 1.0 || y > 1", {"x": None, "y": 2}) is True
    assert cel.evaluate("x > 1.0 && false", {"x": None}) is False
    with pytest.raises(EvoError, match="failed"):
        cel.evaluate("x > 1.0 && true", {"x": None})


def test_a_chain_decided_by_its_operands_equals_the_whole_evaluated():
    """The value `evaluate` gives an `&&` or `||` chain from its operands is the value, or
    the failure, of the whole expression evaluated at once, over values of every kind:
    bools, numbers, nulls, strings, absent fields, non-bool operands, and after operands'
    results are kept from other values."""
    import itertools

    expressions = [
        "a > 1.0 && b > 1.0", "a > 1.0 || b > 1.0", "a > 1.0 && b > 1.0 && c",
        "a > 1.0 || b > 1.0 || c", "c && a > 1.0 || b > 1.0", "(a > 1.0 || c) && b > 1.0",
        "m.x > 1.0 && m.y > 1.0", "m.x > 1.0 || c", "a && true", "false && a", "a || b",
        "c || a", "'k' in s && a > 1.0", "a > 1.0 ? c : false", "size(s) > 0 && c",
        "s.exists(v, v == 'k') && c", "a / b > 1.0 && c", "int(a) > 1 || c",
    ]
    values = [None, True, False, 0.5, 3, "s"]
    cases = []
    for a, b, c in itertools.product(values, repeat=3):
        cases.append({"a": a, "b": b, "c": c, "m": {"x": a, "y": b}, "s": ["k"] if c else []})
    cases.append({"a": 2.0, "b": 2.0, "c": True, "m": {"x": 2.0}, "s": None})
    for expr in expressions:
        for variables in cases:
            try:
                whole = ("value", cel._evaluate(expr, variables))
            except EvoError:
                whole = ("fails", None)
            try:
                split = ("value", cel.evaluate(expr, variables))
            except EvoError:
                split = ("fails", None)
            assert split == whole, (expr, variables)
            assert type(split[1]) is type(whole[1]), (expr, variables)


def test_nested_macros_bind_their_own_variables():
    expr = "xs.all(x, x.ys.exists(y, y > t))"
    assert cel.names(expr) == {"xs", "t"}
    assert cel.evaluate(expr, {"xs": [{"ys": [1, 5]}, {"ys": [4]}], "t": 3}) is True
    assert cel.evaluate(expr, {"xs": [{"ys": [1, 2]}, {"ys": [4]}], "t": 3}) is False
    assert cel.names("xs.map(x, ys.filter(y, y > x)).size() > 0") == {"xs", "ys"}


def test_loop_variable_is_bound_only_inside_its_macro():
    # A later top-level `x` is a real input: it must be reported (and checked) as one.
    assert cel.names("xs.exists(x, x > 0) && x > 1") == {"xs", "x"}
    assert cel.names("xs.all(x, x > 0) || ys.exists(y, x > 0)") == {"xs", "ys", "x"}


# ---- bounds: an expression from a branch cannot stall the controller ------

TWENTY = "[" + ",".join(str(i) for i in range(20)) + "]"


def _nested_all(levels: int) -> str:
    """The attack: `levels` nested .all() over 20-element literal lists (20**levels steps)."""
    names = "abcdefgh"[:levels]
    body = " + ".join(names) + " >= 0"
    for name in reversed(names):
        body = f"{TWENTY}.all({name}, {body})"
    return body


def test_nested_macros_past_the_limit_are_refused_before_any_evaluation():
    attack = _nested_all(4)
    assert len(attack) < 280  # as short as the report's: 54 s of evaluation before
    with pytest.raises(EvoError) as err:
        cel.check(attack)
    assert "nests 4 macros" in err.value.message and "at most 2" in err.value.message
    with pytest.raises(EvoError, match="nests 5 macros"):
        cel.evaluate(_nested_all(5), {})
    assert cel.evaluate(_nested_all(2), {}) is True  # 400 iterations: allowed


def test_evaluation_stops_at_its_step_budget_however_the_lists_grow():
    expr = "xs.all(a, xs.all(b, a + b >= 0))"  # two levels: allowed by shape
    assert cel.evaluate(expr, {"xs": list(range(20))}) is True
    with pytest.raises(cel.CostExceeded) as err:
        cel.evaluate(expr, {"xs": list(range(2000))})  # 4,000,000 iterations
    assert expr in err.value.message and f"{cel.MAX_STEPS:,} steps" in err.value.message
    # map and filter build lists from lists: counted the same way.
    with pytest.raises(cel.CostExceeded):
        cel.evaluate("size(xs.map(a, xs.filter(b, b > a))) > 0", {"xs": list(range(2000))})
    # The budget is per evaluation: the next one starts afresh.
    assert cel.evaluate(expr, {"xs": [1, 2]}) is True


def test_size_and_depth_are_bounded_with_one_clear_line():
    with pytest.raises(EvoError, match="characters"):
        cel.check(" || ".join(f"x > {i}.0" for i in range(200)))
    with pytest.raises(EvoError, match="nested too deeply"):
        cel.check("(" * 40 + "x" + ")" * 40)  # celpy's recursive walk would overflow
    assert cel.evaluate("(" * 5 + "x" + ")" * 5, {"x": 1}) == 1


def test_reduce_binds_both_of_its_variables():
    assert cel.names("xs.reduce(r, x, 0, r + x) > limit") == {"xs", "limit"}
    assert cel.evaluate("xs.reduce(r, x, 0, r + x) > 2", {"xs": [1, 2]}) is True


def test_a_harness_alert_nesting_too_deep_is_refused_at_load_naming_the_alert():
    from evotrainer.diagnosis.harness import parse_harness_text
    from evotrainer.store.builtin import builtin_dir

    text = (builtin_dir("harness_revisions") / "h0.yaml").read_text()
    first = next(line for line in text.splitlines() if line.strip().startswith("when:"))
    indent = first[: len(first) - len(first.lstrip())]
    attack = text.replace(first, f"{indent}when: \"{_nested_all(4)}\"", 1)
    with pytest.raises(EvoError) as err:
        parse_harness_text(attack, "harness_revisions/h1.yaml")
    assert err.value.where.startswith("harness_revisions/h1.yaml:")
    assert err.value.field.startswith("alerts[") and "nests 4 macros" in err.value.message


def test_an_alert_over_the_budget_fails_the_diagnosis_naming_the_alert():
    import copy

    import yaml

    from evotrainer.diagnosis.diagnose import diagnose
    from evotrainer.diagnosis.harness import parse_harness
    from evotrainer.evidence.synthetic import rollout_table
    from evotrainer.store.builtin import builtin_dir

    doc = yaml.safe_load((builtin_dir("harness_revisions") / "h0.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["params"]["grid"] = list(range(1000))
    metric = doc["metrics"][0]["name"]
    doc["alerts"].append({
        "name": "grid_sweep", "metric": metric, "severity": "warning",
        "when": "params.grid.exists(a, params.grid.exists(b, a + b < 0))",
        "message": "a million comparisons",
    })
    harness = parse_harness(doc, source="harness_revisions/h1.yaml")
    rows = rollout_table(
        [dict(step=1, group_id="g", sample_idx=i, reward=float(i % 2)) for i in range(4)])
    with pytest.raises(EvoError) as err:
        diagnose(rows, None, harness)
    assert err.value.where == "harness_revisions/h1.yaml"
    assert err.value.field == "alerts.grid_sweep.levels[0].when"
    assert "steps" in err.value.message


@pytest.fixture
def fresh_parser(monkeypatch):
    """celpy builds its one parser per process: each test here builds it anew, and the
    parser of the rest of the suite is put back after."""
    from celpy.celparser import CELParser

    kept = CELParser.CEL_PARSER
    monkeypatch.setattr(CELParser, "CEL_PARSER", None)
    cel._env.cache_clear()
    cel._compile.cache_clear()
    yield
    CELParser.CEL_PARSER = kept
    cel._env.cache_clear()
    cel._compile.cache_clear()


def test_parser_tables_are_kept_in_the_user_cache_and_read_back(fresh_parser, monkeypatch,
                                                                 tmp_path):
    from celpy.celparser import CELParser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = cel.parser_cache()
    assert cache is not None and cache.parent == tmp_path / "evotrainer"
    assert not cache.exists()
    first = cel._env().compile("x > 0.5 && [1].all(v, v > y)")
    assert cache.is_file()
    written = cache.read_bytes()

    CELParser.CEL_PARSER = None  # as a new process: the tables read, not built
    cel._env.cache_clear()
    with monkeypatch.context() as patch:
        patch.setattr(lark.Lark, "_build_parser", lambda self: pytest.fail("tables built"))
        assert cel._env().compile("x > 0.5 && [1].all(v, v > y)") == first
    assert cache.read_bytes() == written
    assert cel.evaluate("x > 0.5 && [1].all(v, v < y)", {"x": 0.75, "y": 2}) is True


def test_a_cache_folder_that_cannot_be_made_builds_the_parser_in_memory(fresh_parser,
                                                                        monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert cel.parser_cache() is None
    assert cel.evaluate("x > 0.5", {"x": 0.75}) is True
    with pytest.raises(EvoError, match="invalid CEL expression"):
        cel.check("x >")


class _Planted:
    """A pickle that, once loaded, leaves a file behind: the proof that it ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writable", ["folder", "file"])
def test_a_cache_another_user_could_write_is_not_loaded(fresh_parser, monkeypatch, tmp_path,
                                                        writable):
    """Lark unpickles its cache file: one in a folder, or a file, that others may write could
    run their code. A real parser cache's digest line followed by a planted pickle is left
    where group and others may write; the parser is then built in memory and the pickle
    never loads."""
    import os
    import pickle

    from celpy.celparser import CELParser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = cel.parser_cache()
    cel._env()  # a genuine cache file: its first line is the digest lark checks
    digest_line = cache.read_bytes().split(b"\n", 1)[0]
    marker = tmp_path / "planted-code-ran"
    cache.write_bytes(digest_line + b"\n" + pickle.dumps(_Planted(str(marker))))
    os.chmod(cache.parent if writable == "folder" else cache, 0o777 if writable == "folder"
             else 0o666)
    CELParser.CEL_PARSER = None  # as a new process
    cel._env.cache_clear()
    assert cel.evaluate("x > 0.5", {"x": 0.75}) is True
    assert not marker.exists()
