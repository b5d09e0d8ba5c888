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
