"""HarnessRevision loading: clear errors naming file and field; SQL that could touch the
outside world is refused."""

import copy
import json

import pyarrow.parquet as pq
import pytest
import typer
import yaml
from typer.testing import CliRunner

from evotrainer.commands import diagnose as diagnose_cmd
from evotrainer.diagnosis.diagnose import diagnose
from evotrainer.diagnosis.harness import load_harness, parse_harness, resolve_harness
from evotrainer.errors import EvoError
from evotrainer.evidence.synthetic import rollout_table
from evotrainer.store.builtin import builtin_dir

H0_DOC = yaml.safe_load((builtin_dir("harness_revisions") / "h0.yaml").read_text())
ROWS = rollout_table(
    [dict(step=1, group_id="g", sample_idx=i, reward=float(i % 2)) for i in range(4)]
)


def _with_metric(sql: str) -> dict:
    doc = copy.deepcopy(H0_DOC)
    doc["metrics"].append({"name": "evil", "layer": "signal", "split": "train", "sql": sql})
    return doc


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT 1) TO '/tmp/out.csv'",
        "ATTACH '/tmp/other.db'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "PRAGMA version",
        "SET enable_external_access = true",
        "CREATE TABLE t AS SELECT 1",
        "SELECT 1 AS value; SELECT 2 AS value",
    ],
)
def test_non_select_sql_is_refused_at_load(sql):
    with pytest.raises(EvoError, match="exactly one SELECT") as err:
        parse_harness(_with_metric(sql), source="h.yaml")
    assert err.value.field == f"metrics[{len(H0_DOC['metrics'])}].sql"


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT count(*) AS value FROM read_csv('/etc/passwd')",
        "SELECT count(*) AS value FROM '/etc/hostname'",
        "SELECT count(*) AS value FROM read_parquet('/tmp/x.parquet')",
    ],
)
def test_file_reads_are_refused_at_run_time(sql):
    harness = parse_harness(_with_metric(sql), source="h.yaml")
    with pytest.raises(EvoError, match="query failed") as err:
        diagnose(ROWS, None, harness)
    assert err.value.field == "metrics.evil"


def test_sample_where_injection_is_refused():
    doc = copy.deepcopy(H0_DOC)
    doc["alerts"][0]["sample"]["where"] = "true); COPY (SELECT 1) TO '/tmp/x.csv'; SELECT (1"
    with pytest.raises(EvoError, match="exactly one SELECT"):
        parse_harness(doc, source="h.yaml")


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (lambda d: d.update(kind="Harness"), "kind", "HarnessRevision"),
        (lambda d: d["metrics"][0].update(layer="vibes"), "metrics[0].layer", "expected one of"),
        (lambda d: d["metrics"][1].update(name="Bad-Name"), "metrics[1].name", "lower_snake_case"),
        (lambda d: d["metrics"][1].update(analyzer={"name": "leak"}), "metrics[1]", "exactly one"),
        (
            lambda d: d["metrics"][1].update(sql="SELECT $nope AS value"),
            "metrics[1].sql",
            "undefined param",
        ),
        (
            lambda d: d["alerts"][2].update(when="truncation_rate >"),
            "alerts[2].when",
            "invalid CEL",
        ),
        (
            lambda d: d["alerts"][2].update(when="trunc_rate > 0.1"),
            "alerts[2].when",
            "unknown name",
        ),
        (lambda d: d["alerts"][2].update(metric="nope"), "alerts[2].metric", "unknown metric"),
        (  # the threshold says the bound `when` compares with: one fact, twice, kept equal
            lambda d: d["alerts"][2].update(threshold=0.2),
            "alerts[2].threshold",
            r"threshold 0.2 is not the bound `when` compares truncation_rate with \(0.15\)",
        ),
        (
            lambda d: d["alerts"][0]["levels"][1].update(threshold=0.35),
            "alerts[0].levels[1].threshold",
            "is not the bound",
        ),
        (
            lambda d: d["gate"]["rules"][0].update(verdict="ship"),
            "gate.rules[0].verdict",
            "expected one of",
        ),
        (lambda d: d["metrics"].append(dict(d["metrics"][0])), "metrics[24].name", "duplicate"),
    ],
)
def test_structural_errors_name_the_field(mutate, field, message):
    doc = copy.deepcopy(H0_DOC)
    mutate(doc)
    with pytest.raises(EvoError, match=message) as err:
        parse_harness(doc, source="harness_revisions/h1.yaml")
    assert err.value.field == field and err.value.where == "harness_revisions/h1.yaml"


