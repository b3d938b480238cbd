"""The plan picture (``dspark plan MODEL --html``): its page, the CLI flag, and what Chromium renders of it.

The plan is of the demo block at seq 128 / dim 256 on tests/profiles/split_box.yaml (a GPU runtime
without Softmax or LayerNorm kernels), which splits it deterministically into partitions on two
targets. The browser test needs Debian's Chromium (/usr/bin/chromium; .ci/run installs it) and
skips without it; the others run anywhere.
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path
from typing import Any

import onnx
import pytest
from dspark.cli.app import fmt_bytes
from dspark.placement.plan import tensor_bytes
from dspark.graph.model import Graph, Op, TensorSpec
from dspark.placement import placer
from dspark.placement.picture import layout, render_plan_html
from dspark.placement.picture import page as page_module
from dspark.placement.plan import BidSummary, Partition, Plan, Target
from dspark.placement.profile import profile_host
from dspark.testing import demo_onnx
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "tests" / "profiles" / "split_box.yaml"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def block() -> Graph:
    return Graph.from_onnx(demo_onnx(seq=128, dim=256, hidden=1024), name="demo_block_128")


@pytest.fixture(scope="module")
def split() -> tuple[Graph, Plan]:
    graph = block()
    host, inv = profile_host(PROFILE)
    plan = placer.plan(graph, host, inv)
    assert len(plan.partitions) >= 3 and len({p.target.key for p in plan.partitions}) >= 2, plan.partitions
    assert any(p.beaten_bids for p in plan.partitions)
    return graph, plan


@pytest.fixture(scope="module")
def page_html(split: tuple[Graph, Plan]) -> str:
    return render_plan_html(*split)


def attr(html: str, cls: str, name: str) -> list[str]:
    """``name`` of every element whose class list starts with ``cls``, in document order."""
    return [m.group(1) for m in re.finditer(rf'class="{cls}(?: [^"]*)?"[^>]*?\b{name}="([^"]*)"', html)]


# -- the page, without a browser -----------------------------------------------------------------


def test_page_draws_every_op_and_explains_every_partition(split: tuple[Graph, Plan], page_html: str) -> None:
    graph, plan = split
    assert page_html.startswith("<!DOCTYPE html>") and "<svg" in page_html
    assert render_plan_html(graph, plan) == page_html  # deterministic
    assert sorted(attr(page_html, "op", "data-op")) == sorted(op.name for op in graph.ops)
    owner = plan.assignment()
    for m in re.finditer(r'<g class="op"[^>]*data-op="([^"]*)"[^>]*data-target="([^"]*)"', page_html):
        assert owner[m.group(1)] == m.group(2)
    for p in plan.partitions:
        panel = re.search(rf'<section class="panel" id="panel-{p.id}".*?</section>', page_html, re.S)
        assert panel, p.id
        text = panel.group(0)
        assert f'data-target="{p.target.key}"' in text and p.target.runtime in text and p.precision in text
        assert f'data-ops="{len(p.ops)}"' in text and f"{p.predicted_ms:.3f} ms" in text
        assert f'data-bytes-in="{tensor_bytes(graph, p.inputs)}"' in text
        assert f'data-bytes-out="{tensor_bytes(graph, p.outputs)}"' in text
        assert f'data-depends-on="{" ".join(map(str, p.depends_on))}"' in text
        for b in p.beaten_bids:
            assert f'data-target="{b.target}"' in text and f"{b.latency_ms:.3f}" in text
    for needle in (f"{plan.predicted_total_ms:.3f} ms", plan.gate, plan.best_single_target):
        assert escape(needle) in page_html
    # A legend entry per target, and dashed edges across partitions labelled with their bytes.
    assert sorted(attr(page_html, "legend-item", "data-target")) == sorted({p.target.key for p in plan.partitions})
    crossing = attr(page_html, "boundary-label", "data-bytes")
    assert crossing and all(int(b) > 0 for b in crossing)


def test_page_is_self_contained(page_html: str) -> None:
    assert "<script" not in page_html and "<link" not in page_html and "<img" not in page_html
    assert "@import" not in page_html and "src=" not in page_html
    assert "default-src 'none'" in page_html  # the page's own CSP forbids any fetch
    urls = set(re.findall(r"https?://[^\s\"')]+", page_html))
    assert urls <= {"http://www.w3.org/2000/svg"}  # the SVG namespace: a name, never fetched


def tiny(names: list[str], op_type: str = "Relu") -> Graph:
    """A chain of ``op_type`` ops named ``names`` over a (1, 64) float32 tensor."""
    tensors = {"x": TensorSpec(name="x", dtype="float32", shape=(1, 64))}
    ops, prev = [], "x"
    for i, name in enumerate(names):
        out = f"t{i}"
        tensors[out] = TensorSpec(name=out, dtype="float32", shape=(1, 64))
        ops.append(Op(name=name, op_type=op_type, inputs=[prev], outputs=[out]))
        prev = out
    return Graph(name="tiny <graph>", ops=ops, tensors=tensors, inputs=["x"], outputs=[prev])


def hand_plan(graph: Graph, cut: int, targets: tuple[str, str] = ("cpu@cpu", "gpu<x>@dev\"1")) -> Plan:
    (pa, da), (pb, db) = (t.split("@", 1) for t in targets)
    names = [op.name for op in graph.ops]
    return Plan(
        model=graph.name, graph_fingerprint="g", hardware_fingerprint="h", predicted_total_ms=1.5,
        gate="split <beats> single", decision="predicted", best_single_target=targets[0], best_single_ms=2.0,
        partitions=[
            Partition(id=0, target=Target(plugin=pa, device_id=da, runtime="rt<&>"), ops=names[:cut],
                      inputs=["x"], outputs=[f"t{cut - 1}"], predicted_ms=0.5,
                      beaten_bids=[BidSummary(target=targets[1], latency_ms=0.9, precision="float16")]),
            Partition(id=1, target=Target(plugin=pb, device_id=db, runtime="rt2"), ops=names[cut:],
                      inputs=[f"t{cut - 1}"], outputs=[graph.outputs[0]], predicted_ms=1.0, depends_on=[0]),
        ])


def test_names_are_escaped() -> None:
    evil = ['<script>alert("a")</script>', 'quote"d & <b>', "plain"]
    graph = tiny(evil, op_type="Relu<i>")
    page = render_plan_html(graph, hand_plan(graph, 1), title="<title> & more")
    for raw in (*evil[:2], "Relu<i>", "gpu<x>", "rt<&>", "<beats>", "tiny <graph>", "<title> & more"):
        assert raw not in page, raw
    assert "&lt;script&gt;alert(&quot;a&quot;)&lt;/script&gt;" in page
    assert "gpu&lt;x&gt;@dev&quot;1" in page and "Relu&lt;i&gt;" in page
    assert "<title>&lt;title&gt; &amp; more</title>" in page


def test_ops_outside_the_plan_are_drawn_grey() -> None:
    graph = tiny(["a", "b", "c", "d"])
    plan = hand_plan(graph, 1)
    plan.partitions[1].ops = ["b", "c"]  # "d" in no partition: a plan from an older graph
    page = render_plan_html(graph, plan)
    node = re.search(r'<g class="op"[^>]*data-op="d"[^>]*>.*?</g>', page, re.S)
    assert node and 'data-partition=""' in node.group(0) and layout.UNPLACED in node.group(0)
    assert "not in the plan" in page


def boxes(page: str, cls: str) -> list[tuple[float, float, float, float]]:
    return [tuple(float(v) for v in m.groups())  # type: ignore[misc]
            for m in re.finditer(rf'class="{cls}" x="([-\d.]+)" y="([-\d.]+)" width="([\d.]+)" height="([\d.]+)"',
                                 page)]


def overlapping(rects: list[tuple[float, float, float, float]]) -> list[tuple[Any, Any]]:
    """Pairs of rectangles (x, y, w, h) that overlap: a sweep over x, so thousands stay cheap."""
    found: list[tuple[Any, Any]] = []
    active: list[tuple[float, float, float, float]] = []
    for r in sorted(rects):
        active = [a for a in active if a[0] + a[2] > r[0]]
        found += [(a, r) for a in active if a[1] < r[1] + r[3] and r[1] < a[1] + a[3]]
        active.append(r)
    return found


def wide_graph(n_blocks: int) -> Graph:
    """Blocks of a weight-fed Constant, three parallel branches and a join, plus a skip: ~6 ops a block."""
    tensors = {"x": TensorSpec(name="x", dtype="float32", shape=("batch", 32))}
    ops: list[Op] = []
    prev = "x"

    def add(name: str, op_type: str, inputs: list[str]) -> str:
        tensors[name + ":0"] = TensorSpec(name=name + ":0", dtype="float32", shape=("batch", 32))
        ops.append(Op(name=name, op_type=op_type, inputs=inputs, outputs=[name + ":0"]))
        return name + ":0"

    for i in range(n_blocks):
        c = add(f"b{i}/const", "Constant", [])
        branches = [add(f"b{i}/br{j}", "Mul", [prev, c]) for j in range(3)]
        join = add(f"b{i}/join", "Sum", branches)
        prev = add(f"b{i}/skip", "Add", [join, prev])
    return Graph(name="wide", ops=ops, tensors=tensors, inputs=["x"], outputs=[prev], dim_hints={"batch": 4})


def test_a_large_graph_renders_without_overlaps() -> None:
    graph = wide_graph(120)  # 720 ops: a ViT's size
    names = [op.name for op in graph.ops]
    plan = hand_plan(graph, 300)  # blocks 0-49 | 50-119
    plan.partitions[0].outputs, plan.partitions[1].inputs = ["b49/skip:0"], ["b49/skip:0"]
    page = render_plan_html(graph, plan)
    nodes = boxes(page, "op-box")
    assert len(nodes) == len(names) and not overlapping(nodes)
    assert not overlapping(boxes(page, "partition-box"))
    # A Constant sits in the row just above its readers, not with every other one in the first layer.
    top = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'data-op="([^"]*)"[^>]*>(?:<title>[^<]*</title>)?<rect class="op-box" x="[-\d.]+" y="([-\d.]+)"', page)}
    assert len(top) == len(names)
    for i in (0, 60, 119):
        assert top[f"b{i}/br0"] - top[f"b{i}/const"] == layout.NODE_H + layout.GAP_Y
    # The crossing is labelled with the bytes at the dim hint: batch 4 x 32 float32.
    assert attr(page, "boundary-label", "data-bytes") == [str(4 * 32 * 4)]


def test_collapses_to_partitions_above_the_threshold(monkeypatch: pytest.MonkeyPatch,
                                                     split: tuple[Graph, Plan]) -> None:
    graph, plan = split
    monkeypatch.setattr(page_module, "MAX_DRAWN_OPS", 10)
    page = render_plan_html(graph, plan)
    assert 'class="op"' not in page and "collapsed-note" in page
    assert f"This model has {len(graph.ops)} ops, more than 10" in page
    nodes = re.findall(r'<g class="partition partition-node" id="partition-(\d+)"', page)
    assert sorted(map(int, nodes)) == [p.id for p in plan.partitions]
    flows = re.findall(r'class="edge cross"[^>]*data-from="partition-(\d+)" data-to="partition-(\d+)"', page)
    assert {(int(a), int(b)) for a, b in flows} == {(d, p.id) for p in plan.partitions for d in p.depends_on}
    assert len(re.findall(r'<section class="panel"', page)) == len(plan.partitions)


# -- the CLI flag --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("picture") / "block128.onnx"
    onnx.save(demo_onnx(seq=128, dim=256, hidden=1024), path)
    return path


def test_cli_writes_the_page(block_file: Path, tmp_path: Path) -> None:
    from dspark.cli.main import app

    out = tmp_path / "plan.html"
    r = CliRunner().invoke(app, ["plan", str(block_file), "--devices", str(PROFILE), "--html", str(out)])
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout and "predicted total" in r.stdout
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and len(attr(page, "op", "data-op")) == 20
    assert len(set(attr(page, "op", "data-target"))) >= 2
    # --json: stdout stays the plan's JSON (the same plan), the note goes to stderr.
    out2 = tmp_path / "again.html"
    r = CliRunner().invoke(app, ["plan", str(block_file), "--json", "--devices", str(PROFILE), "--html", str(out2)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [p["plugin"] + "@" + p["device"] for p in data["partitions"]] == re.findall(
        r'<section class="panel" id="panel-\d+" data-partition="\d+" data-target="([^"]*)"', out2.read_text())
    assert f"wrote {out2}" in r.stderr
    # An unwritable path is a one-line error, exit status 2.
    r = CliRunner().invoke(app, ["plan", "demo", "--devices", str(PROFILE), "--html", str(tmp_path / "no" / "x.html")])
    assert r.exit_code == 2 and "cannot write" in r.stderr and "Traceback" not in r.output


# -- in Chromium ---------------------------------------------------------------------------------

RENDERED = """() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; };
  const legend = {};
  for (const li of document.querySelectorAll('.legend-item')) {
    legend[li.dataset.target] = getComputedStyle(li.querySelector('.swatch')).backgroundColor;
  }
  const parts = {};
  for (const g of document.querySelectorAll('g.partition')) {
    parts[g.dataset.partition] = {target: g.dataset.target, box: box(g.querySelector('rect')),
                                  stroke: getComputedStyle(g.querySelector('rect')).stroke};
  }
  const ops = [...document.querySelectorAll('g.op')].map((g) => ({
    op: g.dataset.op, partition: g.dataset.partition, target: g.dataset.target,
    fill: getComputedStyle(g.querySelector('rect')).fill, box: box(g.querySelector('rect')),
    title: g.querySelector('title').textContent, visible: g.checkVisibility()}));
  const panels = {};
  for (const s of document.querySelectorAll('section.panel')) {
    panels[s.dataset.partition] = {
      target: s.dataset.target, text: s.innerText, bytes: s.querySelector('td.bytes').innerText,
      bids: [...s.querySelectorAll('tr.beaten-bid')].map((tr) => tr.dataset.target),
      bidText: [...s.querySelectorAll('tr.beaten-bid')].map((tr) => tr.innerText)};
  }
  const labels = [...document.querySelectorAll('text.boundary-label')].map((t) => ({
    text: t.textContent, bytes: Number(t.dataset.bytes), box: box(t)}));
  return {legend, parts, ops, panels, labels};
}"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium "
                                                   "(apt-get install chromium; .ci/run installs it)")
