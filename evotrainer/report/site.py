"""Render the report: Jinja2 templates (autoescape on for every one) into a folder of static
pages that need no script and no network.

The stylesheet is inlined and allowed by its hash in a Content-Security-Policy meta tag
whose default is 'none': no script runs, whatever a rollout's text holds, and nothing is
fetched. The folder is built beside the target and swapped in whole, so a reader never sees
half a report and pages of versions that no longer exist do not linger."""

from __future__ import annotations

import base64
import hashlib
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2
import yaml

from evotrainer.errors import EvoError
from evotrainer.report import markdown, svg
from evotrainer.report.views import Site, collect, page_file
from evotrainer.stats import confidence_label
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import clean

MARKER = ".evotrainer-report"  # marks a folder this builder may replace


def _stylesheet() -> str:
    return files("evotrainer.report").joinpath("templates/style.css").read_text("utf-8")


def content_security_policy(css: str) -> str:
    digest = base64.b64encode(hashlib.sha256(css.encode()).digest()).decode()
    return (f"default-src 'none'; style-src 'sha256-{digest}'; img-src 'none'; "
            "base-uri 'none'; form-action 'none'")


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=True, width=96).strip()


def _without_control(value: Any) -> Any:
    """Every `{{ value }}` without NUL, escape sequences or other control characters (HTML
    has no use for them and browsers and tools treat them inconsistently). Markup stays
    Markup: the SVG charts are built already escaped."""
    return type(value)(clean(value)) if isinstance(value, str) else value


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("evotrainer.report", "templates"),
        autoescape=True,  # every template, whatever its file name: data is untrusted
        finalize=_without_control,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=svg.fmt, yaml=_yaml, page=page_file, status=svg.status_class,
                       markdown=markdown.render,
                       confidence=lambda c: confidence_label({"confidence": c}))
    return env


def build_report(ws: Workspace, out_dir: Path) -> Path:
    """Write the report of `ws` into `out_dir` (replacing an earlier report there) and return
    the path of its index.html."""
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and (not out_dir.is_dir() or
                             (any(out_dir.iterdir()) and not (out_dir / MARKER).exists())):
        raise EvoError("refusing to write the report over something that is not a report",
                       where=str(out_dir), hint="pass an empty or new folder with --out")
    site = collect(ws)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir.parent))
    try:
        _render(site, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a report is for reading
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir / "index.html"


def _render(site: Site, folder: Path) -> None:
    env = _environment()
    css = _stylesheet()
    common = {"site": site, "css": css, "csp": content_security_policy(css)}

    def write(relative: str, template: str, **context: Any) -> None:
        root = "../" * relative.count("/")
        html = env.get_template(template).render(**common, root=root, **context)
        (folder / relative).write_text(html, encoding="utf-8")

    (folder / "versions").mkdir()
    (folder / MARKER).write_text("written by `evotrainer report`; replaced on every run\n")
    write("index.html", "index.html.j2", page_name="index")
    write("harness.html", "harness.html.j2", page_name="harness")
    write("skills.html", "skills.html.j2", page_name="skills")
    for page in site.versions.values():
        write(f"versions/{page.file}", "version.html.j2", page_name="version", page=page)
