"""The HTML report of a real workspace (stand-in engine, real reconcile), opened in headless
Chromium over the DevTools protocol: no console error on any page, every internal link and
anchor resolves, one lineage node per version, a screenshot that is not blank, and rollout
text holding `<script>` and HTML shown as text."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
import yaml
from markupsafe import escape
from sealing import controller_commit
from typer.testing import CliRunner

from evotrainer.commands.report import register
from evotrainer.control.scaffold import init_workspace
from evotrainer.control.versions import approve, new_version
from evotrainer.errors import EvoError
from evotrainer.evidence.schema import ROLLOUT_SCHEMA
from evotrainer.report import build_report, markdown, svg
from evotrainer.report.views import criterion_view, recipe_diff
from evotrainer.store.lineage import LineageRow, lineage_rows
from evotrainer.store.workspace import Workspace
from evotrainer.terminal import clean

TESTS = Path(__file__).resolve().parent
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (apt-get install -y chromium)")

SCRIPT_PROMPT = "<script>alert(1)</script><b>bold prompt</b>"
HTML_RESPONSE = '</pre><img src=x onerror="alert(2)"><i>italic</i> &amp; done'
SCRIPT_RATIONALE = "<em>leaky</em> on purpose <script>alert(3)</script>"
# NUL, a colour escape, an OSC title sequence, a bell and a C1 CSI in a rollout's text.
CONTROL_TEXT = " nul\x00 esc\x1b[31m osc\x1b]0;pwned\x07 bell\x07 c1\x9b end"


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    """v0 baseline → v1 promoted, v2 leaking (pruned), v3 failing: every kind of node. The
    reconcile runs for real with the stand-in engine (as in test_reconcile.py)."""
    from standin import StandinBackend, converge, propose

    from evotrainer.backends import BACKEND_TYPES

    with pytest.MonkeyPatch.context() as mp:  # the `standin` fixture, at module scope
        mp.setenv("PYTHONPATH", os.pathsep.join(
            [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
        mp.setitem(BACKEND_TYPES, "local", StandinBackend)  # what `version new` checks
        workspace = Workspace(init_workspace(tmp_path_factory.mktemp("report") / "ws", "arith"))
        propose(workspace, "v1", standin_skill=0.65)
        new_version(workspace, "v2", "v0", rationale=SCRIPT_RATIONALE,
                    settings=['domain.params.standin_skill=0.65',
                              'domain.params.standin_leak=true'],
                    hypothesis="a higher skill raises avg@k", criterion="delta >= 0.0",
                    proposal={"planner": "anthropic", "tokens": {"input": 1200, "output": 345}})
        approve(workspace, "v2", by="tester")
        propose(workspace, "v3", standin_fail=True)
        converge(workspace)
    _plant_html_rollout(workspace)
    _add_harness_revision(workspace)
    _describe_in_markdown(workspace)
    return Workspace(workspace.root)  # a fresh one: `project` is read once per Workspace


MARKDOWN_DESCRIPTION = """Adds *digits* with `tiny` models; see [the paper](https://arxiv.org/abs/2606.03108).

- [a script link](javascript:alert(5)) and [a data link](data:text/html,hi)
- <b>raw html</b> <script>alert(6)</script>
"""


def _describe_in_markdown(ws: Workspace) -> None:
    """The project's description (read from the working tree) in Markdown with traps."""
    path = ws.root / "spec" / "project.yaml"
    data = yaml.safe_load(path.read_text())
    data["description"] = MARKDOWN_DESCRIPTION
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _add_harness_revision(ws: Workspace) -> None:
    """h1: h0 with a stricter truncation alert and a backtest case (not in force)."""
    text = ws.harness_path("h0").read_text()
    text = text.replace("name: h0\n", "name: h1\nparent: h0\n", 1)
    text = text.replace("truncation_rate > 0.15", "truncation_rate > 0.1")
    text = text.replace("threshold: 0.15", "threshold: 0.1")
    text = text.replace("backtest_cases: []", "backtest_cases:\n  - {version: v2, expect: block, "
                        "alert: leak, why: '<b>must</b> stay blocked'}")
    ws.harness_path("h1").write_text(text)


def _plant_html_rollout(ws: Workspace) -> None:
    """Put markup into the first rollout the leak alert of v2 cites as an example."""
    example = ws.version("v2").records["diagnosis"]["alerts"][0]["examples"][0]
    _, seed, split, step, group, sample = example.split("/")
    run = ws.version("v2").records["run"]
    path = ws.root / run["artifact_dir"] / "rollouts" / f"{split}.parquet"
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        if (row["seed"], row["step"], row["group_id"], row["sample_idx"]) == (
                int(seed), int(step), group, int(sample)):
            row.update(prompt=SCRIPT_PROMPT + CONTROL_TEXT, response=HTML_RESPONSE,
                       tool_calls=[{"name": "reveal", "args": "<script>alert(4)</script>"}])
    pq.write_table(pa.Table.from_pylist(rows, ROLLOUT_SCHEMA), path)


@pytest.fixture(scope="module")
def report(ws, tmp_path_factory) -> Path:
    return build_report(ws, tmp_path_factory.mktemp("site") / "report")


def test_untrusted_text_is_escaped_and_no_script_exists(report):
    page = (report.parent / "versions" / "v2.html").read_text()
    for text in (SCRIPT_PROMPT, HTML_RESPONSE, SCRIPT_RATIONALE):
        assert str(escape(text)) in page
    for written in report.parent.rglob("*.html"):
        text = written.read_text().lower()
        assert "<script" not in text and "<img" not in text and "<b>" not in text
        assert "default-src 'none'" in html.unescape(text)  # the CSP meta tag


def test_control_characters_never_reach_the_html(report):
    page = (report.parent / "versions" / "v2.html").read_text()
    assert "nul esc osc bell c1 end" in page and "pwned" not in page
    for written in report.parent.rglob("*.html"):
        text = written.read_text()
        assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", text), written


def test_version_pages_show_what_was_decided(report):
    v1 = (report.parent / "versions" / "v1.html").read_text()
    assert "standin_skill" in v1 and "0.65" in v1  # the recipe diff against v0
    assert "significant_gain" in v1 and "Wilcoxon" in v1  # the gate and its statistics
    v3 = (report.parent / "versions" / "v3.html").read_text()
    assert "failing on purpose" in v3  # the failed run's log tail
    index = report.read_text()
    assert "v0 → v1" in index and "max_total_steps" in index
    assert "anthropic" in index and "1545" in index  # the planner's tokens, totalled


def test_index_shows_each_versions_spend_and_the_gpu_hour_budget(report, ws):
    """The report shows spend per version beside the budgets it counts against."""
    index = html.unescape(report.read_text())
    assert "GPU-hours spent" in index and "max_gpu_hours" in index
    versions = index[index.index("<h2>Versions</h2>"):]
    rows = {row.name: row for row in lineage_rows(ws)}
    assert rows["v1"].spend.steps > 0  # trained, so it spent steps
    for name, row in rows.items():
        cells = re.search(rf'versions/{name}\.html.*?</tr>', versions, re.S)
        assert cells is not None and (row.spend.text() or "—") in cells.group(0), name
    assert "1545 tokens" in index  # v2's proposal tokens are part of its spend


def test_a_run_result_without_seeds_shows_the_recipes(ws, tmp_path):
    """A run stopped early (or a backend that does not list them) records no seeds in its
    result: the page names the seeds the recipe ran, never a bare "seeds"."""
    copy = Workspace(shutil.copytree(ws.root, tmp_path / "ws", symlinks=True))
    run = copy.version("v1").records["run"]
    stopped = {**run, "result": {"steps_done": 2}}
    from evotrainer.control.reconcile import record_text

    controller_commit(copy, "v1", {"runs/v1/run.yaml": record_text("run", stopped).encode()},
                      "as an early stop records it")
    seeds = copy.resolved_recipe("v1", copy.versions())["seeds"]
    page = (build_report(Workspace(copy.root), tmp_path / "site").parent / "versions" /
            "v1.html").read_text()
    row = re.search(r"<tr><th>result</th><td>(.*?)</td></tr>", page).group(1)
    assert row.endswith(f" · seeds {', '.join(map(str, seeds))}"), row
    assert not re.search(r"seeds\s*<", page)


def test_harness_revisions_show_their_diff_and_backtest_cases(report):
    page = (report.parent / "harness.html").read_text()
    assert "+    when: truncation_rate &gt; 0.1" in page
    assert "-    when: truncation_rate &gt; 0.15" in page
    assert "its declared parent" in page
    assert "<td>leak</td><td>&lt;b&gt;must&lt;/b&gt; stay blocked</td>" in page  # a case


def test_recipe_diff_keys_named_lists_by_name():
    old = {"grpo": {"lr": 1e-4, "group_size": 8}, "reward": {"components": [
        {"name": "correctness", "weight": 1.0}]}, "filter": {"params": {}}}
    new = {"grpo": {"lr": 3e-4, "group_size": 8}, "reward": {"components": [
        {"name": "correctness", "weight": 1.0}, {"name": "partial", "weight": 0.1}]},
        "filter": {"params": {"k": 2}}}
    assert [(d.key, d.old, d.new) for d in recipe_diff(old, new)] == [
        ("filter.params.k", None, "2"), ("grpo.lr", "0.0001", "0.0003"),
        ("reward.components[partial].weight", None, "0.1")]


def test_version_page_opens_with_the_gate_decision(report):
    v2 = (report.parent / "versions" / "v2.html").read_text()
    order = [v2.index(marker) for marker in ('id="decision"', "<h2>Intervention</h2>",
                                             "<h2>Alerts</h2>", "<h2>Diagnosis</h2>")]
    assert order == sorted(order)
    decision = v2[v2.index('id="decision"'):v2.index("<h2>Intervention</h2>")]
    assert "s-prune" in v2[v2.index('<section class="decision'):v2.index('id="decision"')]
    assert "blocked by critical alert(s) leak" in decision
    # The pruned version's criterion held: said so, in caution, with the gate's verdict.
    assert '<span class="criterion caution">held</span>' in decision
    assert "verdict is prune (blocked by leak)" in decision and "criterion supports" not in v2
    v1 = (report.parent / "versions" / "v1.html").read_text()
    assert '<section class="decision s-promote" id="decision">' in v1
    v3 = (report.parent / "versions" / "v3.html").read_text()
    assert "Not gated yet: the run failed" in v3


def _decision(verdict: str, held: bool | None, blocked: list[str] = ()) -> dict:
    return {"verdict": verdict, "blocked_by": list(blocked),
            "criterion": {"expression": "leak_ratio <= 0.0", "held": held}}


SPEC = {"intervention": {"hypothesis": {"criterion": "leak_ratio <= 0.0"}}}


@pytest.mark.parametrize(("decision", "negative", "outcome", "css", "note"), [
    (_decision("promote", True), False, "held", "supports", "gate promoted"),
    (_decision("prune", True, ["leak"]), True, "held", "caution",
     "verdict is prune (blocked by leak)"),
    (_decision("inconclusive", True), False, "held", "caution", "verdict is inconclusive"),
    (_decision("promote", True), True, "held", "caution", "verdict is promote"),  # pruned later
    (_decision("promote", False), False, "did not hold", "refuted", "promoted the version on"),
    (_decision("prune", False), True, "did not hold", "refuted", "failed its own test"),
    (_decision("prune", None), True, "undecided", "undecided", "null"),
    ({}, False, "not tested yet", "undecided", "not decided"),
    # An early stop prunes before the criterion can be tested: the page says so.
    ({"verdict": "prune", "rule": "early_stop"}, True, "not tested", "undecided",
     "decided prune by its rule early_stop without testing it"),
])
def test_criterion_is_read_beside_the_verdict_never_green_unless_promoted(
        decision, negative, outcome, css, note):
    view = criterion_view(SPEC, decision, negative)
    assert (view.expression, view.outcome, view.css) == ("leak_ratio <= 0.0", outcome, css)
    assert note in view.note
    assert criterion_view({"intervention": {}}, {"verdict": "prune"}, True) is None


def test_descriptions_render_a_safe_markdown_subset(report):
    html_text = markdown.render(
        "*em* **strong** `code` [site](https://example.org/a?b=1&c=2) <mail@example.org>\n\n"
        "- [js](javascript:alert(1)) [JS](JaVaScRiPt:alert(1)) [ent](javascript&#58;alert(1))"
        " [data](data:text/html,hi) [rel](../index.html) <javascript:alert(2)>\n"
        "- <b onclick=x>raw</b> <script>alert(3)</script> ![img](https://example.org/i.png)"
        "\n\n<div>block html</div>\n\n# heading\x1b[31m red\x00")
    assert "<em>em</em>" in html_text and "<strong>strong</strong>" in html_text
    assert "<code>code</code>" in html_text and "<ul>" in html_text
    links = re.findall(r'<a href="([^"]*)" rel="nofollow noopener noreferrer">', html_text)
    # An image is not drawn (the CSP allows none): its http(s) address is a plain link.
    assert links == ["https://example.org/a?b=1&amp;c=2", "mailto:mail@example.org",
                     "https://example.org/i.png"]
    assert html_text.count("<a ") == 3  # nothing else became a link
    assert "[js](javascript:alert(1))" in html_text  # an unsafe link stays the text written
    for absent in ("<b", "<script", "<img", "<div", "<h1", "\x1b", "\x00"):
        assert absent not in html_text
    assert "&lt;b onclick=x&gt;raw&lt;/b&gt;" in html_text and "# heading red" in html_text
    index = report.read_text()
    assert "<em>digits</em>" in index and "<code>tiny</code>" in index
    assert 'href="javascript' not in index.lower() and 'href="data' not in index


def _row(name: str, parent: str | None, score: float, status: str = "promote") -> LineageRow:
    return LineageRow(name, parent, status, score, None, None, status, [], False, False)


def test_chart_labels_name_every_point_and_never_overlap():
    """Four rejected children scoring like their promoted sibling, and a path at 0 and 1:
    every point is labelled with its name and score, inside the picture, none on another."""
    path = [_row("v0", None, 0.0, "baseline"), _row("v1", "v0", 1.0), _row("v2", "v1", 0.5)]
    off = {"v1": [_row(f"v1-{k}", "v1", 0.5, "prune") for k in range(4)]}
    chart = svg.score_chart(path, off, {r.name: f"{r.name}.html" for r in
                                            [*path, *off["v1"]]})
    points = [*chart.path, *chart.off_path]
    assert [p.text for p in points] == ["v0 0.000", "v1 1.000", "v2 0.500", "v1-0 0.500",
                                        "v1-1 0.500", "v1-2 0.500", "v1-3 0.500"]
    boxes = [p.label_box() for p in points]
    for i, (left, top, right, bottom) in enumerate(boxes):
        assert left >= 0 and top >= 0 and right <= chart.width and bottom <= chart.height
        for other in boxes[i + 1:]:
            assert not svg.boxes_overlap(boxes[i], other), (points[i].text, other)


def test_missing_artifacts_list_example_ids_only(ws, tmp_path):
    folder = ws.root / ws.version("v2").records["run"]["artifact_dir"]
    moved = tmp_path / "away"
    shutil.move(folder, moved)
    try:
        index = build_report(ws, tmp_path / "report")
    finally:
        shutil.move(moved, folder)
    page = (index.parent / "versions" / "v2.html").read_text()
    assert "listed by id only" in page and "v2/0/train/" in page
    assert "bold prompt" not in page


def test_cli_writes_the_default_folder_and_refuses_a_foreign_one(ws, tmp_path, monkeypatch):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `report` a subcommand
    monkeypatch.chdir(ws.root)
    result = CliRunner().invoke(app, ["report"])
    assert result.exit_code == 0, result.output
    assert (ws.state_dir / "report" / "index.html").is_file()
    assert result.output.strip().endswith("index.html")
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["report", "--out", str(foreign)])
    assert isinstance(result.exception, EvoError) and "refusing" in str(result.exception)
    assert (foreign / "mine.txt").read_text() == "keep me"


