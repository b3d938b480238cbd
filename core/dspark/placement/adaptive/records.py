"""What the adaptive runner records and keeps: the runs it learned from, the plan installed, its tunables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dspark.placement.executor import CompiledPlan, PartitionFailed
from dspark.placement.placer import PartCost
from dspark.placement.plan import Plan

Key = tuple[str, str, str]  # (plugin, device id, op type)
RECHECK_DRIFT = 0.25  # a re-plan check runs the placer only once a correction moved this much
# Learning (and the look at free memory) is sampled: every run of a plan's first LEARN_ALL, then one in
# LEARN_EVERY. A learned run costs tens of us after the runtime's compute (docs/benchmarks.md, "Per-run
# overhead"): sampled more often, such runs move the median run.
LEARN_ALL, LEARN_EVERY = 32, 128


@dataclass
class RunRecord:
    """One run learned from (see LEARN_EVERY): which plan served it, and per partition (predicted ms at
    the time, measured ms)."""

    index: int
    plan_version: int
    total_ms: float  # first partition start to last partition end
    partitions: dict[int, tuple[float, float]]


@dataclass
class Active:
    """The plan installed now: compiled, with its partitions' predicted costs and its run count."""

    version: int
    plan: Plan
    compiled: CompiledPlan
    parts: list[PartCost]
    runs: int = 0


class StageFailed(Exception):
    """A partition failed while installing a plan: at compile or at the warm-up run."""

    def __init__(self, exc: PartitionFailed, stage: Literal["compile", "run"]) -> None:
        super().__init__(str(exc))
        self.exc, self.stage = exc, stage
