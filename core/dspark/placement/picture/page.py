"""A plan you can see: one self-contained HTML page drawing the graph, coloured by where each op runs.

:func:`render_plan_html` lays the plan out as boxes, one per partition, stacked in dependency order
(partitions that do not depend on each other side by side); inside a box its ops sit in the layers
networkx's ``topological_generations`` gives them. Each op is a node filled with its target's colour
(the legend maps colour -> ``plugin@device`` and runtime); an edge that leaves a partition is dashed
and labelled with the bytes that cross (the tensors' sizes at the graph's dim hints). Beside the
picture, a panel per partition lists its target, runtime, precision, ops, predicted time, the bids it
beat, bytes in and out and the partitions it waits for; above it, the plan's totals, gate and decision.

Above :data:`MAX_DRAWN_OPS` ops the picture collapses to one node per partition (a note says so).
The page loads nothing: no script, no font, no image; its Content-Security-Policy forbids fetching.
Elements carry stable ids and data attributes for tools and tests: ``g.op`` (``data-op``,
``data-op-type``, ``data-partition``, ``data-target``), ``g.partition`` / ``section.panel``
(``data-partition``, ``data-target``), ``.legend-item`` (``data-target``, ``data-runtime``),
``path.edge`` (``data-from``, ``data-to``, ``data-bytes``; ``.cross`` when it crosses partitions).
"""

from __future__ import annotations

import math
from collections import defaultdict
from html import escape

from dspark.graph.model import Graph
from dspark.placement.plan import Partition, Plan, tensor_bytes
from dspark.placement.picture.layout import (
    BOX_GAP_Y, Cubic, HEAD, LANE, MARGIN, MAX_DRAWN_OPS, NODE_H, NODE_W, PAD, PART_H, PART_W, UNPLACED, _Band,
    _Box, _a, _at, _colour, _crossing, _down, _fmt_bytes, _ink, _label, _layout_ops, _path, _place_boxes,
    _short, _skip, _spec_text,
)

__all__ = ["render_plan_html"]


