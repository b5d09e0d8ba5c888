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
    doc = load_text(GOOD.replace("name: v1", f"name: {name!r}"), "v1.yaml", "PolicyVersion")
    # Loaded as written: the name a string (not "0" read as a number), the rest untouched.
    assert doc.data["name"] == name
    assert doc.data["recipe"] == {"grpo": {"lr": 0.0003}}
    assert doc.where(("name",)) == "v1.yaml:3:7"


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


# ---- criteria and harness expressions are checked where every spec is read ----


def _commit_criterion(ws, name: str, criterion: str) -> None:
    """Write `name`'s criterion by hand on its branch, as an author can (no `version new`)."""
    import yaml

    from evotrainer.store.git import branch_name
    from evotrainer.store.workspace import version_spec_path

    path = version_spec_path(name)
    spec = yaml.safe_load(ws.git.read(branch_name(name), path))
    spec["intervention"]["hypothesis"] = {"statement": "s", "criterion": criterion}
    ws.git.commit_files(branch_name(name), {path: yaml.safe_dump(spec).encode()}, "edit", {})


@pytest.mark.parametrize("criterion", [")))((", "leak_ratio <="])
def test_version_new_refuses_a_criterion_that_does_not_parse(workspace, cli, criterion):
    """Before, `version new` created these; a report later said "undecided — a metric it
    reads is null", hiding the syntax error."""
    result = cli("-C", str(workspace.root), "version", "new", "v2", "--parent", "v0",
                 "--rationale", "r", "--criterion", criterion)
    assert result.code == 1 and "Traceback" not in result.output
    assert result.err.startswith("error: evo/v2:spec/versions/v2.yaml:")
    assert "intervention.hypothesis.criterion: invalid CEL expression" in result.err
    assert "v2" not in workspace.versions()


@pytest.mark.parametrize(
    ("criterion", "message", "hint"),
    [
        (")))((", "invalid CEL expression", "cel-spec"),
        ("leek_ratio == 0.0", "reads 'leek_ratio', which harness h0 does not define",
         "did you mean 'leak_ratio'?"),
        ("params.alpha > 0.0", "reads 'params'", None),  # a decision records no params
        ("delta > 'high'", "overload", "doubles"),
        ("2 * delta > 0.1", "overload", "write 2.0 * x"),
        ("delta + 1.0", "is not a condition", None),
    ],
)
def test_validate_and_plan_refuse_a_criterion_committed_by_hand(workspace, cli, criterion,
                                                                  message, hint):
    from evotrainer.control.versions import new_version

    new_version(workspace, "v1", "v0", rationale="r", criterion="delta > 0.0")
    _commit_criterion(workspace, "v1", criterion)
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1 and "Traceback" not in result.output
    assert "evo/v1:spec/versions/v1.yaml:" in result.output and message in result.output
    assert "intervention.hypothesis.criterion" in result.output
    if hint:
        assert hint in result.output
    result = cli("-C", str(workspace.root), "plan")
    assert "refused: v1" in result.output and "Invalid" in result.output


@pytest.mark.parametrize("criterion", [
    "delta > 0.0 && leak_ratio == 0.0",
    "parent.leak_ratio >= leak_ratio || ci_low > min_delta",
    "critical_alerts == 0 && !('leak' in alerts)",
])
def test_a_criterion_over_metrics_and_gate_variables_is_valid(workspace, cli, criterion):
    from evotrainer.control.versions import new_version

    new_version(workspace, "v1", "v0", rationale="r", criterion=criterion)
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 0, result.output
    # What validate accepted is what the branch holds: the criterion as written.
    spec = workspace.version("v1").spec
    assert spec["intervention"]["hypothesis"]["criterion"] == criterion


def test_a_harness_expression_of_the_wrong_type_is_refused_with_its_position(workspace, cli):
    path = workspace.root / "harness_revisions" / "h0.yaml"
    text = path.read_text()
    first = next(line for line in text.splitlines() if line.strip().startswith("when:"))
    indent = first[: len(first) - len(first.lstrip())]
    path.write_text(text.replace(first, f"{indent}when: dead_group_ratio > 'half'", 1))
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1 and "Traceback" not in result.output
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "'half'" in t)
    assert f"harness_revisions/h0.yaml:{line}:" in result.output
    assert "overload" in result.output and ".when" in result.output


def test_a_skill_trigger_that_does_not_parse_is_refused(workspace, cli):
    path = next(p for p in sorted((workspace.root / "skills").glob("*.yaml"))
                if "\ntrigger:" in p.read_text())
    lines = path.read_text().splitlines()
    at = next(i for i, t in enumerate(lines) if t.startswith("trigger:"))
    lines[at] = "trigger: dead_group_ratio >"
    path.write_text("\n".join(lines) + "\n")
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1 and "Traceback" not in result.output
    assert f"skills/{path.name}:{at + 1}:" in result.output
    assert "trigger: invalid CEL expression" in result.output


def test_version_new_can_check_the_criterion_against_the_harness_in_force(workspace):
    from evotrainer.control.validation import check_criterion

    text = GOOD + "intervention:\n  rationale: r\n  hypothesis: {criterion: leek_ratio == 0.0}\n"
    doc = load_text(text, "evo/v1:spec/versions/v1.yaml", "PolicyVersion")
    with pytest.raises(EvoError) as err:
        check_criterion(workspace, doc)
    assert err.value.where == "evo/v1:spec/versions/v1.yaml:10:27"
    assert err.value.hint.startswith("did you mean 'leak_ratio'?")
    check_criterion(workspace, load_text(text.replace("leek", "leak"), "v1.yaml"))


def test_a_spec_cannot_name_the_weights_a_job_starts_from(workspace, cli):
    """`model.init_checkpoint` in a spec would make a job load any checkpoint its author
    names (the digest is theirs to compute); only reconcile sets it."""
    import yaml

    from evotrainer.control.versions import new_version
    from evotrainer.store.git import branch_name
    from evotrainer.store.workspace import version_spec_path

    new_version(workspace, "v1", "v0", rationale="r")
    path = version_spec_path("v1")
    spec = yaml.safe_load(workspace.git.read(branch_name("v1"), path))
    spec["recipe"]["model"] = {"init_checkpoint": {"path": "/elsewhere/model",
                                                   "digest": "sha256:" + "0" * 64}}
    workspace.git.commit_files(branch_name("v1"), {path: yaml.safe_dump(spec).encode()}, "e", {})
    result = cli("-C", str(workspace.root), "validate")
    assert result.code == 1
    assert "recipe.model.init_checkpoint: model.init_checkpoint is set by reconcile" in (
        result.output)
