"""Checks a plugin against the contract and its numbers against the torch reference.

Every hook is called through :meth:`PluginHost.call`, so the plugin runs under
the same fault isolation as in production: a hook that raises, returns an
invalid value or times out becomes a finding in the report, never an
exception in the caller. Because the host charges a failure to the subgraph,
the device or the plugin, the kit forgives the plugin after a raise or an
invalid value (not after a timeout: its thread may still be running) so that
one broken op does not hide the results of all the others.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark.graph.model import Subgraph
from dspark.host.plugin_manager import PluginHost, _api_problem, _call_with_timeout
from dspark.host.settings import PluginSettings
from dspark.testing.compare import compare
from dspark.testing.op_cases import MLP_CASE, OpCase, op_case, op_cases
from dspark.testing.report import CheckResult, ConformanceReport
from dspark.types import (
    TOLERANCES, Bid, Device, Draft, DraftRequest, HardwareUnavailable, PluginRecord, PluginStatus, QuantSpec,
    TargetModel,
)

PROBE_CACHED_LIMIT_S = 1.0  # a cached (second) probe must answer within this
DRAFT_TARGET = TargetModel(name="dspark-conformance-target", vocab_size=1000, num_layers=4, hidden_size=64)


_REFERENCE: dict[tuple[str, int], dict[str, np.ndarray]] = {}


def reference_outputs(case: OpCase) -> dict[str, np.ndarray]:
    """The case's outputs from the built-in torch reference backend on the CPU (cached per case)."""
    key = (case.name, id(case.graph))  # op_cases() builds each graph once; a custom case gets its own entry
    if key not in _REFERENCE:
        from dspark.sdk.reference.executable import TorchExecutable

        _REFERENCE[key] = TorchExecutable(case.graph.subgraph(), "cpu").run(_copy(case.inputs))
    return _REFERENCE[key]


