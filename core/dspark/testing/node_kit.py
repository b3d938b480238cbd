"""The kit's sample of ONNX's node tests: for every op type a plugin bids on, a few of its cases.

Every op type of ONNX's node suite is offered (its single-op cases), and
every function ONNX also tests expanded into its body of ops (the
``*_expanded`` cases, grouped as ``"Op (expanded)"``), so every op type the
plugin would take is found, not only those of the kit's own op cases. Each
case takes the user's path (file, ``load_model``, forced plan,
``compile_plan(...).run``: :meth:`.NodeSuiteRunner.run_case`). Per op type, the plugin bids on the cases (calibration off, so
bids are cheap) until ``per_op`` of them are promised, trying first cases
spread over the op type's list by name; those are compiled, run and
compared with ONNX's expected outputs. An op type it abstains on is offered
every case. ``per_op=None`` bids on and runs them all. The
whole suite, every case, is ``scripts/onnx_node_conformance.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from dspark.testing.kit import ConformanceKit
from dspark.testing.onnx_node import CaseResult, NodeCase, NodeSuiteRunner, PluginNotTestable, node_cases
from dspark.testing.report import CheckResult

CHECK = "ONNX node test"


EXPANDED = " (expanded)"


def single_op_cases(op_types: Iterable[str] | None = None) -> dict[str, list[NodeCase]]:
    """The node cases made of one op type, by op type; the ``*_expanded`` cases of a function by
    ``"<op type> (expanded)"`` (the op type of the case they expand). Other multi-op cases are
    left to the full suite."""
    wanted = set(op_types) if op_types is not None else None
    cases = node_cases()
    single = {c.name: next(iter(c.op_types)) for c in cases if len(c.op_types) == 1}
    by_type: dict[str, list[NodeCase]] = {}
    for case in cases:
        if case.name in single:
            key = single[case.name]
            if wanted is not None and key not in wanted:
                continue
        elif case.name.endswith("_expanded") and case.name.removesuffix("_expanded") in single:
            op = single[case.name.removesuffix("_expanded")]
            if wanted is not None and op not in wanted:
                continue
            key = op + EXPANDED
        else:
            continue
        by_type.setdefault(key, []).append(case)
    return by_type


def _spread(items: list[NodeCase], n: int | None) -> list[NodeCase]:
    if n is None or len(items) <= n:
        return items
    if n <= 1:
        return items[:n]
    step = (len(items) - 1) / (n - 1)
    return [items[round(i * step)] for i in range(n)]


def _result(r: CaseResult) -> CheckResult:
    ok = r.outcome in ("pass", "abstain", "unsupported")
    ops = ",".join(r.op_types)
    return CheckResult(CHECK, r.case, r.device, ok=ok, skipped=r.outcome != "pass" and ok,
                       detail=f"{ops}: {r.outcome}" + (f": {r.detail}" if r.detail else ""))


def check_onnx_nodes(kit: ConformanceKit, *, per_op: int | None = 2,
                     op_types: Iterable[str] | None = None) -> list[CheckResult]:
    """Bid on every single-op node case; run up to ``per_op`` bid cases per op type; one result each."""
    try:
        runner = NodeSuiteRunner(kit.name, kit=kit)
    except PluginNotTestable as exc:
        return [CheckResult(CHECK, skipped=True, detail=str(exc))]
    results: list[CheckResult] = []
    abstained = 0
    for op_type, cases in sorted(single_op_cases(op_types).items()):
        # The spread picks first, then the rest: bidding stops once per_op cases are promised.
        first = _spread(cases, per_op)
        promised: list[NodeCase] = []
        for case in first + [c for c in cases if c not in first]:
            if per_op is not None and len(promised) >= per_op:
                break
            outcome = runner.bid_case(case)
            if outcome is None:
                promised.append(case)
            elif outcome.outcome == "failed":
                results.append(_result(outcome))
            else:
                abstained += 1
        results += [_result(runner.run_case(case)) for case in sorted(promised, key=lambda c: c.name)]
    if not any(r.ok and not r.skipped for r in results) and not any(not r.ok for r in results):
        results.append(CheckResult(CHECK, skipped=True, detail=f"abstains on all {abstained} node cases"))
    return results
