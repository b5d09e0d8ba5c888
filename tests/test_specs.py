import pytest

from evotrainer.errors import EvoError
from evotrainer.store.specs import load_text

GOOD = """\
apiVersion: evotrainer/v1
kind: PolicyVersion
name: v1
parent: v0
recipe:
  grpo:
    lr: 0.0003
"""


def error_of(text: str, kind: str = "PolicyVersion") -> EvoError:
    with pytest.raises(EvoError) as info:
        load_text(text, "v1.yaml", kind)
    return info.value


def test_valid_document_loads_with_positions():
    doc = load_text(GOOD, "v1.yaml", "PolicyVersion")
    assert doc.data["recipe"]["grpo"]["lr"] == 0.0003
    assert doc.where(("recipe", "grpo", "lr")) == "v1.yaml:7:9"


def test_unknown_key_names_position_and_suggests():
    err = error_of(GOOD.replace("    lr:", "    lrr:"))
    assert err.where == "v1.yaml:7:5"
    assert err.field == "recipe.grpo.lrr"
    assert "did you mean 'lr'" in err.hint


def test_wrong_type_names_expected_and_value():
    err = error_of(GOOD + "  seeds: one\n")
    assert err.field == "recipe.seeds"
    assert "expected array" in err.message and "'one'" in err.message


def test_enum_suggests_closest():
    err = error_of(GOOD + "  backend: verll\n")
    assert err.field == "recipe.backend" and "did you mean 'verl'" in err.hint


def test_group_size_one_is_rejected_with_reason():
    err = error_of(GOOD + "    group_size: 1\n")
    assert err.field == "recipe.grpo.group_size" and err.where == "v1.yaml:8:17"


def test_malformed_yaml_reports_line():
    err = error_of("apiVersion: evotrainer/v1\nkind: [PolicyVersion\nname: v1\n")
    assert err.where.startswith("v1.yaml:") and "malformed YAML" in err.message


def test_duplicate_key_rejected():
    err = error_of(GOOD + "name: v2\n")
    assert "duplicate key 'name'" in err.message and err.where == "v1.yaml:8:1"


def test_non_utf8_rejected():
    err = error_of(GOOD.encode() + b"# \xff\xfe\n")
    assert "UTF-8" in err.message


def test_missing_required_field():
    err = error_of(GOOD.replace("parent: v0\n", ""))
    assert "missing required field 'parent'" in err.message


def test_yaml_tags_are_not_executed():
    err = error_of(GOOD + "description: !!python/object/apply:os.system ['echo hi']\n")
    assert "malformed YAML" in err.message


def test_wrong_kind():
    err = error_of(GOOD, kind="Skill")
    assert err.field == "kind" and "Skill" in err.hint
