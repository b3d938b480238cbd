"""Run ONNX's backend node tests through dspark plugins and print pass / abstain / wrong / failed counts.

    .venv/bin/python scripts/onnx_node_conformance.py torch numpy
    .venv/bin/python scripts/onnx_node_conformance.py torch --json --op Clip --op Pad
    .venv/bin/python scripts/onnx_node_conformance.py cpu --show wrong,failed
    .venv/bin/python scripts/onnx_node_conformance.py numpy --module numpy=dspark_numpy \
        --path plugins/dspark-numpy/src

Plugin names are those ``dspark devices --json`` lists (the torch reference
is ``torch``). The exit status is 1 when any plugin broke a promise (a wrong
or failed case), else 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import onnx

from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing.kit import default_host
from dspark.testing.onnx_node import (
    OUTCOMES,
    CaseResult,
    PluginNotTestable,
    broken_promises,
    counts,
    import_case,
    node_cases,
    run_node_suite,
)


def _module_host(name: str, module: str) -> PluginHost:
    """A host holding only the plugin module ``module``, registered as ``name`` (no entry point needed)."""
    host = PluginHost(PluginSettings(autoload=False))
    host.register(importlib.import_module(module), name)
    return host


def _merge(path: Path, report: dict[str, object]) -> None:
    """Write each plugin's counts into ``path``, keeping the entries of plugins not run now."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["onnx_version"] = onnx.__version__
    data["total_cases"] = report["total_cases"]
    data["random_cases_left_out"] = report["random_cases_left_out"]
    plugins = data.setdefault("plugins", {})
    for name, entry in report["plugins"].items():  # type: ignore[attr-defined]
        plugins[name] = {"device": entry["device"], "counts": entry["counts"]}
    data["plugins"] = dict(sorted(plugins.items()))
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plugins", nargs="+", help="plugin names, e.g. torch numpy cpu npu")
    parser.add_argument("--op", action="append", dest="ops", help="only cases using this op type (repeatable)")
    parser.add_argument("--case", action="append", dest="names", help="only this case name (repeatable)")
    parser.add_argument("--device", help="device id of the plugin (default: the first it reports)")
    parser.add_argument("--module", action="append", default=[], metavar="NAME=MODULE",
                        help="test plugin NAME from this importable module instead of its entry point")
    parser.add_argument("--path", action="append", default=[], help="directory to put on sys.path first")
    parser.add_argument("--out", type=Path, help="merge each plugin's counts into this JSON file "
                        "(e.g. docs/onnx-node-conformance.json; other plugins' entries are kept)")
    parser.add_argument("--json", action="store_true", help="print counts and every non-pass case as JSON")
    parser.add_argument("--show", default="wrong,failed",
                        help=f"outcomes whose cases are listed (comma-separated from {','.join(OUTCOMES)}; '' for none)")
    args = parser.parse_args(argv)
    show = {s for s in args.show.split(",") if s}
    sys.path[:0] = args.path
    modules = dict(m.split("=", 1) for m in args.module)
    report: dict[str, object] = {"total_cases": len(node_cases(args.ops, names=args.names)),
                                 "random_cases_left_out": len(node_cases(args.ops, names=args.names,
                                                                         include_random=True))
                                 - len(node_cases(args.ops, names=args.names)),
                                 "plugins": {}}
    broke = False
    for name in args.plugins:
        host = _module_host(name, modules[name]) if name in modules else None
        try:
            results = run_node_suite(name, op_types=args.ops, device=args.device, names=args.names, host=host)
        except PluginNotTestable as exc:
            loaded = host if host is not None else default_host(name)
            if name not in loaded.records or loaded.implements(name, "dspark_bid"):
                print(f"error: {exc}", file=sys.stderr)
                return 2
            # A plugin of other hooks only (a drafter): it bids on no op, so it promises nothing here.
            results = [CaseResult(c.name, tuple(sorted(c.op_types)), "unsupported" if import_case(c)[0] is None
                                  else "abstain", plugin=name) for c in node_cases(args.ops, names=args.names)]
        broke |= bool(broken_promises(results))
        listed = [r for r in results if r.outcome in show]
        report["plugins"][name] = {  # type: ignore[index]
            "device": results[0].device if results else "",
            "counts": counts(results),
            "cases": [{"case": r.case, "ops": list(r.op_types), "outcome": r.outcome, "detail": r.detail}
                      for r in listed],
        }
    if args.out is not None:
        _merge(args.out, report)
    if args.json:
        print(json.dumps(report, indent=2))
        return int(broke)
    print(f"{report['total_cases']} ONNX node cases ({report['random_cases_left_out']} random ones left out)")
    print(f"{'plugin':<10} " + " ".join(f"{o:>11}" for o in OUTCOMES))
    for name, entry in report["plugins"].items():  # type: ignore[attr-defined]
        print(f"{name:<10} " + " ".join(f"{entry['counts'][o]:>11}" for o in OUTCOMES))
    for name, entry in report["plugins"].items():  # type: ignore[attr-defined]
        for c in entry["cases"]:
            print(f"  {name} {c['outcome']:<11} {c['case']} [{','.join(c['ops'])}]: {c['detail']}")
    return int(broke)


if __name__ == "__main__":
    sys.exit(main())
