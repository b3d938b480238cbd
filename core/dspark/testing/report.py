"""The findings of a conformance run: one :class:`CheckResult` per check, a :class:`ConformanceReport` per plugin."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.types import PluginRecord


@dataclass(frozen=True)
class CheckResult:
    """One finding: which check, on which case and device, and what was seen."""

    check: str
    case: str = ""
    device: str = ""
    ok: bool = True
    detail: str = ""
    skipped: bool = False

    @property
    def outcome(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.ok else "FAIL")


@dataclass
class ConformanceReport:
    """Every check run against one plugin."""

    plugin: str
    results: list[CheckResult] = field(default_factory=list)
    record: PluginRecord | None = None

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok and not r.skipped]

    @property
    def skipped(self) -> list[CheckResult]:
        return [r for r in self.results if r.skipped]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.failures

    def cases(self, outcome: str = "PASS") -> list[str]:
        """Cases whose numerical check had ``outcome`` (PASS/FAIL/SKIP) on every device that ran it."""
        by_case: dict[str, set[str]] = {}
        for r in self.results:
            if r.check == "matches reference":
                by_case.setdefault(r.case, set()).add(r.outcome)
        if outcome == "PASS":
            return [c for c, o in by_case.items() if o == {"PASS"}]
        return [c for c, o in by_case.items() if outcome in o]

    def summary(self, *, only_problems: bool = False) -> str:
        rows = [r for r in self.results if not only_problems or not r.ok]
        head = ("check", "case", "device", "result", "detail")
        table = [head] + [(r.check, r.case or "-", r.device or "-", r.outcome, r.detail) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        passed = sum(r.ok and not r.skipped for r in self.results)
        lines = [f"conformance of plugin {self.plugin!r}: {passed} passed, {len(self.failures)} failed, "
                 f"{len(self.skipped)} skipped"]
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
