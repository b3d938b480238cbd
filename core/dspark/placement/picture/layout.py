"""The plan picture's geometry: colours, sizes, op layers, partition boxes and the curves between them."""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, field
from html import escape

import networkx as nx

from dspark.graph.model import Graph
from dspark.placement.plan import Plan

MAX_DRAWN_OPS = 2000  # above this many ops, one node per partition
MAX_ROW = 8  # nodes side by side before a layer wraps onto another row
MAX_BOX_ROW = 6  # partition boxes side by side before a row of them wraps

NODE_W, NODE_H = 172, 38
GAP_X, GAP_Y = 14, 30
PAD, HEAD = 14, 28  # a partition box's padding and its label band
LANE = 32  # room beside the nodes for the edges that skip rows
BOX_GAP_X, BOX_GAP_Y = 36, 54
MARGIN = 16
PART_W, PART_H = 236, 76  # a partition's node in the collapsed picture

# Tableau 10: distinguishable, and legible under black or white text.
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac"]
UNPLACED = "#d9d9d9"


def _colour(i: int) -> str:
    if i < len(PALETTE):
        return PALETTE[i]
    r, g, b = colorsys.hls_to_rgb((i * 0.618033988749895) % 1.0, 0.55, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _ink(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill``."""
    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    lum = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#111111" if lum > 0.5 else "#ffffff"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return "-"


def _spec_text(graph: Graph, name: str) -> str:
    spec = graph.tensors.get(name)
    if spec is None:
        return name
    if not spec.rank_known:
        return f"{name}: {spec.dtype}[?]"
    weight = " (weight)" if name in graph.initializers else ""
    return f"{name}: {spec.dtype}[{', '.join(str(d) for d in spec.shape)}]{weight}"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def _a(value: object) -> str:
    """An attribute value, escaped (quotes included)."""
    return escape(str(value), quote=True)


# -- layout ----------------------------------------------------------------------------------------


@dataclass
class _Box:
    """A partition's rectangle; its ops' positions are relative to the box's top-left corner."""

    pid: int
    w: float = 0.0
    h: float = 0.0
    x: float = 0.0
    y: float = 0.0
    ops: dict[str, tuple[float, float]] = field(default_factory=dict)
    row: dict[str, int] = field(default_factory=dict)  # each op's row in the box
    band: int = 0  # the row of boxes it sits in


def _layers(graph: Graph, ops: list[str], order: dict[str, int], succs: dict[str, list[str]]) -> list[list[str]]:
    """The partition's ops in networkx's topological generations, constants moved next to their first reader."""
    chosen = set(ops)
    sub = nx.DiGraph()
    sub.add_nodes_from(ops)
    sub.add_edges_from((a, b) for a in ops for b in succs.get(a, ()) if b in chosen)
    try:
        gens = [sorted(g, key=order.__getitem__) for g in nx.topological_generations(sub)]
    except nx.NetworkXUnfeasible:  # not a DAG (a plan from another graph): one layer per op
        return [[o] for o in sorted(ops, key=order.__getitem__)]
    layer = {op: i for i, g in enumerate(gens) for op in g}
    inputs = set(graph.inputs)
    for op in ops:  # an op fed only by weights (a Constant, a shape) would crowd the first layer
        node = graph.op(op)
        if (not any(t in graph.producers or t in inputs for t in node.inputs if t)
                and sub.out_degree(op) > 0):
            layer[op] = max(0, min(layer[s] for s in sub.successors(op)) - 1)
    out: list[list[str]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for op in sorted(ops, key=order.__getitem__):
        out[layer[op]].append(op)
    return [g for g in out if g]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _slot_x(i: int, k: int, step: float) -> float:
    """Centre of slot ``i`` of ``k`` side by side, relative to the row's centre."""
    return (i - (k - 1) / 2) * step


def _layout_ops(graph: Graph, ops: list[str], order: dict[str, int], preds: dict[str, list[str]],
                succs: dict[str, list[str]]) -> _Box:
    """Rows of nodes, each layer ordered by the mean position of its predecessors (fewer crossings)."""
    step = NODE_W + GAP_X
    centre: dict[str, float] = {}  # x of each placed op's centre, relative to the box's centre line
    rows: list[list[str]] = []
    for layer in _layers(graph, ops, order, succs):
        k = min(len(layer), MAX_ROW)
        slot = {op: i % k for i, op in enumerate(layer)}

        def key(op: str, k: int = k, slot: dict[str, int] = slot) -> tuple[float, int]:
            placed = [centre[p] for p in preds.get(op, ()) if p in centre]
            guess = _mean(placed) if placed else _slot_x(slot[op], k, step)
            return guess, order[op]

        ranked = sorted(layer, key=key)
        for start in range(0, len(ranked), MAX_ROW):
            row = ranked[start:start + MAX_ROW]
            for i, op in enumerate(row):
                centre[op] = _slot_x(i, len(row), step)
            rows.append(row)
    widest = max((len(r) for r in rows), default=1)
    inner_w = widest * step - GAP_X
    w = max(inner_w + 2 * (PAD + LANE), 270)
    h = HEAD + PAD + len(rows) * (NODE_H + GAP_Y) - GAP_Y + PAD
    box = _Box(0, w, h)
    for r, row in enumerate(rows):
        for op in row:
            box.ops[op] = (w / 2 + centre[op] - NODE_W / 2, HEAD + PAD + r * (NODE_H + GAP_Y))
            box.row[op] = r
    return box


@dataclass
class _Band:
    """A row of boxes: its top, bottom and right end."""

    top: float
    bottom: float
    right: float


def _place_boxes(plan: Plan, boxes: dict[int, _Box]) -> tuple[float, float, list[_Band]]:
    """Partitions in rows by the generations of their dependency DAG; returns the picture's size."""
    dag = nx.DiGraph()
    dag.add_nodes_from(boxes)
    dag.add_edges_from((d, p.id) for p in plan.partitions for d in p.depends_on if d in boxes and d != p.id)
    try:
        gens = [sorted(g) for g in nx.topological_generations(dag)]
    except nx.NetworkXUnfeasible:
        gens = [[pid] for pid in boxes]
    rows: list[list[int]] = []
    centre: dict[int, float] = {}
    for gen in gens:
        def key(pid: int) -> tuple[float, int]:
            placed = [centre[d] for d in dag.predecessors(pid) if d in centre]
            return (_mean(placed) if placed else 0.0), pid

        ranked = sorted(gen, key=key)
        for start in range(0, len(ranked), MAX_BOX_ROW):
            row = ranked[start:start + MAX_BOX_ROW]
            row_w = sum(boxes[p].w for p in row) + BOX_GAP_X * (len(row) - 1)
            x = -row_w / 2
            for p in row:
                centre[p] = x + boxes[p].w / 2
                x += boxes[p].w + BOX_GAP_X
            rows.append(row)
    width = max((sum(boxes[p].w for p in r) + BOX_GAP_X * (len(r) - 1) for r in rows), default=0) + 2 * MARGIN
    if not rows:
        return width, 2 * MARGIN, []
    y: float = MARGIN
    bands: list[_Band] = []
    for i, row in enumerate(rows):
        for p in row:
            boxes[p].x = width / 2 + centre[p] - boxes[p].w / 2
            boxes[p].y = y
            boxes[p].band = i
        bottom = y + max(boxes[p].h for p in row)
        bands.append(_Band(y, bottom, max(boxes[p].x + boxes[p].w for p in row)))
        y = bottom + BOX_GAP_Y
    return width, y - BOX_GAP_Y + MARGIN, bands


# -- drawing ---------------------------------------------------------------------------------------


Cubic = tuple[tuple[float, float], tuple[float, float], tuple[float, float], tuple[float, float]]


def _at(c: Cubic, t: float) -> tuple[float, float]:
    u = 1 - t
    w = (u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t)
    return sum(k * p[0] for k, p in zip(w, c, strict=True)), sum(k * p[1] for k, p in zip(w, c, strict=True))


def _crossing(c: Cubic, y: float) -> tuple[float, float] | None:
    """Where the segment ``c`` (going down) crosses the height ``y``; None if it does not."""
    if not c[0][1] < y < c[3][1]:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _at(c, mid)[1] < y else (lo, mid)
    return _at(c, (lo + hi) / 2)


def _path(segments: list[Cubic]) -> str:
    d = f"M{segments[0][0][0]:.1f},{segments[0][0][1]:.1f}"
    for _, c1, c2, end in segments:
        d += f" C{c1[0]:.1f},{c1[1]:.1f} {c2[0]:.1f},{c2[1]:.1f} {end[0]:.1f},{end[1]:.1f}"
    return d


def _down(x1: float, y1: float, x2: float, y2: float) -> Cubic:
    """From a node's bottom to a node's top below it."""
    bend = max(24.0, abs(y2 - y1) / 2)
    return (x1, y1), (x1, y1 + bend), (x2, y2 - bend), (x2, y2)


def _skip(bands: list[_Band], box_a: _Box, here: tuple[float, float], box_b: _Box,
          skips: list[float]) -> list[Cubic]:
    """From ``here`` (below ``box_a``) past the rows of boxes between it and ``box_b``, on their right;
    no segments when there are none. Each such edge takes a lane of its own (six, reused)."""
    if box_b.band <= box_a.band + 1:
        return []
    passed = bands[box_a.band + 1:box_b.band]
    x = max(band.right for band in passed) + 18 + 9 * (len(skips) % 6)
    skips.append(x)
    top, bottom = passed[0].top, passed[-1].bottom
    return [_down(*here, x, top), ((x, top), (x, top), (x, bottom), (x, bottom))]


def _label(x: float, y: float, text: str, cls: str, attrs: str = "") -> str:
    return (f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" text-anchor="middle" dominant-baseline="middle"'
            f"{' ' + attrs if attrs else ''}>{escape(text)}</text>")
