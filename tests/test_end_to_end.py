"""The README's loop with the real embedded engine, at tiny settings: init → version new →
approve → reconcile --wait → lineage. Real GRPO steps, real detached subprocess, real h0
diagnosis and paired-bootstrap gate; only the sizes are shrunk so it runs in seconds."""

from __future__ import annotations

import json

import git
import pytest
import yaml

from evotrainer.control.reconcile import load_context
from evotrainer.gate.decision import decide
from evotrainer.store.workspace import Workspace

TINY = {
    "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1},
              "warm_start": {"steps": 30}},
    "domain": {"train_size": 40, "val_size": 8},
    "grpo": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "eval_every": 3, "eval_k": 2},
}


def test_init_propose_approve_reconcile_lineage(tmp_path, cli):
    assert cli("init", str(tmp_path / "demo"), "--example", "arith").code == 0
    root = tmp_path / "demo"
    project = root / "spec" / "project.yaml"
    doc = yaml.safe_load(project.read_text())
    for section, values in TINY.items():
        doc["recipe"].setdefault(section, {}).update(values)
    project.write_text(yaml.safe_dump(doc, sort_keys=False))
    repo = git.Repo(root)
    repo.git.add("-A")
    repo.git.commit("-m", "tiny recipe for the test", env={
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t"})

    # The project's recipe changed after init approved v0: that approval no longer holds.
    assert "awaiting re-approval" in cli("-C", str(root), "plan", "--json").out
    assert cli("-C", str(root), "approve", "v0").code == 0
    assert cli("-C", str(root), "version", "new", "v1", "--parent", "v0",
               "--rationale", "GRPO with the project's default recipe").code == 0
    # v0 (re-approved) would launch; v1 awaits approval.
    assert "awaiting approval" in cli("-C", str(root), "plan", "--json").out
    assert cli("-C", str(root), "approve", "v1").code == 0
    assert cli("-C", str(root), "plan").code == 2  # changes pending: v1 would launch
    result = cli("-C", str(root), "reconcile", "--wait")
    assert result.code == 0, result.err
    assert cli("-C", str(root), "plan").code == 0  # converged

    rows = {r["name"]: r for r in json.loads(cli("-C", str(root), "lineage", "--json").out)}
    assert rows["v0"]["status"] == "baseline" and rows["v0"]["on_main"]
    assert rows["v1"]["status"] in ("promote", "prune", "inconclusive")
    assert rows["v1"]["ci"] is not None and 0.0 <= rows["v1"]["score"] <= 1.0
    # The verdict is the one the gate reaches again from what is recorded (scores on the
    # branch, diagnosis, harness): whatever the tiny run learned, the decision follows it.
    ws = Workspace(root)
    ctx = load_context(ws)
    recorded = ws.version("v1", ctx.states).records["decision"]
    again = decide(ws, ctx.states, ctx.states["v1"], ctx.harness)
    assert (again["verdict"], again["rule"], again["blocked_by"]) == (
        recorded["verdict"], recorded["rule"], recorded["blocked_by"])
    for key in ("delta", "ci_low", "ci_high"):
        assert again["comparison"][key] == pytest.approx(recorded["comparison"][key], abs=1e-5)
    run = yaml.safe_load(repo.git.show("evo/v1:runs/v1/run.yaml"))
    assert run["state"] == "Succeeded" and run["result"]["steps_done"] == 3
    assert (root / run["artifact_dir"] / "rollouts" / "train.parquet").is_file()
    diagnosis = yaml.safe_load(repo.git.show("evo/v1:runs/v1/diagnosis.yaml"))
    assert diagnosis["metrics"]["dead_group_ratio"]["value"] is not None
    scores = repo.git.show("evo/v1:runs/v1/scores.csv").splitlines()
    assert scores[0] == "seed,task_id,data_source,sample_idx,correct" and len(scores) == 1 + 8 * 2
