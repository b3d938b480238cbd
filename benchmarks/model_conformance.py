"""The conformance kit on every op of the placement benchmark's real models.

Usage: .venv/bin/python benchmarks/model_conformance.py [--plugins cpu,npu,torch]

Each distinct op (by signature) of every model there (``--models`` to pick) is run alone on every plugin that bids for it, fed the activations
the model really produces there, and compared with the torch reference within
the precision the plugin bid. Prints pass / abstain / fail counts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import MODELS, load_graph  # noqa: E402

from dspark.testing import check_plugin, model_op_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plugins", default="cpu,npu,torch")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    failed = False
    print(f"{'model':<20}{'plugin':<8}{'cases':>7}{'pass':>7}{'abstain':>9}{'fail':>6}")
    for name in args.models.split(","):
        graph, feeds = load_graph(name)
        cases = model_op_cases(graph, feeds)
        for plugin in args.plugins.split(","):
            report = check_plugin(plugin, cases=cases)
            ran = [r for r in report.results if r.check == "matches reference"]
            passed = sum(1 for r in ran if r.ok and not r.skipped)
            skipped = sum(1 for r in ran if r.skipped)
            fails = [r for r in ran if not r.ok and not r.skipped]
            failed |= bool(fails)
            print(f"{name:<20}{plugin:<8}{len(cases):>7}{passed:>7}{skipped:>9}{len(fails):>6}")
            for r in fails:
                print(f"    FAIL {r.case}: {r.detail}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