def default_host(name: str) -> PluginHost:
    """A host that loads ``name`` whatever the user's DSPARK_PLUGINS / autoload settings say.

    Only ``name`` is allowed, which keeps the other plugins' imports and
    probes out of the check; timeouts and tracing still come from the environment.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK_PLUGINS", "DSPARK_DISABLE_PLUGIN_AUTOLOAD")}
    env["DSPARK_PLUGINS"] = name
    return PluginHost(PluginSettings.from_env(env=env)).load()


def _copy(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # A fresh copy per run: a plugin that writes into its inputs cannot spoil other checks.
    return {k: np.array(v, copy=True) for k, v in inputs.items()}


class ConformanceKit:
    """Runs the checks against one plugin on one host, caching probe, bids and references."""

    def __init__(self, name: str, host: PluginHost | None = None) -> None:
        self.name = name
        self.host = host if host is not None else default_host(name)
        self._plugin = self.host.pm.get_plugin(name)  # kept to re-admit it after a finding
        self._probe: list[CheckResult] | None = None
        self.devices: list[Device] = []
        self.not_testable: str | None = None  # why device checks are skipped (no hardware, not active)
        self._bids: dict[tuple[str, int], tuple[Bid | None, str | None]] = {}

    # -- calling ---------------------------------------------------------------

    @property
    def record(self) -> PluginRecord | None:
        return self.host.records.get(self.name)

    def call(self, hook: str, **kwargs: Any) -> tuple[Any, str | None]:
        """(result, problem): the host's isolated call; a problem is the failure the host charged."""
        record = self.record
        if record is None or self.name not in self.host.active():
            why = f"{record.status.value}: {record.reason}" if record else "not loaded"
            return None, f"plugin is not taking calls ({why})"
        status = record.status
        faults = getattr(self.host, "fault_count", None)
        before = faults(self.name) if faults else 0
        start = time.perf_counter()
        value = self.host.call(self.name, hook, **kwargs)
        failed_now = record.status == PluginStatus.FAILED
        if not failed_now and (not faults or faults(self.name) == before):
            return value, None
        last = self.host.last_fault(self.name) if faults else None
        problem = last.reason if last is not None and not failed_now else record.reason
        timed_out = time.perf_counter() - start >= self.host.settings.timeout_for(hook)
        if not timed_out:
            self.forgive(failed_now, status)
        return None, problem

    def forgive(self, failed_now: bool = True, status: PluginStatus | None = None) -> None:
        """Take the plugin back after a failure: each case is judged alone, so one failure must not
        exclude the plugin from the next (not after a timeout: its thread may still be running)."""
        if hasattr(self.host, "forgive"):
            self.host.forgive(self.name)
        elif self._plugin is not None and failed_now and (record := self.record) is not None:
            self.host.pm.register(self._plugin, name=self.name)
            record.status, record.reason = status or PluginStatus.ACTIVE, ""

    def _label(self, device: Device) -> str:
        same = [d for d in self.devices if d.id == device.id]
        return device.id if len(same) == 1 else f"{device.id} ({device.runtime})"

    # -- checks ----------------------------------------------------------------

    def check_registration(self) -> list[CheckResult]:
        record = self.record
        if record is None:
            known = ", ".join(sorted(self.host.records)) or "none"
            return [CheckResult("registered", ok=False, detail=f"no plugin named {self.name!r} was loaded "
                                f"(loaded: {known}); is its 'dspark' entry point installed?")]
        results = []
        good = record.status in (PluginStatus.ACTIVE, PluginStatus.NO_HARDWARE)
        results.append(CheckResult("registered and active", ok=good,
                                   detail=f"{record.status.value} ({record.source}, {record.module}"
                                          f"{', version ' + record.version if record.version else ''})"
                                          + (f": {record.reason}" if record.reason else "")))
        problem = _api_problem(record.api_version or None)
        results.append(CheckResult("API version declared", ok=problem is None,
                                   detail=problem or f"DSPARK_API_VERSION = {record.api_version!r}"))
        if not good:
            self.not_testable = f"plugin is {record.status.value}"
        return results

    def check_probe(self) -> list[CheckResult]:
        if self._probe is not None:
            return self._probe
        reg = self.check_registration()
        if self.not_testable or any(not r.ok for r in reg):
            self.not_testable = self.not_testable or "plugin did not register cleanly"
            self._probe = [CheckResult("probe", ok=False, skipped=True, detail=self.not_testable)]
            return self._probe
        if not self.host.implements(self.name, "dspark_probe_devices"):
            # A drafter-only plugin, say: nothing device-scoped to check.
            self.not_testable = "drives no devices (dspark_probe_devices not implemented)"
            self._probe = [CheckResult("probe", ok=True, skipped=True, detail=self.not_testable)]
            return self._probe
        results: list[CheckResult] = []
        runs: list[list[tuple[str, str]]] = []
        second_s = 0.0
        for attempt in range(2):
            start = time.perf_counter()
            try:
                found, problem = self.call("dspark_probe_devices", refresh=False)
            except HardwareUnavailable as exc:
                # Not a failure: the plugin says its hardware is absent on this machine.
                assert self.record is not None
                self.record.status, self.record.reason = PluginStatus.NO_HARDWARE, str(exc)
                self.not_testable = f"no hardware: {exc}"
                self._probe = [CheckResult("probe", ok=True, skipped=True, detail=self.not_testable)]
                return self._probe
            second_s = time.perf_counter() - start
            if problem:
                self.not_testable = "probe failed"
                self._probe = [CheckResult("probe returns valid devices", ok=False, detail=problem)]
                return self._probe
            devices = [d for d in found or [] if isinstance(d, Device)]
            if attempt == 0:
                self.devices = devices
            runs.append([(d.id, d.runtime) for d in devices])
        if not self.devices:
            unavailable = [f"{u.what}: {u.reason}" for u in found or [] if not isinstance(u, Device)]
            self.not_testable = "no hardware: " + ("; ".join(unavailable) or "probe found no devices")
            self._probe = [CheckResult("probe", ok=True, skipped=True, detail=self.not_testable)]
            return self._probe
        dupes = {p for p in runs[0] if runs[0].count(p) > 1}
        results.append(CheckResult(
            "probe returns valid devices", ok=not dupes,
            detail=f"duplicate (id, runtime) {sorted(dupes)}" if dupes else
            ", ".join(f"{d.id} ({d.kind}, {d.runtime}, {d.name})" for d in self.devices)))
        results.append(CheckResult(
            "probe is idempotent", ok=runs[0] == runs[1],
            detail=f"first {runs[0]}, then {runs[1]}" if runs[0] != runs[1] else "same devices twice"))
        results.append(CheckResult(
            "probe is fast when cached", ok=second_s < PROBE_CACHED_LIMIT_S,
            detail=f"second probe took {second_s:.3f} s (limit {PROBE_CACHED_LIMIT_S:g} s: cache microbenchmarks "
                   "with dspark.host.cache)"))
        self._probe = results
        return results

    def _skips(self, check: str, case: str = "") -> list[CheckResult]:
        return [CheckResult(check, case=case, ok=True, skipped=True, detail=self.not_testable or "")]

    def bid(self, case: OpCase, device_index: int) -> tuple[Bid | None, str | None]:
        key = (case.name, device_index)
        if key not in self._bids:
            device = self.devices[device_index]
            self._bids[key] = self.call("dspark_bid", subgraph=case.graph.subgraph(), device=device)
        return self._bids[key]

    def check_bid(self, case: OpCase, device_index: int) -> CheckResult:
        device = self.devices[device_index]
        bid, problem = self.bid(case, device_index)
        label = self._label(device)
        if problem:
            return CheckResult("bid well-formed", case.name, label, ok=False, detail=f"{_ops(case)}: {problem}")
        if bid is None:
            return CheckResult("bid well-formed", case.name, label, detail="abstains")
        bad = []
        if not math.isfinite(bid.latency_s):
            bad.append(f"latency_s {bid.latency_s} is not finite")
        if bid.precision not in TOLERANCES and bid.precision not in ("int64", "int32", "int16", "uint8", "bool"):
            bad.append(f"precision {bid.precision!r} has no tolerance to be checked against")
        if not bid.fixed_overhead_s <= bid.latency_s:
            bad.append(f"fixed_overhead_s {bid.fixed_overhead_s} exceeds latency_s {bid.latency_s}")
        if bid.device_id != device.id:
            bad.append(f"device_id {bid.device_id!r} != {device.id!r}")
        return CheckResult("bid well-formed", case.name, label, ok=not bad,
                           detail="; ".join(bad) or f"{bid.latency_s * 1e6:.1f} us, {bid.precision}, {bid.runtime}")

    def check_bids(self) -> list[CheckResult]:
        self.check_probe()
        if self.not_testable:
            return self._skips("bid well-formed")
        return [self.check_bid(c, i) for c in op_cases() for i in range(len(self.devices))]

    def _run_and_compare(self, check: str, case_name: str, label: str, subgraph: Subgraph, device: Device,
                         reference: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                         precision: str, ops: str) -> CheckResult:
        exe, problem = self.call("dspark_compile", subgraph=subgraph, device=device)
        if problem:
            return CheckResult(check, case_name, label, ok=False, detail=f"{ops}: compile failed: {problem}")
        if exe is None:
            return CheckResult(check, case_name, label, ok=False,
                               detail=f"{ops}: bid, then dspark_compile returned None (a broken promise)")
        timeout = self.host.settings.timeout_for("dspark_compile")
        try:
            outputs = _call_with_timeout(exe.run, [_copy(inputs)], timeout, f"{self.name}.run")
        except Exception as exc:  # anything the plugin's code raises is a finding
            return CheckResult(check, case_name, label, ok=False,
                               detail=f"{ops}: run() raised {type(exc).__name__}: {exc}")
        ok, detail = compare(outputs, reference, list(subgraph.outputs), precision)
        return CheckResult(check, case_name, label, ok=ok, detail=detail if ok else f"{ops}: {detail}")

    def check_case(self, case: OpCase) -> list[CheckResult]:
        """For every device the plugin bids on for ``case``: compile, run, compare with the reference."""
        self.check_probe()
        if self.not_testable:
            return self._skips("matches reference", case.name)
        reference = reference_outputs(case)
        results = []
        for i, device in enumerate(self.devices):
            label = self._label(device)
            bid, problem = self.bid(case, i)
            if problem or bid is None:
                results.append(CheckResult("matches reference", case.name, label, skipped=True,
                                           detail=f"bid failed: {problem}" if problem else "abstains"))
                continue
            results.append(self._run_and_compare("matches reference", case.name, label, case.graph.subgraph(),
                                                  device, reference, case.inputs, bid.precision, _ops(case)))
        return results

    def check_quantize(self) -> list[CheckResult]:
        if not self.host.implements(self.name, "dspark_quantize"):
            return [CheckResult("quantize int8", skipped=True, detail="dspark_quantize not implemented")]
        self.check_probe()
        if self.not_testable:
            return self._skips("quantize int8", MLP_CASE)
        case = op_case(MLP_CASE)
        spec = QuantSpec(weight_bits=8)
        float_sg = case.graph.subgraph()
        results = []
        for device in self.devices:
            label = self._label(device)
            variant, problem = self.call("dspark_quantize", subgraph=float_sg, device=device, spec=spec)
            if problem:
                results.append(CheckResult("quantize int8", MLP_CASE, label, ok=False, detail=problem))
                continue
            if variant is None:
                results.append(CheckResult("quantize int8", MLP_CASE, label, skipped=True,
                                           detail="no int8 kernel for this device (returned None)"))
                continue
            if variant.outputs != float_sg.outputs:
                results.append(CheckResult("quantize int8", MLP_CASE, label, ok=False,
                                           detail=f"variant outputs {variant.outputs} != {float_sg.outputs}"))
                continue
            bid, problem = self.call("dspark_bid", subgraph=variant, device=device)
            if problem or bid is None:
                results.append(CheckResult("quantize int8", MLP_CASE, label, ok=False,
                                           detail=f"the plugin does not bid on its own variant: {problem or 'abstains'}"))
                continue
            res = self._run_and_compare("quantize int8", MLP_CASE, label, variant, device, reference_outputs(case),
                                        case.inputs, "int8", _ops(case))
            results.append(CheckResult(res.check, res.case, res.device, res.ok,
                                       f"bid precision {bid.precision}; {res.detail}"))
        return results

    def check_drafters(self) -> list[CheckResult]:
        if not self.host.implements(self.name, "dspark_drafters"):
            return [CheckResult("drafters", skipped=True, detail="dspark_drafters not implemented")]
        specs, problem = self.call("dspark_drafters", target=DRAFT_TARGET)
        if problem:
            return [CheckResult("drafters", ok=False, detail=problem)]
        if not specs:
            return [CheckResult("drafters", skipped=True, detail="offers no drafter for the test target")]
        return [self._check_drafter(spec.name, spec.create) for spec in specs]

    def _check_drafter(self, name: str, create: Callable[[], Any]) -> CheckResult:
        timeout = self.host.settings.timeout_for("dspark_drafters")
        # A repetitive context, so a lookup drafter has something to propose.
        tokens = [11, 12, 13, 14, 15] * 3 + [11, 12]
        try:
            drafter = _call_with_timeout(create, [], timeout, f"{self.name}.{name}.create")
            if not callable(getattr(drafter, "propose", None)):
                return CheckResult("drafter proposes", name, ok=False,
                                   detail=f"create() returned {type(drafter).__name__}, which has no propose()")
            for k in (0, 1, 4):
                draft = _call_with_timeout(drafter.propose, [list(tokens), k], timeout, f"{self.name}.{name}.propose")
                if not isinstance(draft, Draft):
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail=f"propose(tokens, {k}) returned {type(draft).__name__}, not dspark.Draft")
                if len(draft.tokens) > k:
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail=f"propose(tokens, {k}) returned {len(draft.tokens)} tokens, more than k={k}")
                if any(not 0 <= t < DRAFT_TARGET.vocab_size for t in draft.tokens):
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail=f"token ids {draft.tokens} outside the vocabulary")
                if draft.probs is not None and np.shape(draft.probs)[:1] != (len(draft.tokens),):
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail=f"probs shape {np.shape(draft.probs)} for {len(draft.tokens)} tokens")
            if callable(getattr(drafter, "propose_batch", None)):  # API 1.1, optional
                reqs = [DraftRequest("conformance-a", list(tokens), 3), DraftRequest("conformance-b", tokens[:7], 2)]
                drafts = _call_with_timeout(drafter.propose_batch, [reqs], timeout, f"{self.name}.{name}.propose_batch")
                if len(drafts) != len(reqs) or not all(isinstance(d, Draft) for d in drafts):
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail=f"propose_batch returned {_short(drafts)} for {len(reqs)} requests")
                if any(len(d.tokens) > r.k for d, r in zip(drafts, reqs)):
                    return CheckResult("drafter proposes", name, ok=False,
                                       detail="propose_batch returned more tokens than a request's k")
                for r in reqs:
                    for method, args in (("commit", (r.seq_id, len(r.tokens))), ("release", (r.seq_id,))):
                        if callable(getattr(drafter, method, None)):
                            getattr(drafter, method)(*args)
        except Exception as exc:  # anything the plugin's code raises is a finding
            return CheckResult("drafter proposes", name, ok=False, detail=f"{type(exc).__name__}: {exc}")
        return CheckResult("drafter proposes", name, detail=f"last draft {draft.tokens} for k=4")

    def run_all(self, cases: list[OpCase] | None = None) -> ConformanceReport:
        results = self.check_registration()
        if self.record is not None:
            results += self.check_probe()
            results += self.check_bids()
            if self.not_testable:  # one line, not one per case
                results += self._skips("matches reference")
            else:
                for case in op_cases() if cases is None else cases:
                    results += self.check_case(case)
            results += self.check_quantize()
            results += self.check_drafters()
        return ConformanceReport(plugin=self.name, results=results, record=self.record)


def _ops(case: OpCase) -> str:
    kinds = list(dict.fromkeys(case.op_types))
    return f"{case.name} [{'->'.join(kinds)}]" if len(kinds) > 1 or kinds[0] != case.name else case.name


def check_plugin(name: str, host: PluginHost | None = None, cases: list[OpCase] | None = None) -> ConformanceReport:
    """Run every conformance check against plugin ``name`` and return the report.

    Without ``host``, one is built that loads ``name`` even when the
    environment's DSPARK_PLUGINS would hide it. Nothing the plugin does
    raises here: every problem is a failed check in the report.
    """
    return ConformanceKit(name, host).run_all(cases)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
