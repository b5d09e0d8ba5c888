"""`evotrainer init DIR`: scaffold a workspace from the built-in library."""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path

import git
import typer

from evotrainer import API_VERSION
from evotrainer.engine.checks import package_checkpoint
from evotrainer.errors import EvoError
from evotrainer.store.builtin import builtin_dir
from evotrainer.store.git import GitStore, branch_name, with_trailers
from evotrainer.store.specs import dump
from evotrainer.store.workspace import PROJECT_FILE, STATE_DIR, version_spec_path
from evotrainer.terminal import console as make_console

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
BASELINE = "v0"
# Examples that train a packaged checkpoint: init checks the model extra is installed.
EXAMPLE_MODEL_PACKAGES = {"humaneval-smollm2": "smollm2"}


def examples() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))


def schema_modeline(doc_path: str, schema_file: str) -> str:
    """`# yaml-language-server: $schema=...` relative to the document, for editors."""
    depth = doc_path.count("/")
    return f"# yaml-language-server: $schema={'../' * depth}spec/schemas/{schema_file}\n"


def baseline_spec(now: str) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "PolicyVersion",
        "name": BASELINE,
        "parent": None,
        "description": "The untrained baseline: evaluated, not trained (the no-RL reference).",
        "train": False,
        "intervention": {
            "skills": [],
            "factors": 0,
            "rationale": "Reference point for every comparison on this lineage.",
        },
        "approval": {"approved": False},
    }


def init_workspace(directory: Path, example: str) -> Path:
    if example not in examples():
        raise EvoError(
            f"unknown example {example!r}",
            field="--example",
            hint=f"one of {', '.join(examples())}",
        )
    if example in EXAMPLE_MODEL_PACKAGES:
        package_checkpoint(EXAMPLE_MODEL_PACKAGES[example])  # EvoError: the install command
    if directory.exists() and any(directory.iterdir()):
        raise EvoError(
            "directory exists and is not empty",
            where=str(directory),
            hint="choose a new directory; init never writes over existing files",
        )
    directory.mkdir(parents=True, exist_ok=True)
    repo = git.Repo.init(directory, initial_branch="main")

    project_text = (EXAMPLES_DIR / f"{example}.yaml").read_text()
    (directory / "spec").mkdir()
    (directory / PROJECT_FILE).write_text(
        schema_modeline(PROJECT_FILE, "project.schema.json") + project_text
    )
    shutil.copytree(builtin_dir("spec/schemas"), directory / "spec" / "schemas")
    for folder in ("harness_versions", "skills"):
        target = directory / folder
        target.mkdir()
        for source in sorted(builtin_dir(folder).glob("*.yaml")):
            shutil.copy(source, target / source.name)
    (directory / "runs").mkdir()
    (directory / "runs" / ".gitkeep").write_text("")
    (directory / ".gitignore").write_text(f"{STATE_DIR}/\n")
    workflows = directory / ".github" / "workflows"
    workflows.mkdir(parents=True)
    shutil.copy(EXAMPLES_DIR / "ci" / "github-workflow.yml", workflows / "evotrainer.yml")

    store = GitStore(directory)
    repo.git.add("-A")
    message = with_trailers("Initialise EvoTrainer workspace", {"Action": "init"})
    repo.git.commit("-q", "-m", message, env=store.identity_env)

    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path = version_spec_path(BASELINE)
    text = schema_modeline(path, "policy-version.schema.json") + dump(baseline_spec(now))
    store.commit_files(
        branch_name(BASELINE),
        {path: text.encode()},
        f"Baseline version {BASELINE}: evaluate the untrained model",
        {"Action": "propose", "Version": BASELINE},
        start="main",
    )
    # Approved like any version: the approval records the digest of what it approves.
    from evotrainer.control.versions import approve
    from evotrainer.store.workspace import Workspace

    approve(Workspace(directory), BASELINE, by="evotrainer init")
    return directory


def register(app: typer.Typer) -> None:
    @app.command("init")
    def init(
        directory: Path = typer.Argument(..., help="New workspace directory."),
        example: str = typer.Option(
            "arith", "--example", help="Starting project: " + ", ".join(examples()) + "."
        ),
    ) -> None:
        """Create a workspace: a git repo with the project spec, the built-in harness and
        skills, and the baseline version v0 on branch evo/v0."""
        root = init_workspace(directory, example)
        console = make_console()
        console.print(
            f"Initialised workspace [bold]{root}[/] ({example}): main + {branch_name(BASELINE)}"
        )
        console.print(f"Next: cd {root} && evotrainer version new v1 --parent v0 --rationale '...'")
