"""Adaptive execution: measured latency corrects the cost model, and the plan follows.

Runs record each partition's measured latency (every run of a plan's first
LEARN_ALL, then one in LEARN_EVERY: the hot path stays lean). Per (plugin, device, op
type) an exponentially weighted average of measured / predicted is kept and
written into the bid table's ``correction`` factors; a partition's ratio is
given to each op type it holds, since one measurement cannot tell its ops
apart. The average is fed the median of the last few ratios, so one run
slowed by a neighbour process does not swing the model. Every few runs
(fewer and fewer while nothing changes) the placer runs again on the
corrected table, in a background thread; when the new plan is predicted
faster than the current one (both under the corrected model) by more than
the model's error, or when a device's free memory (looked at on the runs
learned from, at most every ``memory_every_s``) drops below what the current plan keeps there, the new
plan is compiled, warmed up and swapped in between runs: a run in flight
finishes on the plan it started with, and callers never wait for a re-plan.
Nothing per run walks the graph: spans become corrections through keys
computed once per installed plan.

Plans predicted within the cost model's error of each other are not chosen
by prediction: the first run (and, when corrections bring a new plan that
close to the current one, the next run) races them on the caller's inputs
(:mod:`dspark.placement.adaptive.trial`) and the measured fastest is committed. Once a
race has run, its laps corrected the model, so a later rival must be
predicted faster than the current plan to be raced: each race costs the
caller's time, and a split one partition away from a measured loser is not
news.

A partition whose compile or run fails is charged to its plugin (see
:mod:`dspark.host.faults`), its target's bids for those ops leave the bid
table, and the runner re-plans and goes on: a long-running process does not
lose a runtime, or stop, because one subgraph would not compile or run.
"""

from dspark.placement.adaptive.plan_store import DiskPlanStore, KeptPlan, PlanStore
from dspark.placement.adaptive.records import LEARN_ALL, LEARN_EVERY, RunRecord
from dspark.placement.adaptive.runner import AdaptiveRunner

__all__ = ["LEARN_ALL", "LEARN_EVERY", "AdaptiveRunner", "DiskPlanStore", "KeptPlan", "PlanStore", "RunRecord"]
