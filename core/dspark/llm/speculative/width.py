"""A lone sequence's step width where a change of the step's shape costs (Controller.change_ms).

A compiled graph with dynamic shapes (OpenVINO's) prepares every node again when a step's row count
differs from the previous step's, a cost of its own beside the rows. For one decode sequence the
plan then weighs, per drafter and draft length k, the step as drafted (1 + k rows, paying the change
when that is not the previous step's count) against the same draft padded with filler tokens up to
the previous step's rows (no change; the filler rows cost their rows and are verified like drafted
tokens, so the result is exactly plain decoding's), and a plain step of one row against a step of
filler only at the previous width. The last is rent against the change's price: it is taken only
while the filler paid since the last change stays within one change (ski rental), so a run of steps
with nothing to draft goes back to one row after a bounded loss.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

# The controller's types are not imported here: the controller imports this module.
Curve = tuple[list[float], list[float], list[int]]  # per k: expected tokens, head rows, rows computed


def keep_width(ctrl: Any, plan: Any, opts: list[Any], curves: list[Curve], prev: int, sunk_ms: float) -> Any:
    """``plan`` (a controller.Plan) for one decode sequence (its controller.Option list and curves) re-chosen with the change of shape priced; ``prev``: the previous
    step's rows. The returned plan's ``width`` is the rows to pad the step to (0: as drafted)."""
    th = ctrl.verify.theta
    c_tok, c_chunk, c_head = float(th[2]), float(th[3]), float(th[5])
    base = ctrl.verify.predict([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]) + sunk_ms
    change = ctrl.change_ms
    # (rate, drafter, k, expected tokens gained, head rows, width, filler cost)
    best = (1.0 / (base + (change if prev != 1 else 0.0)), None, 0, 0.0, 0.0, 0, 0.0)
    for o, (cums, heads, rows) in zip(opts, curves):
        for k, (cum, head, r) in enumerate(zip(cums, heads, rows), 1):
            t = base + c_tok * r + c_chunk + c_head * head + (0.0 if o.sunk else ctrl.draft_time(o.drafter, k, 1))
            exact = (1.0 + cum) / (t + (change if 1 + r != prev else 0.0))
            if exact > best[0]:
                best = (exact, o.drafter, k, cum, head, 0, 0.0)
            fill = prev - 1 - r
            if fill > 0:
                padded = (1.0 + cum) / (t + (c_tok + c_head) * fill)
                if padded > best[0]:
                    best = (padded, o.drafter, k, cum, head + fill, prev, 0.0)
    if prev > 1:
        rent = (c_tok + c_head) * (prev - 1) + c_chunk
        if ctrl.filler_ms + rent <= change and 1.0 / (base + rent) > best[0]:
            best = (1.0 / (base + rent), None, 0, 0.0, float(prev - 1), prev, rent)
    rate, drafter, k, gain, head, width, rent_paid = best
    ctrl.filler_ms = ctrl.filler_ms + rent_paid if rent_paid else 0.0
    choice = replace(plan.choices[0], drafter=drafter, k=k, gain=gain, head=head)
    return replace(plan, choices=[choice], rate=rate, width=width)
