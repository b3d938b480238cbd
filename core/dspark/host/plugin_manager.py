"""Loading plugins and calling their hooks in isolation.

Built-ins load first, then every ``dspark`` entry point, then modules named
with ``-p MODULE``. Each plugin is checked when it registers (declared API
version, unique name, hook names and argument names) and every call into it
runs in a worker thread with a timeout. Whatever goes wrong is recorded on
the plugin's :class:`~dspark.types.PluginRecord` (``faults``) and charged to
the smallest thing that failed (:mod:`dspark.host.faults`): the subgraph
signature on that device, then the device, then the whole plugin, which is
then left out of later calls. Nothing a plugin does can stop the run.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import pluggy
from pydantic import TypeAdapter, ValidationError

from dspark import hookspecs
from dspark.graph.model import Subgraph
from dspark.host import hook_threads, trace
from dspark.host.faults import FaultLedger, describe, scope_of
from dspark.host.log import get_logger
from dspark.host.settings import PluginSettings
from dspark.types import (
    Bid, DecoderBid, Device, DrafterSpec, Executable, FaultScope, HardwareUnavailable, PluginFault, PluginRecord,
    PluginStatus, Unavailable,
)

log = get_logger("dspark.plugins")

ENTRY_POINT_GROUP = "dspark"
# dspark's own plugins (the torch reference executor, the lookup drafters, the engine's drafter offers) are
# entry points of this group in dspark's package metadata: the host loads them as it loads any other, names
# none of them, and loads them whatever the autoload setting.
BUILTIN_GROUP = "dspark.builtin"
# The order they register in, as before they were entry points: the reference executor, then the drafters
# (offers are collected in load order). Entry points have no order of their own; others sort by name after.
_BUILTIN_ORDER = ("torch", "ngram", "drafters")


class PluginError(RuntimeError):
    """A plugin broke the contract; the message names the plugin and the hook."""


class HookTimeout(PluginError):
    pass


class _PluginManager(pluggy.PluginManager):
    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        # Like pytest with ``pytest_*``: an unmarked ``dspark_*`` function is a
        # hook impl too, so a misspelled hook name is caught, not ignored.
        if opts is None and name.startswith("dspark_") and inspect.isroutine(getattr(plugin, name, None)):
            return {}
        return opts


def _api_problem(declared: Any) -> str | None:
    if declared is None:
        return "does not declare DSPARK_API_VERSION (e.g. DSPARK_API_VERSION = %r)" % hookspecs.API_VERSION
    try:
        major, minor = (int(x) for x in str(declared).split(".")[:2])
    except ValueError:
        return f"DSPARK_API_VERSION {declared!r} is not 'MAJOR.MINOR'"
    core_major, core_minor = (int(x) for x in hookspecs.API_VERSION.split("."))
    if major != core_major or minor > core_minor:
        return f"written for plugin API {declared}; this dspark speaks {hookspecs.API_VERSION}"
    return None


def _summary(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PluginHost:
    """The plugin manager: registry, status of every plugin, isolated hook calls."""

    def __init__(self, settings: PluginSettings | None = None) -> None:
        self.settings = settings or PluginSettings.from_env()
        self.pm = _PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.faults = FaultLedger(self.settings)
        self._lock = threading.Lock()
        self._parked: dict[str, tuple[object, PluginStatus, str]] = {}  # failed plugins, for forgive()

    # -- loading -------------------------------------------------------------

    def load(self) -> PluginHost:
        """Load built-ins, entry points (unless autoload is off) and ``-p`` modules."""
        builtins = sorted(importlib.metadata.entry_points(group=BUILTIN_GROUP),
                          key=lambda e: (_BUILTIN_ORDER.index(e.name) if e.name in _BUILTIN_ORDER
                                         else len(_BUILTIN_ORDER), e.name))
        if not builtins:  # metadata from before the built-ins were entry points
            log.warning("plugin.no_builtins", group=BUILTIN_GROUP,
                        hint="dspark's package metadata lists no built-in plugins: reinstall dspark")
        for ep in builtins:
            self._load_by_import(ep.name, ep.value, "builtin", version=_dist_version("dspark"), loader=ep.load)
        if self.settings.autoload:
            for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                version = ep.dist.version if ep.dist is not None else ""
                self._load_by_import(ep.name, ep.value, "entry point", version=version, loader=ep.load)
        for module in self.settings.extra_modules:
            self._load_by_import(None, module, "command line", version="")
        return self

    def _load_by_import(
        self, name: str | None, target: str, source: str, version: str,
        loader: Callable[[], Any] | None = None,
    ) -> None:
        if name is not None and (why := self.settings.excluded(name)):
            self._set(PluginRecord(name=name, module=target, source=source, version=version,  # type: ignore[arg-type]
                                   status=PluginStatus.BLOCKED, reason=why))
            return
        try:
            obj = loader() if loader else _import_target(target)
        except Exception as exc:  # any import error is the plugin's, not ours
            shown = name or target
            self._set(PluginRecord(name=shown, module=target, source=source, version=version,  # type: ignore[arg-type]
                                   status=PluginStatus.FAILED,
                                   reason=f"failed to import {target!r}: {type(exc).__name__}: {exc}"))
            log.warning("plugin.import_failed", plugin=shown, target=target, error=str(exc))
            return
        if name is None:
            module_part, _, attr = target.partition(":")
            name = str(getattr(obj, "DSPARK_PLUGIN_NAME", None) or attr or module_part.rsplit(".", 1)[-1])
            if why := self.settings.excluded(name):
                self._set(PluginRecord(name=name, module=target, source=source, version=version,  # type: ignore[arg-type]
                                       status=PluginStatus.BLOCKED, reason=why))
                return
        self.register(obj, name, source=source, version=version or str(getattr(obj, "__version__", "")))

    def register(self, plugin: object, name: str, *, source: str = "command line", version: str = "") -> PluginRecord:
        """Check and register one plugin object (module, class instance or class)."""
        if inspect.isclass(plugin):
            plugin = plugin()
        module = getattr(plugin, "__name__", None) or type(plugin).__module__
        record = PluginRecord(name=name, module=module, source=source, version=version,  # type: ignore[arg-type]
                              api_version=str(getattr(plugin, "DSPARK_API_VERSION", "") or ""))
        existing = self.records.get(name)
        if existing is not None and existing.status != PluginStatus.BLOCKED:
            dup = PluginRecord(**{**record.model_dump(), "status": PluginStatus.FAILED,
                                  "reason": f"plugin name {name!r} is already taken by {existing.module!r}"})
            self.records[f"{name} ({module})"] = dup
            log.warning("plugin.duplicate_name", plugin=name, module=module, taken_by=existing.module)
            return dup
        if problem := _api_problem(getattr(plugin, "DSPARK_API_VERSION", None)):
            return self._fail_record(record, problem)
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            return self._fail_record(record, f"invalid hook implementation: {exc}")
        unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if hc.spec is None]
        if unknown:
            self.pm.unregister(plugin)
            hints = []
            for u in unknown:
                close = difflib.get_close_matches(u, hookspecs.HOOK_NAMES, n=1)
                hints.append(f"{u!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            return self._fail_record(record, "implements unknown hook " + ", ".join(hints))
        self._set(record)
        log.debug("plugin.registered", plugin=name, module=module, source=source)
        return record

    def _fail_record(self, record: PluginRecord, reason: str) -> PluginRecord:
        record.status = PluginStatus.FAILED
        record.reason = reason
        self._set(record)
        log.warning("plugin.rejected", plugin=record.name, reason=reason)
        return record

    def _set(self, record: PluginRecord) -> None:
        record.faults = self.faults.of(record.name)
        with self._lock:
            self.records[record.name] = record

    # -- status --------------------------------------------------------------

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is one of dspark's own plugins (they run inline, without a call guard)."""
        record = self.records.get(name)
        return record is not None and record.source == "builtin"

    def active(self) -> list[str]:
        """Plugins still taking calls (active or without hardware), in load order."""
        return [n for n, r in self.records.items() if r.status in (PluginStatus.ACTIVE, PluginStatus.NO_HARDWARE)]

    def fail(self, name: str, reason: str) -> None:
        """Report ``name`` as failed and leave it out of every later call."""
        with self._lock:
            record = self.records[name]
            if record.status == PluginStatus.FAILED:
                return
            before = record.status, record.reason
            record.status = PluginStatus.FAILED
            record.reason = reason
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
            self._parked[name] = (plugin, *before)
        log.warning("plugin.failed", plugin=name, reason=reason)

    def charge(self, name: str, hook: str, reason: str, *, subgraph: Subgraph | None = None,
               device: str | None = None, fatal: bool = False) -> FaultScope:
        """Record a failure of ``name`` found outside a hook call (e.g. its executable's ``run``)."""
        sig, ops = (subgraph.signature(), describe(subgraph)) if subgraph is not None else (None, "")
        return self._charge(name, hook, reason, sig, ops, device, fatal)

    def _charge(self, name: str, hook: str, reason: str, signature: str | None, ops: str,
                device: str | None, fatal: bool) -> FaultScope:
        scope = self.faults.charge(name, hook, reason, signature=signature, ops=ops, device=device, fatal=fatal)
        if scope == "plugin":
            count = self.faults.count(name)
            if not fatal and signature is not None:
                reason = (f"{reason} (failure {count}: DSPARK_FAULTS_PER_PLUGIN="
                          f"{self.settings.faults_per_plugin} reached)")
            self.fail(name, reason)
        else:
            log.warning("plugin.fault", plugin=name, hook=hook, subgraph=signature, ops=ops, device=device,
                        charged_to=scope, reason=reason)
        return scope

    def last_fault(self, name: str) -> PluginFault | None:
        """The fault recorded most recently for ``name``."""
        return self.faults.last(name)

    def fault_count(self, name: str) -> int:
        return self.faults.count(name)

    def forgive(self, name: str) -> None:
        """Clear ``name``'s faults and exclusions and take it back if they failed it (conformance kit)."""
        self.faults.forgive(name)
        parked = self._parked.pop(name, None)
        if parked is not None:
            plugin, status, reason = parked
            self.pm.register(plugin, name=name)
            record = self.records[name]
            record.status, record.reason = status, reason

    def implements(self, name: str, hook: str) -> bool:
        return self._impl(name, hook) is not None

    def _impl(self, name: str, hook: str) -> Any:
        caller = getattr(self.pm.hook, hook)
        for impl in caller.get_hookimpls():
            if impl.plugin_name == name:
                return impl
        return None

    # -- calling -------------------------------------------------------------

    def call(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's ``hook`` in isolation; validated result, or None.

        None is returned when the plugin abstains, does not implement the
        hook, was excluded by an earlier failure on this subgraph or device,
        or fails now (the failure is then charged, see :mod:`dspark.host.faults`).
        """
        if name not in self.active():
            return None
        impl = self._impl(name, hook)
        if impl is None:
            return None
        scope: tuple[str | None, str, str | None] | None = None
        if self.faults.any(name):  # signatures are only computed once the plugin has failed somewhere
            scope = scope_of(kwargs)
            if (why := self.faults.refusal(name, scope[0], scope[2])) is not None:
                if self.settings.trace:
                    trace.emit(name, hook, 0.0, "skipped", why)
                return None
        args = [kwargs[a] for a in impl.argnames]
        timeout = self.settings.timeout_for(hook)
        start = time.perf_counter()
        outcome, detail = "ok", ""
        fatal = hook == "dspark_probe_devices"  # a plugin that cannot say what it drives is out
        try:
            raw = _call_with_timeout(impl.function, args, timeout, f"{name}.{hook}")
            result = _validate(hook, name, raw, kwargs)
            if result is None:
                outcome = "abstained"
            return result
        except HardwareUnavailable as exc:
            if fatal:
                outcome = "no hardware"
                raise
            # Only probing may say the hardware is gone; elsewhere it is a failure.
            outcome, detail = "raised", f"{hook} raised HardwareUnavailable: {exc}"
        except HookTimeout:
            outcome, detail, fatal = "timeout", f"{hook} did not return within {timeout:g} s", True
        except PluginError as exc:
            outcome, detail = "invalid", str(exc)
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            outcome, detail = "raised", (f"{hook} raised {type(exc).__name__}: {exc} "
                                         f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
        finally:
            if self.settings.trace:
                elapsed = time.perf_counter() - start
                trace.emit(name, hook, elapsed, outcome, detail)
                log.info("hook.call", plugin=name, hook=hook, outcome=outcome, ms=round(elapsed * 1e3, 3),
                         args={k: _summary(v, 80) for k, v in kwargs.items()},
                         result=_summary(locals().get("raw")) if outcome == "ok" else None)
        sig, ops, device = scope if scope is not None else scope_of(kwargs)
        self._charge(name, hook, detail, sig, ops, device, fatal)
        return None

    def call_all(self, hook: str, names: Iterable[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Call ``hook`` on every active plugin concurrently; {plugin: result}.

        A plugin raising :class:`HardwareUnavailable` maps to that exception
        instance so the caller can record the reason.
        """
        names = [n for n in (names if names is not None else self.active()) if self.implements(n, hook)]
        results: dict[str, Any] = {}

        def one(n: str) -> None:
            try:
                results[n] = self.call(n, hook, **kwargs)
            except HardwareUnavailable as exc:
                results[n] = exc

        threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each call carries its own timeout
        return {n: results.get(n) for n in names}


def _import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _call_with_timeout(fn: Callable[..., Any], args: list[Any], timeout: float, label: str) -> Any:
    try:
        return hook_threads.call_with_timeout(fn, args, timeout, label)
    except hook_threads.CallTimeout as exc:
        raise HookTimeout(str(exc)) from None


_DRAFTERS = TypeAdapter(list[DrafterSpec])


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<value>'}: {e['msg']}" for e in exc.errors()[:4])


def _validate(hook: str, plugin: str, raw: Any, kwargs: dict[str, Any]) -> Any:
    """Check a hook's return value against the contract; raise PluginError naming the plugin."""
    if raw is None:
        return None
    try:
        if hook == "dspark_probe_devices":
            if not isinstance(raw, (list, tuple)):
                raise PluginError(f"plugin {plugin!r}: dspark_probe_devices returned "
                                  f"{type(raw).__name__}, not a list of Device/Unavailable")
            items: list[Device | Unavailable] = []
            for i, item in enumerate(raw):
                model = Unavailable if isinstance(item, Unavailable) or (
                    isinstance(item, dict) and "what" in item) else Device
                try:
                    items.append(model.model_validate(item))
                except ValidationError as exc:
                    raise PluginError(f"plugin {plugin!r}: dspark_probe_devices returned an invalid "
                                      f"{model.__name__} at [{i}]: {_errors(exc)}") from None
            for d in items:
                if isinstance(d, Device):
                    d.plugin = plugin
            return items
        if hook in ("dspark_bid", "dspark_decoder_bid"):  # a bid, for the device it was asked about
            bid = (Bid if hook == "dspark_bid" else DecoderBid).model_validate(raw)
            bid.plugin = plugin
            if bid.device_id != kwargs["device"].id:
                raise PluginError(f"plugin {plugin!r}: {hook} returned a bid for device "
                                  f"{bid.device_id!r} when asked about {kwargs['device'].id!r}")
            return bid
        if hook == "dspark_compile":
            if not isinstance(raw, Executable) or not callable(getattr(raw, "run", None)):
                raise PluginError(f"plugin {plugin!r}: dspark_compile returned {type(raw).__name__}, "
                                  "which has no run(inputs) method")
            return raw
        if hook == "dspark_quantize":
            if not isinstance(raw, Subgraph) or raw.quantized_by != plugin:
                raise PluginError(f"plugin {plugin!r}: dspark_quantize must return a Subgraph with "
                                  f"quantized_by={plugin!r}, got {_summary(raw, 80)}")
            return raw
        if hook == "dspark_compile_decoder":
            steps = callable(getattr(raw, "allocate", None)) and callable(getattr(raw, "step", None))
            if getattr(raw, "kv_mode", "paged") == "sequence":  # API 1.8: the runtime keeps the KV per sequence
                if not steps:
                    raise PluginError(f"plugin {plugin!r}: dspark_compile_decoder returned {type(raw).__name__} "
                                      "(kv_mode 'sequence'), which lacks allocate(num_tokens, max_seqs) or "
                                      "step(kv, batch)")
                return raw
            if not (isinstance(getattr(raw, "block_size", None), int) and steps):
                raise PluginError(f"plugin {plugin!r}: dspark_compile_decoder returned {type(raw).__name__}, "
                                  "which lacks block_size, allocate(num_blocks) or step(kv, batch)")
            return raw
        if hook == "dspark_drafters":
            specs = _DRAFTERS.validate_python(raw)
            for s in specs:
                s.plugin = plugin
            return specs
    except ValidationError as exc:
        raise PluginError(f"plugin {plugin!r}: {hook} returned an invalid value: {_errors(exc)}") from None
    return raw