class _Picture:
    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph, self.plan = graph, plan
        self.order = {op.name: i for i, op in enumerate(graph.ops)}
        self.where: dict[str, Partition] = {}
        for p in plan.partitions:
            for op in p.ops:
                if op in self.order:
                    self.where.setdefault(op, p)
        self.colours: dict[str, str] = {}
        for p in plan.partitions:
            self.colours.setdefault(p.target.key, _colour(len(self.colours)))
        self.unplaced = [op.name for op in graph.ops if op.name not in self.where]
        self.collapsed = len(graph.ops) > MAX_DRAWN_OPS
        self.op_id = {op.name: f"op-{i}" for i, op in enumerate(graph.ops)}

    def fill(self, op: str) -> str:
        p = self.where.get(op)
        return self.colours[p.target.key] if p else UNPLACED

    # -- the picture

    def svg(self) -> str:
        return self._collapsed_svg() if self.collapsed else self._full_svg()

    def _groups(self) -> list[tuple[int, list[str], Partition | None]]:
        groups: list[tuple[int, list[str], Partition | None]] = [
            (p.id, [o for o in p.ops if o in self.order], p) for p in self.plan.partitions]
        groups = [g for g in groups if g[1]]
        if self.unplaced:
            groups.append((-1, self.unplaced, None))
        return groups

    def _full_svg(self) -> str:
        preds: dict[str, list[str]] = defaultdict(list)
        succs: dict[str, list[str]] = defaultdict(list)
        pairs: dict[tuple[str, str], list[str]] = defaultdict(list)
        for a, b, t in self.graph.edges():
            if (a, b) not in pairs:
                preds[b].append(a)
                succs[a].append(b)
            pairs[(a, b)].append(t)
        boxes: dict[int, _Box] = {}
        parts: dict[int, Partition | None] = {}
        for pid, ops, part in self._groups():
            boxes[pid] = _layout_ops(self.graph, ops, self.order, preds, succs)
            boxes[pid].pid = pid
            parts[pid] = part
        width, height, bands = _place_boxes(self.plan, boxes)
        at: dict[str, tuple[float, float]] = {}
        for box in boxes.values():
            for op, (x, y) in box.ops.items():
                at[op] = (box.x + x, box.y + y)

        box_svg = [self._box(box, parts[pid]) for pid, box in boxes.items()]
        edge_svg: list[str] = []
        crossings: dict[tuple[str, int], list[tuple[str, list[str], float, float]]] = defaultdict(list)
        skips: list[float] = []  # the lanes of edges that pass rows of boxes, right of them
        for (a, b), tensors in pairs.items():
            if a not in at or b not in at:
                continue
            pa, pb = self.where.get(a), self.where.get(b)
            ia, ib = pa.id if pa else -1, pb.id if pb else -1
            segments = self._route(a, b, boxes[ia], boxes[ib], at, bands, skips)
            cross = ia != ib
            nbytes = tensor_bytes(self.graph, tensors)
            edge_svg.append(
                f'<path class="{"edge cross" if cross else "edge"}" d="{_path(segments)}" '
                f'data-from="{self.op_id[a]}" data-to="{self.op_id[b]}" data-bytes="{nbytes}" '
                f'marker-end="url(#arrow)"><title>{escape(", ".join(tensors))}: {escape(_fmt_bytes(nbytes))}'
                "</title></path>")
            if cross:  # labelled where it enters the destination's box: at the boundary
                entry = boxes[ib].y - BOX_GAP_Y / 2
                point = next((p for p in (_crossing(c, entry) for c in segments) if p), _at(segments[0], 0.5))
                crossings[(a, ib)].append((b, tensors, *point))
        label_svg = self._crossing_labels(crossings)
        width = max([width, *(x + 40 + MARGIN for x in skips)])
        node_svg = [self._node(op.name, *at[op.name]) for op in self.graph.ops if op.name in at]
        heads = [self._head(box, parts[pid]) for pid, box in boxes.items()]
        return self._svg(width, height, box_svg + edge_svg + node_svg + heads + label_svg)

    def _route(self, a: str, b: str, box_a: _Box, box_b: _Box, at: dict[str, tuple[float, float]],
               bands: list[_Band], skips: list[float]) -> list[Cubic]:
        """An edge's segments: straight down to the next row; else around the nodes in between, by a lane
        beside them; past whole rows of boxes, by a lane right of them."""
        (xa, ya), (xb, yb) = at[a], at[b]
        if yb <= ya:  # not a DAG in this order (a plan from another graph): just join them
            return [_down(xa + NODE_W / 2, ya + NODE_H, xb + NODE_W / 2, yb)]
        if box_a is box_b:
            if box_b.row[b] <= box_a.row[a] + 1:
                return [_down(xa + NODE_W / 2, ya + NODE_H, xb + NODE_W / 2, yb)]
            # an arc out of one node's side and into the other's, on the side they lean to
            side = 1 if xa + xb + NODE_W >= 2 * box_a.x + box_a.w else -1
            x1, x2 = (xa + NODE_W, xb + NODE_W) if side > 0 else (xa, xb)
            off = 28 + min(30, 3 * (box_b.row[b] - box_a.row[a]))
            cx = max(x1, x2) + off if side > 0 else min(x1, x2) - off
            return [((x1, ya + NODE_H / 2), (cx, ya + NODE_H / 2), (cx, yb + NODE_H / 2), (x2, yb + NODE_H / 2))]
        segments: list[Cubic] = []
        last_a = box_a.row[a] == max(box_a.row.values())
        if last_a:
            here = (xa + NODE_W / 2, ya + NODE_H)
        else:  # out of the node's side, down a lane to the bottom of its box
            side = 1 if xa + NODE_W / 2 >= box_a.x + box_a.w / 2 else -1
            x1 = xa + (NODE_W if side > 0 else 0)
            lane = x1 + side * LANE * 0.6
            bottom = box_a.y + box_a.h
            segments.append(((x1, ya + NODE_H / 2), (lane, ya + NODE_H / 2), (lane, ya + NODE_H / 2),
                             (lane, bottom)))
            here = (lane, bottom)
        passing = _skip(bands, box_a, here, box_b, skips)
        if passing:
            segments += passing
            here = passing[-1][3]
        if box_b.row[b] == 0:
            segments.append(_down(*here, xb + NODE_W / 2, yb))
        else:  # down a lane beside the destination, then into its side
            side = 1 if xb + NODE_W / 2 >= box_b.x + box_b.w / 2 else -1
            x2 = xb + (NODE_W if side > 0 else 0)
            lane = x2 + side * LANE * 0.6
            top = box_b.y + HEAD
            y2 = yb + NODE_H / 2
            segments += [_down(*here, lane, top), ((lane, top), (lane, y2), (lane, y2), (x2, y2))]
        return segments

    def _crossing_labels(self, crossings: dict[tuple[str, int], list[tuple[str, list[str], float, float]]]
                         ) -> list[str]:
        """One label per tensor set leaving an op for another partition (it crosses once), kept apart."""
        cell_w, cell_h = 100.0, 20.0  # a spatial hash of the labels placed so far
        grid: dict[tuple[int, int], list[tuple[float, float, float, float]]] = defaultdict(list)

        def clash(x: float, y: float, w: float, h: float) -> bool:
            cx, cy = int(x // cell_w), int(y // cell_h)
            return any(abs(x - px) < w + pw and abs(y - py) < h + ph
                       for i in (-1, 0, 1) for j in (-1, 0, 1) for px, py, pw, ph in grid.get((cx + i, cy + j), ()))

        out: list[str] = []
        for (a, _), entries in crossings.items():
            tensors = sorted({t for _, ts, _, _ in entries for t in ts})
            nbytes = tensor_bytes(self.graph, tensors)
            text = _fmt_bytes(nbytes)
            x, y = entries[0][2], entries[0][3]
            half_w, half_h = 3.6 * len(text) + 4, 8.0  # under cell_w / 2 and cell_h / 2
            for _ in range(8):
                if not clash(x, y, half_w, half_h):
                    break
                y += 2 * half_h + 1
            grid[(int(x // cell_w), int(y // cell_h))].append((x, y, half_w, half_h))
            to = " ".join(self.op_id[b] for b, _, _, _ in entries)
            out.append(_label(x, y, text, "boundary-label",
                              f'data-from="{self.op_id[a]}" data-to="{to}" data-bytes="{nbytes}"'))
        return out

    def _svg(self, width: float, height: float, body: list[str]) -> str:
        return (f'<svg id="plan-graph" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
                f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
                f'aria-label="{_a("graph of " + self.graph.name)}">'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/>'
                "</marker></defs>" + "".join(body) + "</svg>")

    def _box(self, box: _Box, part: Partition | None) -> str:
        if part is None:
            attrs, stroke = 'id="partition-unplaced" data-partition="" data-target=""', "#999999"
        else:
            attrs = f'id="partition-{part.id}" data-partition="{part.id}" data-target="{_a(part.target.key)}"'
            stroke = self.colours[part.target.key]
        return (f'<g class="partition" {attrs}><rect class="partition-box" x="{box.x:.1f}" y="{box.y:.1f}" '
                f'width="{box.w:.1f}" height="{box.h:.1f}" rx="10" style="stroke:{stroke}"/></g>')

    def _head(self, box: _Box, part: Partition | None) -> str:
        """The box's label, drawn over the edges that enter it; it links to the partition's panel."""
        if part is None:
            head = f"not in the plan: {len(box.ops)} op(s)"
        else:
            n = len(part.ops)
            head = (f"#{part.id}  {part.target.key} \u00b7 {part.predicted_ms:.3f} ms \u00b7 "
                    f"{n} op{'s' if n != 1 else ''}")
        text = (f'<text class="partition-label" x="{box.x + PAD:.1f}" y="{box.y + 19:.1f}">'
                f"{escape(_short(head, max(12, int((box.w - 2 * PAD) / 7.0))))}</text>")
        return f'<a href="#panel-{part.id}">{text}</a>' if part is not None else text

    def _node(self, name: str, x: float, y: float) -> str:
        op = self.graph.op(name)
        part = self.where.get(name)
        fill = self.fill(name)
        ink = _ink(fill)
        where = (f"partition #{part.id} on {part.target.key} ({part.target.runtime}, {part.precision})"
                 if part else "not in the plan")
        tip = "\n".join([f"{name} ({op.op_type})", where,
                         "inputs: " + ("; ".join(_spec_text(self.graph, t) for t in op.inputs if t) or "-"),
                         "outputs: " + ("; ".join(_spec_text(self.graph, t) for t in op.outputs if t) or "-")])
        return (f'<g class="op" id="{self.op_id[name]}" data-op="{_a(name)}" data-op-type="{_a(op.op_type)}" '
                f'data-partition="{part.id if part else ""}" data-target="{_a(part.target.key) if part else ""}">'
                f"<title>{escape(tip)}</title>"
                f'<rect class="op-box" x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="5" '
                f'style="fill:{fill}"/>'
                f'<text class="op-name" x="{x + NODE_W / 2:.1f}" y="{y + 15:.1f}" text-anchor="middle" '
                f'style="fill:{ink}">{escape(_short(name, 25))}</text>'
                f'<text class="op-type" x="{x + NODE_W / 2:.1f}" y="{y + 30:.1f}" text-anchor="middle" '
                f'style="fill:{ink}">{escape(_short(op.op_type, 28))}</text></g>')

    def _collapsed_svg(self) -> str:
        boxes = {pid: _Box(pid, PART_W, PART_H) for pid, _, _ in self._groups()}
        parts = {pid: part for pid, _, part in self._groups()}
        width, height, bands = _place_boxes(self.plan, boxes)
        flows: dict[tuple[int, int], set[str]] = defaultdict(set)  # tensors from one partition to another
        for a, b, t in self.graph.edges():
            pa, pb = self.where.get(a), self.where.get(b)
            ia, ib = pa.id if pa else -1, pb.id if pb else -1
            if ia != ib and ia in boxes and ib in boxes:
                flows[(ia, ib)].add(t)
        edges: list[str] = []
        labels: list[str] = []
        nodes: list[str] = []
        skips: list[float] = []
        for (src, dst), tensors in sorted(flows.items()):
            ba, bb = boxes[src], boxes[dst]
            nbytes = tensor_bytes(self.graph, sorted(tensors))
            segments = _skip(bands, ba, (ba.x + ba.w / 2, ba.y + ba.h), bb, skips)
            segments.append(_down(*segments[-1][3], bb.x + bb.w / 2, bb.y) if segments else
                            _down(ba.x + ba.w / 2, ba.y + ba.h, bb.x + bb.w / 2, bb.y))
            mx, my = _at(segments[-1], 0.5)
            ids = [f"partition-{i}" if i >= 0 else "partition-unplaced" for i in (src, dst)]
            edges.append(f'<path class="edge cross" d="{_path(segments)}" data-from="{ids[0]}" data-to="{ids[1]}" '
                         f'data-bytes="{nbytes}" marker-end="url(#arrow)"><title>{len(tensors)} tensor(s): '
                         f"{escape(_fmt_bytes(nbytes))}</title></path>")
            labels.append(_label(mx, my, _fmt_bytes(nbytes), "boundary-label",
                                 f'data-from="{ids[0]}" data-to="{ids[1]}" data-bytes="{nbytes}"'))
        width = max([width, *(x + 40 + MARGIN for x in skips)])
        for pid, box in boxes.items():
            part = parts[pid]
            fill = self.colours[part.target.key] if part else UNPLACED
            ink = _ink(fill)
            n = len(part.ops) if part else len(self.unplaced)
            line1 = f"#{part.id} {part.target.key}" if part else "not in the plan"
            ops = f"{n} op" if n == 1 else f"{n} ops"
            line2 = f"{ops}, {part.predicted_ms:.3f} ms" if part else ops
            line3 = part.target.runtime if part else ""
            attrs = (f'id="partition-{part.id}" data-partition="{part.id}" data-target="{_a(part.target.key)}"'
                     if part else 'id="partition-unplaced" data-partition="" data-target=""')
            cx = box.x + box.w / 2
            nodes.append(
                f'<g class="partition partition-node" {attrs}><title>{escape(line1)}\n{escape(line2)}'
                f"\n{escape(line3)}</title>"
                f'<rect class="op-box" x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w}" height="{box.h}" rx="8" '
                f'style="fill:{fill}"/>'
                + "".join(f'<text class="op-name" x="{cx:.1f}" y="{box.y + dy:.1f}" text-anchor="middle" '
                          f'style="fill:{ink}">{escape(_short(s, 34))}</text>'
                          for dy, s in ((24, line1), (44, line2), (62, line3)) if s)
                + "</g>")
        return self._svg(width, height, edges + nodes + labels)

    # -- the page around it

    def legend(self) -> str:
        items: list[str] = []
        for key, colour in self.colours.items():
            parts = [p for p in self.plan.partitions if p.target.key == key]
            runtimes = sorted({p.target.runtime for p in parts})
            n_ops = sum(len(p.ops) for p in parts)
            items.append(
                f'<li class="legend-item" data-target="{_a(key)}" data-runtime="{_a(", ".join(runtimes))}">'
                f'<span class="swatch" style="background-color:{colour}"></span>'
                f'<span class="legend-target">{escape(key)}</span> '
                f'<span class="legend-runtime">{escape(", ".join(runtimes) or "-")}</span> '
                f'<span class="legend-count">{len(parts)} partition(s), {n_ops} op(s)</span></li>')
        if self.unplaced:
            items.append(f'<li class="legend-item" data-target="" data-runtime="">'
                         f'<span class="swatch" style="background-color:{UNPLACED}"></span>'
                         f"not in the plan: {len(self.unplaced)} op(s)</li>")
        items.append('<li class="legend-edge"><svg width="44" height="12" aria-hidden="true">'
                     '<path class="edge cross" d="M2,6 L42,6"/></svg> crosses a partition boundary '
                     "(labelled with the bytes that cross)</li>")
        return '<ul class="legend">' + "".join(items) + "</ul>"

    def totals(self) -> str:
        plan = self.plan
        rows = [
            ("model", escape(plan.model), ""),
            ("ops", str(len(self.graph.ops)), f'data-ops="{len(self.graph.ops)}"'),
            ("partitions", str(len(plan.partitions)), f'data-partitions="{len(plan.partitions)}"'),
            ("predicted total", f"{plan.predicted_total_ms:.3f} ms", f'data-ms="{plan.predicted_total_ms!r}"'),
            ("of which transfers", f"{plan.transfer_ms:.3f} ms", f'data-ms="{plan.transfer_ms!r}"'),
            ("best single target", escape(f"{plan.best_single_target} {plan.best_single_ms:.3f} ms")
             if plan.best_single_target else "-", f'data-target="{_a(plan.best_single_target)}"'),
            ("gate", escape(plan.gate or "-"), ""),
            ("decision", escape(plan.decision or "-"), ""),
            ("solver", escape(plan.solver or "-"), ""),
            ("fingerprints", escape(f"graph {plan.graph_fingerprint}, hardware {plan.hardware_fingerprint}"), ""),
        ]
        cls = {"predicted total": "total", "of which transfers": "transfers", "best single target": "best-single"}
        return '<dl class="totals">' + "".join(
            f'<div class="fact {cls.get(k, k.replace(" ", "-"))}" {attrs}><dt>{k}</dt><dd>{v}</dd></div>'
            for k, v, attrs in rows) + "</dl>"

    def panels(self) -> str:
        out: list[str] = []
        for p in self.plan.partitions:
            colour = self.colours[p.target.key]
            b_in, b_out = tensor_bytes(self.graph, p.inputs), tensor_bytes(self.graph, p.outputs)
            deps = ", ".join(f'<a href="#panel-{d}">#{d}</a>' for d in p.depends_on) or "-"
            beaten = sorted(p.beaten_bids, key=lambda b: b.latency_ms)
            if beaten:
                rows = "".join(
                    f'<tr class="beaten-bid" data-target="{_a(b.target)}" data-latency-ms="{b.latency_ms!r}" '
                    f'data-precision="{_a(b.precision)}"><td>{escape(b.target)}</td>'
                    f'<td class="num">{b.latency_ms:.3f} ms</td>'
                    f'<td class="num ratio">{_ratio(b.latency_ms, p.predicted_ms)}</td><td>{escape(b.precision)}</td>'
                    "</tr>" for b in beaten)
                bids = ('<table class="beaten"><caption>bids it beat</caption><thead><tr><th>target</th>'
                        '<th class="num">predicted</th><th class="num" title="its time over the winner\'s">'
                        "ratio</th><th>precision</th></tr></thead>"
                        f"<tbody>{rows}</tbody></table>")
            else:
                bids = '<p class="no-beaten">no other target bid on these ops</p>'
            ops = "".join(f"<li>{escape(o)} <span class=\"dim\">"
                          f"{escape(self.graph.op(o).op_type) if o in self.order else '(not in the graph)'}"
                          f"</span></li>" for o in p.ops)
            out.append(
                f'<section class="panel" id="panel-{p.id}" data-partition="{p.id}" data-target="{_a(p.target.key)}">'
                f'<h3><span class="swatch" style="background-color:{colour}"></span>'
                f'<a href="#partition-{p.id}">#{p.id}</a> <span class="target">{escape(p.target.key)}</span></h3>'
                '<table class="facts"><tbody>'
                f'<tr><th>runtime</th><td class="runtime">{escape(p.target.runtime or "-")}</td>'
                f'<th>precision</th><td class="precision">{escape(p.precision)}</td></tr>'
                f'<tr><th>predicted</th><td class="predicted-ms" data-ms="{p.predicted_ms!r}">'
                f"{p.predicted_ms:.3f} ms</td>"
                f'<th>ops</th><td class="ops-count" data-ops="{len(p.ops)}">{len(p.ops)}</td></tr>'
                f'<tr><th>bytes in / out</th><td class="bytes" data-bytes-in="{b_in}" data-bytes-out="{b_out}">'
                f"{_fmt_bytes(b_in)} / {_fmt_bytes(b_out)}</td>"
                f'<th>after</th><td class="depends-on" data-depends-on="{" ".join(map(str, p.depends_on))}">'
                f"{deps}</td></tr>"
                f"</tbody></table>{bids}"
                f'<details class="op-list"><summary>{len(p.ops)} op(s)</summary><ol>{ops}</ol></details>'
                "</section>")
        return "".join(out)

    def note(self) -> str:
        if not self.collapsed:
            return ""
        return (f'<p class="note collapsed-note">This model has {len(self.graph.ops)} ops, more than '
                f"{MAX_DRAWN_OPS}: the picture shows one node per partition (edges labelled with the bytes "
                "between partitions); each partition's panel lists its ops.</p>")

    def hover_css(self) -> str:
        """Hovering a panel outlines its partition's nodes (no script: CSS :has)."""
        return "".join(
            f'body:has(#panel-{p.id}:hover) [data-partition="{p.id}"] .op-box{{stroke:#111;stroke-width:3px}}'
            for p in self.plan.partitions[:300])


def _ratio(latency: float, winner: float) -> str:
    return f"x{latency / winner:.2f}" if winner > 0 and math.isfinite(latency) else "-"


_CSS = """
:root{color-scheme:light;font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 font-size:14px;color:#1d1d1f;background:#fafafa}
body{margin:0;padding:16px 20px}
h1{font-size:20px;margin:0 0 10px}
h2{font-size:16px;margin:14px 0 8px}
h3{font-size:15px;margin:0 0 6px;display:flex;align-items:center;gap:6px}
a{color:inherit}
.totals{display:flex;flex-wrap:wrap;gap:4px 24px;margin:0 0 10px}
.totals .fact{display:flex;gap:6px}
.totals .gate,.totals .decision,.totals .solver,.totals .fingerprints{flex-basis:100%}
.totals dt{color:#666;white-space:nowrap}.totals dt::after{content:":"}
.totals dd{margin:0;font-weight:600;overflow-wrap:anywhere}
.legend{list-style:none;display:flex;flex-wrap:wrap;gap:6px 18px;padding:0;margin:0 0 10px}
.legend li{display:flex;align-items:center;gap:6px}
.legend-runtime,.legend-count,.dim{color:#666}
.swatch{display:inline-block;width:16px;height:16px;border-radius:3px;border:1px solid #0003;flex:none}
.note{background:#fff6d5;border:1px solid #e8d48a;padding:6px 10px;border-radius:6px}
.layout{display:grid;grid-template-columns:minmax(0,max-content) minmax(360px,1fr);gap:16px;align-items:start}
.graph-wrap{overflow:auto;max-height:86vh;background:#fff;border:1px solid #ddd;border-radius:8px}
.graph-wrap svg{display:block;margin:0 auto}
.panels{display:flex;flex-direction:column;gap:10px;max-height:86vh;overflow:auto}
.panel{background:#fff;border:1px solid #ddd;border-left-width:6px;border-radius:8px;padding:8px 12px}
.panel table{border-collapse:collapse;width:100%;margin:4px 0}
.panel th,.panel td{text-align:left;padding:2px 6px;border-bottom:1px solid #eee;vertical-align:top}
.panel .facts th{color:#666;font-weight:normal;white-space:nowrap}
.panel .beaten td{white-space:nowrap}
.panel caption{text-align:left;font-weight:600;padding:4px 0 2px}
.num{text-align:right;font-variant-numeric:tabular-nums}
.no-beaten{color:#666;margin:4px 0}
details ol{margin:4px 0;padding-left:22px;max-height:240px;overflow:auto}
.partition-box{fill:#ffffff;fill-opacity:.6;stroke-width:2.5;stroke-dasharray:none}
.partition-label{font-size:12.5px;font-weight:600;fill:#333;paint-order:stroke;stroke:#fff;stroke-width:4px;
 stroke-linejoin:round}
.op-box{stroke:#0005;stroke-width:1}
.op:hover .op-box,.partition-node:hover .op-box{stroke:#111;stroke-width:3px}
.op-name{font-size:12px;font-weight:600}
.op-type{font-size:11px}
.edge{fill:none;stroke:#8a8a8a;stroke-width:1.3}
.edge.cross{stroke:#333;stroke-width:2;stroke-dasharray:6 4}
.boundary-label{font-size:11.5px;font-weight:700;fill:#111;paint-order:stroke;stroke:#fff;stroke-width:5px;
 stroke-linejoin:round}
@media (max-width:1000px){.layout{grid-template-columns:1fr}.panels{max-height:none}}
"""


def render_plan_html(graph: Graph, plan: Plan, *, title: str | None = None) -> str:
    """One self-contained HTML page picturing ``plan`` over ``graph`` (see the module's docstring)."""
    pic = _Picture(graph, plan)
    heading = title if title is not None else f"Plan for {plan.model}"
    panel_css = "".join(f"#panel-{p.id}{{border-left-color:{pic.colours[p.target.key]}}}"
                        for p in plan.partitions)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(heading)}</title><style>{_CSS}{panel_css}{pic.hover_css()}</style></head>"
        f'<body><h1 id="title">{escape(heading)}</h1>'
        f'<section id="summary">{pic.totals()}{pic.legend()}{pic.note()}</section>'
        f'<div class="layout"><div class="graph-wrap" id="graph">{pic.svg()}</div>'
        f'<div class="panels" id="panels"><h2>Partitions</h2>{pic.panels()}</div></div>'
        "</body></html>\n")
