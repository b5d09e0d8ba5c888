"""The schema modeline (`# yaml-language-server: $schema=...`) comes from one function
(store/specs.py), and every document EvoTrainer writes into a workspace carries one that
points, relative to the document, at the schema of its kind that the workspace holds."""

from __future__ import annotations

import re

import pytest
from standin import converge

from evotrainer.agent.planners.base import HarnessProposal, write_harness_revision
from evotrainer.control.versions import new_version
from evotrainer.store.specs import SCHEMA_FILES, load_yaml, schema_modeline
from evotrainer.store.workspace import Workspace

MODELINE = re.compile(r"# yaml-language-server: \$schema=(\S+)\n")
pytestmark = pytest.mark.usefixtures("standin")


def _schema_of(ws: Workspace, ref: str, doc_path: str) -> str:
    """The schema file a committed document's modeline names, resolved as an editor would."""
    match = MODELINE.match((ws.git.read(ref, doc_path) or b"").decode())
    assert match, f"{doc_path} on {ref} has no schema modeline"
    target = ((ws.root / doc_path).parent / match.group(1)).resolve()
    assert target.is_file(), f"{doc_path} points at {match.group(1)}, absent"
    return target.name


@pytest.mark.parametrize("kind", sorted(SCHEMA_FILES))
def test_the_modeline_climbs_to_the_root_and_names_the_kinds_schema(kind):
    name = f"{SCHEMA_FILES[kind]}.schema.json"
    assert schema_modeline("project.yaml", kind) == \
        f"# yaml-language-server: $schema=spec/schemas/{name}\n"
    assert schema_modeline("runs/v1/run.yaml", kind) == \
        f"# yaml-language-server: $schema=../../spec/schemas/{name}\n"


def test_every_writer_puts_the_modeline_of_its_kind(workspace):
    converge(workspace)  # v0's run, diagnosis and decision records
    new_version(workspace, "v1", "v0", rationale="a child")
    harness = load_yaml((workspace.root / "harness_revisions/h0.yaml").read_text(), "h0")
    write_harness_revision(workspace, HarnessProposal(
        document={**harness, "name": "modeline-check"}, rationale="modelines"))
    written = {
        ("main", "spec/project.yaml"): "project.schema.json",
        ("evo/v0", "spec/versions/v0.yaml"): "policy-version.schema.json",
        ("evo/v1", "spec/versions/v1.yaml"): "policy-version.schema.json",
        ("evo/v0", "runs/v0/run.yaml"): "run.schema.json",
        ("evo/v0", "runs/v0/diagnosis.yaml"): "diagnosis.schema.json",
        ("evo/v0", "runs/v0/decision.yaml"): "decision.schema.json",
        ("main", "harness_revisions/modeline-check.yaml"): "harness-revision.schema.json",
    }
    for (ref, doc_path), schema_file in written.items():
        assert _schema_of(workspace, ref, doc_path) == schema_file, doc_path
