"""What a newcomer reads: reconcile's time left at the steps' own pace, the hint outside a
workspace, a LoRA recipe without peft refused where every recipe is checked (not after a
long GGUF conversion), and hints that name what the user meant."""

from __future__ import annotations

import time

import pytest

from evotrainer.backends.base import JobSpec
from evotrainer.backends.local import running_status
from evotrainer.contract import recipe as checks
from evotrainer.engine.outputs import ProgressRecord
from evotrainer.errors import EvoError
from evotrainer.evidence.layout import RunArtifacts


def test_reconciles_time_left_is_at_the_steps_pace(tmp_path):
    """The job started 10 minutes ago (a warm start) and its steps take 2 s: 38 steps left
    are 76 s, not (600 s / 2) × 38 ≈ 3 hours."""
    now = [0.0]
    progress = ProgressRecord(RunArtifacts(tmp_path).progress, clock=lambda: now[0])
    progress.begin_seed(0, 40)
    for step in (1, 2):  # the warm start ended at 600 s; each step takes 2 s
        now[0] = 600.0 + 2 * step
        progress.stepped(step, 2.0)
    job = JobSpec("evo-v1-a1-0123456789", "v1", {"grpo": {"steps": 40}, "seeds": [0]},
                  tmp_path, tmp_path)
    status = running_status(job, {"pid": 1, "create_time": time.time() - 602})
    assert (status.steps_done, status.steps_total) == (2, 40)
    assert status.seconds_left == 76.0


def test_outside_a_workspace_the_hint_leads_somewhere(tmp_path, cli):
    out = cli("lineage", cwd=tmp_path)
    assert out.code == 1 and "Traceback" not in out.output
    assert "not inside an EvoTrainer workspace" in out.err and "git init" not in out.err
    assert "evotrainer init DIR" in out.err


def test_a_lora_recipe_without_peft_is_refused_by_the_recipe_check(monkeypatch):
    monkeypatch.setattr(checks, "find_spec", lambda name: None if name == "peft" else True)
    with pytest.raises(EvoError) as err:
        checks.check_model({"lora": {"r": 8}})
    assert err.value.field == "model.lora" and "peft" in err.value.message


def test_another_tools_option_name_points_at_ours(workspace, cli):
    out = cli("version", "new", "v1", "--from", "v0", cwd=workspace.root)
    assert out.code == 1 and "Traceback" not in out.output
    assert "no such option: --from" in out.err and "did you mean --parent?" in out.err


def test_a_version_named_in_capitals_is_pointed_at_its_name(workspace, cli):
    out = cli("approve", "V0", cwd=workspace.root)
    assert out.code == 1 and "did you mean v0?" in out.err


def test_watch_ends_its_output_with_a_newline(workspace, cli):
    out = cli("watch", cwd=workspace.root)
    assert out.code == 0 and out.out.endswith("\n")
