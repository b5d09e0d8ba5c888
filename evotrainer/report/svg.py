"""Geometry for the report's inline SVG pictures.

Python computes coordinates here; the templates draw them. Every label therefore goes
through Jinja2's autoescape like any other text, and the pictures need no script and no
plotting library (an SVG of a tree and a line chart is a few dozen elements)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from evotrainer.store.lineage import LineageRow
from evotrainer.store.records import NEGATIVE, JobState, Verdict

# Status → CSS class suffix; anything else (a backend's own state name) draws as "other".
STATUS_CLASSES = {
    **{verdict: verdict.value for verdict in Verdict},
    JobState.FAILED: "failed",
    JobState.STALLED: "failed",
    JobState.RUNNING: "running",
    JobState.PENDING: "running",
    JobState.SUCCEEDED: "succeeded",
    "approved": "proposed",
    "proposed": "proposed",
}
NEGATIVE_CLASSES = (*NEGATIVE, "failed")  # classes of what is kept as negative evidence


def status_class(status: str) -> str:
    return STATUS_CLASSES.get(status, "other")


def fmt(value: object, spec: str = ".3f") -> str:
    """A number in `spec`; "—" for None; anything else (a hand-edited record) as text."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return format(value, spec)


def score_line(row: LineageRow) -> str:
    """`avg@k 0.708  Δ +0.344 [+0.219, +0.469]`: the node's second line."""
    text = f"avg@k {fmt(row.score)}"
    if row.delta is not None:
        text += f"  Δ {row.delta:+.3f}"
    if row.ci is not None:
        text += f" [{row.ci[0]:+.3f}, {row.ci[1]:+.3f}]"
    if row.delta is not None and row.against != row.parent:
        text += f" vs {row.against}"
    return text


# ------------------------------------------------------------------------- lineage graph

INDENT, ROW_H, NODE_W, NODE_H, PAD = 22, 56, 330, 42, 8


@dataclass
class GraphNode:
    name: str
    href: str
    x: float
    y: float
    css: str
    negative: bool
    on_main: bool
    status: str
    score_text: str
    alerts: list[str]


@dataclass
class Graph:
    width: float
    height: float
    node_w: float = NODE_W
    node_h: float = NODE_H
    nodes: list[GraphNode] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)  # (path d, css)


def lineage_graph(rows: list[LineageRow], hrefs: dict[str, str]) -> Graph:
    """A tree view: one row per version in tree order, indented by depth, an elbow edge from
    each parent down to its children. Deep lineages grow downwards, not sideways."""
    names = {row.name for row in rows}
    depth: dict[str, int] = {}
    for row in rows:  # tree order: a parent always comes before its children
        depth[row.name] = depth[row.parent] + 1 if row.parent in names else 0
    graph = Graph(width=2 * PAD + NODE_W + INDENT * max(depth.values(), default=0),
                  height=2 * PAD + ROW_H * len(rows) - (ROW_H - NODE_H))
    at: dict[str, tuple[float, float]] = {}
    for i, row in enumerate(rows):
        x, y = PAD + INDENT * depth[row.name], PAD + ROW_H * i
        at[row.name] = (x, y)
        css = status_class(row.status)
        graph.nodes.append(GraphNode(
            name=row.name, href=hrefs[row.name], x=x, y=y, css=css,
            negative=css in NEGATIVE_CLASSES or row.pruned, on_main=row.on_main, status=row.status,
            score_text=score_line(row), alerts=row.alerts))
        if row.parent in at:
            px, py = at[row.parent]
            edge_css = "edge negative" if css in NEGATIVE_CLASSES or row.pruned else "edge"
            graph.edges.append(
                (f"M{px + INDENT / 2:g},{py + NODE_H:g} V{y + NODE_H / 2:g} H{x:g}", edge_css))
    return graph


# --------------------------------------------------------------------------- score chart

CHART_W, CHART_H = 640, 240
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 60, 20, 14, 40


LABEL_CHAR_W, LABEL_H = 6.7, 13  # a chart label's advance per character and line height


@dataclass
class ChartPoint:
    name: str
    href: str
    x: float
    y: float
    css: str
    label: str  # the point's <title>: what a screen reader or a hover tells
    score: float = 0.0
    bar: tuple[float, float] | None = None  # y of the CI bar's ends
    text: str = ""  # the label drawn beside the point: name and avg@k
    text_x: float = 0.0
    text_y: float = 0.0  # the label's baseline
    anchor: str = "middle"

    def label_box(self) -> tuple[float, float, float, float]:
        """(left, top, right, bottom) of the drawn label, for keeping labels apart."""
        width = LABEL_CHAR_W * len(self.text)
        left = {"start": self.text_x, "end": self.text_x - width}.get(
            self.anchor, self.text_x - width / 2)
        return (left, self.text_y - LABEL_H + 3, left + width, self.text_y + 3)


