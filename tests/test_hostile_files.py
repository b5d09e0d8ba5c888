"""Files a command finds in its way, made by a crash or by someone hostile: a lock holding a
pid past Python's int-digit limit, a leftover export staging path that is a file or a link,
a rationale written to turn the model card into HTML, a link or front matter. Each gets one
clear line or is neutralised; nothing outside is touched."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from test_checkpoints import _record

from evotrainer.control.policy_export import MAX_QUOTED_CHARS, export_policy
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import new_version
from evotrainer.store.workspace import Workspace


def _one_error_line(result, *texts: str) -> None:
    assert result.code == 1, result.output
    assert result.err.startswith("error: ") and result.err.count("\n") == 1, result.err
    assert "Traceback" not in result.output
    for text in texts:
        assert text in result.err, result.err


# ---- the workspace lock ------------------------------------------------------------------


@pytest.mark.parametrize("pid", [
    "9" * 5000,  # past the int-digit limit: json.loads raises ValueError
    "9" * 4000,  # parses, but psutil overflows on it
    "-7",
    "0",
])
def test_a_lock_with_an_impossible_pid_is_named_and_can_be_broken(workspace, cli, pid):
    lock = workspace.state_dir / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}"}}')
    _one_error_line(cli("reconcile", cwd=workspace.root), "workspace lock is unreadable",
                    "unlock --force")
    _one_error_line(cli("unlock", cwd=workspace.root), "unreadable lock")
    result = cli("unlock", "--force", cwd=workspace.root)
    assert result.code == 0 and "broke the lock" in result.out, result.output
    assert not lock.exists()


# ---- export --------------------------------------------------------------------------------


@pytest.fixture
def trained(tmp_path) -> tuple[Workspace, Path]:
    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    new_version(ws, "v1", "v0", rationale="promoted")
    return ws, _record(ws, "v1", "promote", b"w1" * 1000)


def test_a_leftover_staging_file_or_link_does_not_stop_an_export_or_leak_out(
    trained, cli, tmp_path
):
    ws, _ = trained
    target = tmp_path / "T"
    staging = tmp_path / ".T.partial"
    staging.write_text("left by a crash")
    result = cli("-C", str(ws.root), "export", "v1", "--to", str(target))
    assert result.code == 0, result.output
    assert (target / "model.safetensors").read_bytes() == b"w1" * 1000
    assert not staging.exists()

    # A link at the staging path: removed as a link, what it points to is left alone.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep me")
    target2 = tmp_path / "T2"
    (tmp_path / ".T2.partial").symlink_to(elsewhere)
    result = cli("-C", str(ws.root), "export", "v1", "--to", str(target2))
    assert result.code == 0, result.output
    assert (elsewhere / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]
    assert (target2 / "model.safetensors").is_file() and not target2.is_symlink()


def test_exported_files_all_get_the_umask_modes(trained, tmp_path):
    ws, policy = trained
    (policy / "model.safetensors").chmod(0o600)  # as safetensors writes it
    old = os.umask(0o022)
    try:
        target = export_policy(ws, "v1", tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "README.md": 0o644}
    assert target.stat().st_mode & 0o777 == 0o755


def test_the_model_card_quotes_the_rationale_as_text_and_caps_it(tmp_path):
    ws = Workspace(init_workspace(tmp_path / "ws", "arith"))
    payload = ("<script>alert(1)</script>\n---\nlicense: evil\n---\n"
               "[click me](javascript:alert(document.cookie)) <img src=x onerror=alert(1)>")
    new_version(ws, "v1", "v0", rationale=payload)
    new_version(ws, "v2", "v0", rationale="x" * 70_000)
    _record(ws, "v1", "promote", b"w1")
    _record(ws, "v2", None, b"w2")

    card = (export_policy(ws, "v1", tmp_path / "v1") / "README.md").read_text()
    # Rendered as a hub renders a card (CommonMark with raw HTML allowed, GFM tables): the
    # payload is text on the page, never a tag, a link or a rule.
    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(card)
    assert "<script" not in html and "<img" not in html and "href" not in html
    assert "<hr" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "[click me]" in html
    assert not card.startswith("---")  # no front matter of the author's

    card = (export_policy(ws, "v2", tmp_path / "v2") / "README.md").read_text()
    assert card.count("x") < MAX_QUOTED_CHARS + 200
    assert "the full text is in spec/versions/v2.yaml on evo/v2" in card