def test_yaml_syntax_error_has_a_location(tmp_path):
    bad = tmp_path / "h1.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(EvoError, match="malformed YAML") as err:
        load_harness(bad)
    assert err.value.where.startswith(str(bad) + ":")


def test_workspace_revision_wins_over_builtin_and_digest_tracks_content(tmp_path):
    (tmp_path / "harness_revisions").mkdir()
    doc = copy.deepcopy(H0_DOC)
    doc["params"]["echo_turns"] = 30
    (tmp_path / "harness_revisions" / "h0.yaml").write_text(yaml.safe_dump(doc))
    local = resolve_harness("h0", tmp_path)
    assert local.params["echo_turns"] == 30
    assert local.digest != resolve_harness("h0", tmp_path / "elsewhere").digest
    with pytest.raises(EvoError, match="no harness revision named"):
        resolve_harness("h9", tmp_path)


def test_diagnose_cli_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pq.write_table(ROWS, tmp_path / "r.parquet")
    app = typer.Typer()
    app.callback()(lambda: None)  # keep `diagnose` a subcommand, as in the real CLI
    diagnose_cmd.register(app)
    result = CliRunner().invoke(
        app, ["diagnose", "--rollouts", "r.parquet", "--json", "--out", "d.yaml"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) == {"harness", "evidence_digest", "metrics", "series", "alerts", "gaps"}
    assert out["harness"]["name"] == "h0" and out["evidence_digest"].startswith("sha256:")
    assert out["metrics"]["dead_group_ratio"] == 0.0
    assert yaml.safe_load((tmp_path / "d.yaml").read_text())["kind"] == "Diagnosis"


# ---- one loader: the spec loader's bounds, schema and positions --------------------------

H0_TEXT = (builtin_dir("harness_revisions") / "h0.yaml").read_text()


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_semantic_errors_from_a_file_carry_line_and_column(tmp_path):
    # A CEL error is found after the schema passes; it still names file:line:column.
    path = tmp_path / "h1.yaml"
    when = next(a["when"] for a in H0_DOC["alerts"] if "when" in a)
    path.write_text(H0_TEXT.replace(f"when: {when}", "when: no_such_metric > 1", 1))
    with pytest.raises(EvoError, match="unknown name") as err:
        load_harness(path)
    line = _line_of(path.read_text(), "no_such_metric")
    assert err.value.where.startswith(f"{path}:{line}:")
    assert err.value.field.startswith("alerts[") and err.value.field.endswith(".when")


def test_schema_errors_from_a_file_carry_line_column_and_suggestion(tmp_path):
    path = tmp_path / "h1.yaml"
    path.write_text(H0_TEXT.replace("\ngate:", "\ngates:", 1))
    with pytest.raises(EvoError) as err:
        load_harness(path)
    line = _line_of(path.read_text(), "gates:")
    assert err.value.where == f"{path}:{line}:1" and "did you mean 'gate'" in err.value.hint


def test_schema_and_loader_agree_on_severities():
    # The schema used to allow `info`, which the loader refused at run time.
    doc = copy.deepcopy(H0_DOC)
    alert = next(a for a in doc["alerts"] if "severity" in a)
    alert["severity"] = "info"
    with pytest.raises(EvoError, match="expected one of 'critical', 'warning'"):
        parse_harness(doc, source="h.yaml")


def test_alias_bomb_in_a_harness_file_is_refused_quickly(tmp_path):

    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{k}: &{k} [{', '.join([f'*{p}'] * 9)}]" for p, k in zip("abcdefgh", "bcdefghi",
                                                                    strict=True)]
    path = tmp_path / "h1.yaml"
    path.write_text(H0_TEXT + "\n".join(lines) + "\n")
    with pytest.raises(EvoError, match="expands to more than"):  # counted, never built
        load_harness(path)


def test_proposed_text_is_checked_with_positions():
    from evotrainer.diagnosis.harness import parse_harness_text

    bad = H0_TEXT.replace("kind: HarnessRevision", "kind: HarnessRevision\nlayers: 2", 1)
    with pytest.raises(EvoError, match="unknown key 'layers'") as err:
        parse_harness_text(bad, "proposed h1.yaml")
    assert err.value.where == f"proposed h1.yaml:{_line_of(bad, 'layers: 2')}:1"
    assert parse_harness_text(H0_TEXT, "h0.yaml").digest == resolve_harness("h0").digest