@dataclass
class Chart:
    width: float = CHART_W
    height: float = CHART_H
    left: float = MARGIN_L
    right: float = CHART_W - MARGIN_R
    top: float = MARGIN_T
    bottom: float = CHART_H - MARGIN_B
    path: list[ChartPoint] = field(default_factory=list)
    off_path: list[ChartPoint] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    line: str = ""


def score_chart(
    path: list[LineageRow],
    off_path: dict[str, list[LineageRow]],
    hrefs: dict[str, str],
) -> Chart:
    """Avg@k along the promoted path (a line), with the children each step rejected drawn
    one slot to the right of their parent. A path point's bar is the gate's interval of its
    gain, anchored at the mean of the version it was decided against (the gate's `mean_a`)."""
    chart = Chart()
    plot_h = chart.bottom - chart.top
    slots = max(len(path) + (1 if path and off_path.get(path[-1].name) else 0), 2)
    step_x = (chart.right - chart.left) / (slots - 1)

    def y_of(score: float) -> float:
        return chart.bottom - plot_h * min(1.0, max(0.0, score))

    chart.y_ticks = [(y_of(t), f"{t:.2f}") for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    for i, row in enumerate(path):
        if row.score is None:
            continue
        x = chart.left + step_x * i
        bar = None
        if row.ci is not None and row.against_mean is not None:
            bar = (y_of(row.against_mean + row.ci[0]), y_of(row.against_mean + row.ci[1]))
        chart.path.append(ChartPoint(row.name, hrefs[row.name], x, y_of(row.score),
                                     status_class(row.status), score_line(row), row.score, bar))
        for k, child in enumerate(off_path.get(row.name, [])):
            if child.score is None:
                continue
            # Just left of the next path point (their promoted sibling), fanned out so that
            # equal scores stay distinguishable.
            chart.off_path.append(ChartPoint(
                child.name, hrefs[child.name], x + step_x - 14 - 9 * k, y_of(child.score),
                status_class(child.status), f"{child.name}: {child.status}, {score_line(child)}",
                child.score))
    chart.line = " ".join(f"{p.x:.1f},{p.y:.1f}" for p in chart.path)
    _place_labels(chart)
    return chart


def boxes_overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether two (left, top, right, bottom) boxes share any area."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place_labels(chart: Chart) -> None:
    """`name avg@k` beside every point: above a path point (inside the plot at either end),
    left of a rejected child's cross (it sits just left of its promoted sibling). A label
    that would cover one placed before it moves up, or down when the top is near, a line at
    a time; points and labels are few, so the quadratic search costs nothing."""
    placed: list[tuple[float, ...]] = []
    last = len(chart.path) - 1
    points = [(p, "path", i) for i, p in enumerate(chart.path)]
    points += [(p, "off", 0) for p in chart.off_path]
    for point, kind, index in points:
        point.text = f"{point.name} {fmt(point.score)}"
        if kind == "path":
            # Above the point, or below it when a score near 1 leaves no room above.
            point.text_x = point.x
            point.text_y = point.y - 10 if point.y - 10 - LABEL_H > 0 else point.y + 18
            point.anchor = "start" if index == 0 else "end" if index == last else "middle"
            if index == last and index > 0:
                point.text_x += 6  # the end of the label just past the point's right edge
        else:
            point.text_x, point.text_y, point.anchor = point.x - 9, point.y + 4, "end"
        step = -LABEL_H if point.text_y - 2 * LABEL_H > 0 else LABEL_H
        for _ in range(12):  # never more labels than this at one spot
            box = point.label_box()
            if not any(boxes_overlap(box, other) for other in placed):
                break
            point.text_y += step
        placed.append(point.label_box())


# ----------------------------------------------------------------------------- sparkline

SPARK_W, SPARK_H = 120, 26


@dataclass
class Sparkline:
    points: str
    last: tuple[float, float]
    low: float
    high: float
    width: float = SPARK_W
    height: float = SPARK_H


def sparkline(series: list | None) -> Sparkline | None:
    """A per-step polyline scaled to its own range; None without two finite points."""
    pairs = [(float(s), float(v)) for s, v in series or []
             if v is not None and math.isfinite(v)]
    if len(pairs) < 2:
        return None
    steps, values = zip(*pairs, strict=True)
    lo, hi = min(values), max(values)
    s0, s1 = min(steps), max(steps)
    pad = 3

    def xy(step: float, value: float) -> tuple[float, float]:
        x = pad + (SPARK_W - 2 * pad) * ((step - s0) / (s1 - s0) if s1 > s0 else 0.5)
        # A flat series sits in the middle rather than on an edge.
        y = SPARK_H / 2 if hi == lo else pad + (SPARK_H - 2 * pad) * (hi - value) / (hi - lo)
        return x, y

    coords = [xy(s, v) for s, v in pairs]
    return Sparkline(" ".join(f"{x:.1f},{y:.1f}" for x, y in coords), coords[-1], lo, hi)
