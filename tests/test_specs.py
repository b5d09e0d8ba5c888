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


# ---- bounded YAML ----------------------------------------------------------------------

BILLION_LAUGHS = "apiVersion: evotrainer/v1\nkind: PolicyVersion\nname: v1\nparent: v0\n" + "".join(
    f"{key}: &{key} [{', '.join([f'*{prev}'] * 9 if prev else ['lol'] * 9)}]\n"
    for prev, key in zip([None, *"abcdefgh"], "abcdefghi", strict=True)
)


def test_alias_bomb_is_rejected_before_it_expands():
    assert len(BILLION_LAUGHS) < 700  # 9**9 values once expanded
    err = error_of(BILLION_LAUGHS)
    # Only the count over the composed node graph says this: the values were never built.
    assert "expands to more than" in err.message and err.where.startswith("v1.yaml:")


def test_recursive_alias_is_rejected_with_position():
    err = error_of(GOOD + "loop: &loop [*loop]\n")
    assert "recursive YAML alias" in err.message and err.where == "v1.yaml:8:7"


def test_oversized_document_is_rejected():
    from evotrainer.store.specs import MAX_YAML_BYTES

    err = error_of(GOOD + "description: " + "x" * MAX_YAML_BYTES + "\n")
    assert "more than the" in err.message and err.where == "v1.yaml"


def test_deep_nesting_is_rejected():
    err = error_of(GOOD + "description: " + "[" * 200 + "]" * 200 + "\n")
    assert "nested deeper than" in err.message


def test_ordinary_aliases_still_work():
    from evotrainer.store.specs import load_yaml

    assert load_yaml("a: &x {b: 1}\nc: *x\n", "r.yaml") == {"a": {"b": 1}, "c": {"b": 1}}


def test_records_reader_is_bounded_too():
    from evotrainer.store.specs import load_yaml

    with pytest.raises(EvoError, match="expands to more than"):
        load_yaml(BILLION_LAUGHS, "runs/v1/run.yaml")


# ---- names are git ref names ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["x.lock", "a..b", "v1.", "-v1", "V1", "a" * 64])
def test_names_git_cannot_use_are_rejected(name):
    err = error_of(GOOD.replace("name: v1", f"name: {name!r}"))
    assert err.field == "name" and err.where == "v1.yaml:3:7" and "git branch name" in err.hint


@pytest.mark.parametrize("name", ["v1.2", "v1_lock", "a.locks", "a" * 63, "0"])
def test_names_git_accepts_pass(name):
    load_text(GOOD.replace("name: v1", f"name: {name!r}"), "v1.yaml", "PolicyVersion")


# ---- one recipe contract -------------------------------------------------------------------

def test_project_and_version_share_the_recipe_schema_by_ref():
    from evotrainer.store.specs import schema

    assert schema("Project")["properties"]["recipe"] == {"$ref": "recipe.schema.json"}
    assert schema("PolicyVersion")["properties"]["recipe"] == {"$ref": "recipe.schema.json"}


def test_recipe_errors_through_ref_keep_position_and_field():
    err = error_of(GOOD.replace("    lr: 0.0003", "    lrr: 0.0003"))
    assert err.where == "v1.yaml:7:5" and err.field == "recipe.grpo.lrr"
    assert "did you mean 'lr'" in err.hint
    project = ("apiVersion: evotrainer/v1\nkind: Project\nname: p\n"
               "recipe:\n  grpo:\n    lr: fast\n")
    err = error_of(project, "Project")
    assert err.where == "v1.yaml:6:9" and err.field == "recipe.grpo.lr"
