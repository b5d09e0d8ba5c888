import pytest

from evotrainer.diagnosis import cel
from evotrainer.errors import EvoError


def test_evaluate_plain_values():
    assert cel.evaluate("x > 0.3 && name == 'a'", {"x": 0.5, "name": "a"}) is True
    assert cel.evaluate("x > 50", {"x": 60.0}) is True  # double vs int literal compares
    assert cel.evaluate("parent.x < x", {"x": 2.0, "parent": {"x": 1.0}}) is True
    assert cel.evaluate("[1, 2].map(v, v * 2)", {}) == [2, 4]
    assert cel.evaluate("'leak' in alerts", {"alerts": ["leak"]}) is True


def test_null_comparison_fails_but_or_absorbs_it():
    with pytest.raises(EvoError, match="failed"):
        cel.evaluate("x > 1.0", {"x": None})
    assert cel.evaluate("x > 0.05 || y > 50.0", {"x": None, "y": 60.0}) is True


def test_bad_expression_is_an_evoerror():
    with pytest.raises(EvoError, match="invalid CEL expression"):
        cel.check("x >")
    with pytest.raises(EvoError, match="empty"):
        cel.check("  ")


def test_names_excludes_macro_variables_and_functions():
    names = cel.names("parent.x < x && size(alerts) > 0 && [1].exists(v, v > y)")
    assert names == {"parent", "x", "alerts", "y"}


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