# ------------------------------------------------------------------------- in a browser


class Chromium:
    """Headless Chromium driven over the DevTools protocol (one websocket, flat sessions)."""

    FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-port=0"]

    def __init__(self, binary: str, profile: Path) -> None:
        import websocket  # websocket-client, a dev dependency

        self.process = subprocess.Popen(
            [binary, *self.FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and len(port_file.read_text().split()) == 2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port, path = port_file.read_text().split()
        self.socket = websocket.create_connection(f"ws://127.0.0.1:{port}{path}", timeout=60,
                                                  suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        while True:
            reply = json.loads(self.socket.recv())
            if reply.get("id") == self.next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> None:
        while not any(e.get("method") == method and e.get("sessionId") == session
                      for e in self.events):
            self.events.append(json.loads(self.socket.recv()))

    def tab(self) -> str:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session)
        self.send("Emulation.setDeviceMetricsOverride", session, width=1280, height=900,
                  deviceScaleFactor=1, mobile=False)
        return session

    def open(self, session: str, url: str) -> list[str]:
        """Load `url`; return the console errors, exceptions and dialogs it caused."""
        self.events.clear()
        self.send("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired", session)
        problems = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Log.entryAdded" and params["entry"]["level"] == "error":
                problems.append(params["entry"]["text"])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                problems.append(str(params["args"]))
            elif method in ("Runtime.exceptionThrown", "Page.javascriptDialogOpening"):
                problems.append(f"{method}: {params}")
        return problems

    def js(self, session: str, expression: str):
        """Evaluate in the page from DevTools (the page's own CSP forbids every script)."""
        result = self.send("Runtime.evaluate", session, expression=expression,
                           returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium)")
    chromium = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield chromium
    chromium.close()


LINKS = ("[...document.querySelectorAll('a[href]')].map(a => [a.getAttribute('href'), "
         "!!a.closest('.md'), a.getAttribute('rel')])")
IDS = "[...document.querySelectorAll('[id]')].map(e => e.id)"
# Decode a PNG in a blank tab and count its colours and the pixels unlike the top-left one.
PIXELS = """new Promise(done => { const img = new Image(); img.onload = () => {
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data, colours = new Set(); let odd = 0;
  for (let i = 0; i < d.length; i += 4) {
    colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
    if (d[i] !== d[0] || d[i + 1] !== d[1] || d[i + 2] !== d[2]) odd++; }
  done({colours: colours.size, odd: odd / (d.length / 4)}); };
  img.src = 'data:image/png;base64,%s'; })"""


@needs_chromium
def test_every_page_loads_clean_and_every_link_resolves(report, ws, browser, tmp_path):
    session = browser.tab()
    site = report.parent
    queue, seen, anchors, wanted, external = [report.resolve()], set(), {}, [], set()
    while queue:
        page = queue.pop()
        if page in seen:
            continue
        seen.add(page)
        assert browser.open(session, page.as_uri()) == [], f"console errors on {page.name}"
        anchors[page] = set(browser.js(session, IDS))
        for href, in_markdown, rel in browser.js(session, LINKS):
            url = urlparse(href)
            if url.scheme or url.netloc:  # only a description's own http(s) link leaves
                assert in_markdown and url.scheme in ("http", "https", "mailto"), (
                    f"{page.name} links outside: {href}")
                assert "noopener" in rel and "noreferrer" in rel, href
                external.add(href)
                continue
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            assert target.is_file() and target.is_relative_to(site.resolve()), (
                f"{page.name}: broken link {href}")
            if url.fragment:
                wanted.append((page.name, href, target, unquote(url.fragment)))
            queue.append(target)
    assert seen == {p.resolve() for p in site.rglob("*.html")}  # every page is reachable
    assert external == {"https://arxiv.org/abs/2606.03108"}  # the project description's
    for source, href, target, fragment in wanted:
        assert fragment in anchors[target], f"{source}: {href} names no element"

    browser.open(session, report.as_uri())
    nodes = browser.js(session, "[...document.querySelectorAll('svg#lineage .node')]"
                                ".map(n => n.dataset.version)")
    assert sorted(nodes) == sorted(ws.versions()) == ["v0", "v1", "v2", "v3"]
    shot = browser.send("Page.captureScreenshot", session, format="png")["data"]
    (tmp_path / "index.png").write_bytes(base64.b64decode(shot))
    pixels = browser.js(browser.tab(), PIXELS % shot)
    assert pixels["colours"] > 20 and pixels["odd"] > 0.02, pixels


@needs_chromium
def test_rollout_markup_renders_as_text_in_the_browser(report, browser):
    session = browser.tab()
    assert browser.open(session, (report.parent / "versions" / "v2.html").as_uri()) == []
    assert browser.js(session, "document.scripts.length") == 0
    assert browser.js(session, "document.querySelectorAll('main img, main b, main i, "
                               "main em').length") == 0
    texts = browser.js(session, "[...document.querySelectorAll('pre.text, td, code')]"
                                ".map(e => e.textContent)")
    assert SCRIPT_PROMPT + clean(CONTROL_TEXT) in texts and HTML_RESPONSE in texts
    assert "<script>alert(4)</script>" in texts
    assert any(SCRIPT_RATIONALE in t for t in texts)


# Every score-chart point as the browser lays it out: its link's accessible <title>, its
# drawn label, and the label's box in the SVG's coordinates.
CHART_POINTS = """[...document.querySelectorAll('svg#score-chart a.point')].map(a => {
  const label = a.querySelector('text.label'), box = label.getBBox();
  return {version: a.dataset.version, title: a.firstElementChild.tagName + ':' +
          a.firstElementChild.textContent, text: label.textContent,
          box: [box.x, box.y, box.x + box.width, box.y + box.height]}; })"""


@needs_chromium
def test_chart_points_are_labelled_and_the_verdict_leads_in_the_browser(report, ws, browser):
    session = browser.tab()
    assert browser.open(session, report.as_uri()) == []
    points = browser.js(session, CHART_POINTS)
    scores = {row.name: row.score for row in lineage_rows(ws, ws.versions())}
    assert sorted(p["version"] for p in points) == ["v0", "v1", "v2"]  # v3 failed: no score
    width, height = browser.js(session, "const v = document.querySelector("
                                        "'svg#score-chart').viewBox.baseVal; [v.width, v.height]")
    for i, point in enumerate(points):
        assert point["title"].startswith(f"title:{point['version']}")
        assert point["text"] == f"{point['version']} {scores[point['version']]:.3f}"
        left, top, right, bottom = point["box"]
        assert left >= 0 and top >= 0 and right <= width and bottom <= height, point
        for other in points[i + 1:]:
            assert not svg.boxes_overlap(point["box"], other["box"]), (point, other)

    assert browser.open(session, (report.parent / "versions" / "v2.html").as_uri()) == []
    first = browser.js(session, "const h = document.querySelector('main h2'); "
                                "[h.textContent, h.getBoundingClientRect().top]")
    assert first[0] == "Gate decision" and first[1] < 400  # on the first screen, at the top
    colour = browser.js(session, "getComputedStyle(document.querySelector("
                                 "'#decision .criterion')).color")
    assert colour == "rgb(154, 103, 0)", colour  # held, in caution: not the promote green