def test_chromium_renders_the_plan(split: tuple[Graph, Plan], page_html: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev extra)")
    graph, plan = split
    path = tmp_path / "plan.html"
    path.write_text(page_html, encoding="utf-8")
    url = path.as_uri()
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            context.on("request", lambda r: requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load")
            seen: dict[str, Any] = page.evaluate(RENDERED)
            title = page.title()
        finally:
            context.close()
    assert errors == []
    assert requests == []
    assert title == f"Plan for {graph.name}"

    # Every op has a visible node, in its partition's colour, the one the legend gives its target.
    ops = {o["op"]: o for o in seen["ops"]}
    assert sorted(ops) == sorted(op.name for op in graph.ops)
    owner = {op: p for p in plan.partitions for op in p.ops}
    legend = seen["legend"]
    assert set(legend) == {p.target.key for p in plan.partitions}
    assert len(set(legend.values())) == len(legend)  # a colour per target
    for name, o in ops.items():
        part = owner[name]
        assert o["visible"] and o["partition"] == str(part.id) and o["target"] == part.target.key
        assert o["fill"] == legend[part.target.key], name
        # ... inside its partition's box, whose outline has the same colour.
        px, py, pw_, ph = seen["parts"][str(part.id)]["box"]
        x, y, w, h = o["box"]
        assert px <= x and py <= y and x + w <= px + pw_ and y + h <= py + ph, name
        assert seen["parts"][str(part.id)]["stroke"] == legend[part.target.key]
        # Hovering shows name, type, partition and shapes.
        op = graph.op(name)
        assert name in o["title"] and op.op_type in o["title"] and f"partition #{part.id}" in o["title"]
        spec = graph.tensors[op.outputs[0]]
        assert f"{spec.dtype}[{', '.join(map(str, spec.shape))}]" in o["title"]
    assert not overlapping([tuple(o["box"]) for o in ops.values()])
    assert not overlapping([tuple(p["box"]) for p in seen["parts"].values()])

    # Each partition's panel: its target, the bids it beat, its bytes in and out.
    for p in plan.partitions:
        panel = seen["panels"][str(p.id)]
        assert panel["target"] == p.target.key and p.target.runtime in panel["text"]
        assert sorted(panel["bids"]) == sorted(b.target for b in p.beaten_bids)
        for b, text in zip(sorted(p.beaten_bids, key=lambda b: b.latency_ms), panel["bidText"], strict=True):
            assert b.target in text and f"{b.latency_ms:.3f}" in text and b.precision in text
        b_in, b_out = tensor_bytes(graph, p.inputs), tensor_bytes(graph, p.outputs)
        assert panel["bytes"] == f"{fmt_bytes(b_in)} / {fmt_bytes(b_out)}"
        assert f"{p.predicted_ms:.3f} ms" in panel["text"] and p.precision in panel["text"]

    # The boundaries are labelled with the bytes that cross them, and the labels do not collide.
    labels = seen["labels"]
    assert labels and all(lab["text"] == fmt_bytes(lab["bytes"]) and lab["bytes"] > 0 for lab in labels)
    assert not overlapping([tuple(lab["box"]) for lab in labels])
