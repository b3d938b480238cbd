"""Picture a plan (``dspark plan MODEL --html``) and photograph it in Chromium, for docs/plans.md.

    .venv/bin/python scripts/plan_screenshot.py
    .venv/bin/python scripts/plan_screenshot.py --model benchmarks.models:resnet18 \
        --devices my_box.yaml --out /tmp/resnet18.png --html /tmp/resnet18.html

Without ``--model`` it plans the demo transformer block at seq 128 / dim 256 / hidden 1024 (written
to a temporary ONNX file) on tests/profiles/split_box.yaml, an edge box whose GPU runtime has no
Softmax or LayerNorm kernels, so the block splits between the GPU and the CPU. The plan is made by
the real CLI (``python -m dspark.cli plan ... --html``), then the page is opened in Debian's Chromium
(/usr/bin/chromium) through Playwright with the network off, sized to show the whole picture, and
saved as a PNG (default docs/img/plan-picture.png).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def demo_model(folder: Path) -> Path:
    import onnx
    from dspark.testing import demo_onnx

    path = folder / "demo_block.onnx"
    onnx.save(demo_onnx(seq=128, dim=256, hidden=1024), path)
    return path


def plan_html(model: str, devices: Path | None, out: Path) -> None:
    cmd = [sys.executable, "-m", "dspark.cli", "plan", model, "--html", str(out)]
    if devices is not None:
        cmd += ["--devices", str(devices)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")


def screenshot(html: Path, png: Path, width: int, scale: float, max_height: int) -> tuple[int, int]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="dspark-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=ARGS,
            viewport={"width": width, "height": 900}, device_scale_factor=scale)
        try:
            page = context.new_page()
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())
            page.goto(html.resolve().as_uri(), wait_until="load")
            # The whole page at once: the picture and the panels unscrolled (up to max_height).
            page.add_style_tag(content=".graph-wrap,.panels{max-height:none;overflow:visible}")
            height = min(int(page.evaluate("document.documentElement.scrollHeight")), max_height)
            page.set_viewport_size({"width": width, "height": height})
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(png))
        finally:
            context.close()
    return width, height


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="what `dspark plan` takes (default: the demo block at seq 128)")
    ap.add_argument("--devices", type=Path, default=ROOT / "tests" / "profiles" / "split_box.yaml",
                    help="device profile to plan for (default: tests/profiles/split_box.yaml)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "plan-picture.png")
    ap.add_argument("--html", type=Path, help="also keep the page here")
    ap.add_argument("--width", type=int, default=1320, help="viewport width in CSS pixels")
    ap.add_argument("--scale", type=float, default=1.25, help="device pixels per CSS pixel")
    ap.add_argument("--max-height", type=int, default=2400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dspark-plan-") as tmp:
        model = args.model or str(demo_model(Path(tmp)))
        html = args.html or Path(tmp) / "plan.html"
        plan_html(model, args.devices, html)
        w, h = screenshot(html, args.out, args.width, args.scale, args.max_height)
    print(f"wrote {args.out} ({w}x{h} CSS px at scale {args.scale:g})" + (f" and {args.html}" if args.html else ""))


if __name__ == "__main__":
    main()
