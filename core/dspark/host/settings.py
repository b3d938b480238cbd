"""Which plugins load, and how hooks are called: from the environment and the CLI."""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, Field

DEFAULT_TIMEOUTS_S: dict[str, float] = {
    "dspark_probe_devices": 120.0,  # a first probe may run microbenchmarks
    "dspark_bid": 60.0,  # may time the real subgraph once (then cached)
    "dspark_compile": 600.0,
    "dspark_quantize": 600.0,
    "dspark_drafters": 60.0,
    "dspark_decoder_bid": 60.0,
    "dspark_compile_decoder": 600.0,  # builds and compiles a whole model
}


class PluginSettings(BaseModel):
    """Plugin selection. ``DSPARK_PLUGINS`` holds comma/space separated items:
    ``NAME`` allows only the named plugins, ``no:NAME`` blocks one.
    ``DSPARK_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry points (built-ins and
    ``-p MODULE`` plugins still load). ``DSPARK_HOOK_TIMEOUT`` (seconds)
    overrides every hook's timeout. ``DSPARK_TRACE=1`` prints every hook call
    (plugin, hook, duration, outcome) on stderr.

    Fault thresholds (docs/plugins.md, "Fault rules"): a failing bid, compile,
    quantize or run is charged to its subgraph signature on that device; after
    ``DSPARK_FAULTS_PER_DEVICE`` distinct failing signatures on one device the
    plugin loses that device; after ``DSPARK_FAULTS_PER_PLUGIN`` failures in
    all, or one failed probe or hook timeout, the whole plugin is failed.
    """

    blocked: set[str] = Field(default_factory=set)
    allowed: set[str] | None = None
    autoload: bool = True
    extra_modules: list[str] = Field(default_factory=list)
    timeout_override_s: float | None = Field(None, gt=0)
    trace: bool = False
    faults_per_device: int = Field(3, ge=1, description="Distinct failing subgraph signatures on one "
                                   "device before the plugin loses that device.")
    faults_per_plugin: int = Field(10, ge=1, description="Failures in all before the whole plugin is failed.")

    def timeout_for(self, hook: str) -> float:
        return self.timeout_override_s or DEFAULT_TIMEOUTS_S.get(hook, 60.0)

    def excluded(self, name: str) -> str | None:
        """Why ``name`` is not loaded, or None when it may load."""
        if name in self.blocked:
            return "blocked by 'no:%s'" % name
        if self.allowed is not None and name not in self.allowed:
            return "not in the allowlist DSPARK_PLUGINS=%s" % ",".join(sorted(self.allowed))
        return None

    @classmethod
    def from_env(cls, cli_specs: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None) -> PluginSettings:
        env = dict(os.environ) if env is None else env
        blocked: set[str] = set()
        allowed: set[str] = set()
        for item in re.split(r"[,\s]+", env.get("DSPARK_PLUGINS", "").strip()):
            if not item:
                continue
            if item.startswith("no:"):
                blocked.add(item[3:])
            else:
                allowed.add(item)
        extra: list[str] = []
        for spec in cli_specs:
            if spec.startswith("no:"):
                blocked.add(spec[3:])
            else:
                extra.append(spec)
        timeout = env.get("DSPARK_HOOK_TIMEOUT")
        limits = {field: _whole_number(env, var) for field, var in
                  (("faults_per_device", "DSPARK_FAULTS_PER_DEVICE"), ("faults_per_plugin", "DSPARK_FAULTS_PER_PLUGIN"))
                  if env.get(var, "").strip()}
        return cls(
            blocked=blocked,
            allowed=allowed or None,
            autoload=env.get("DSPARK_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0", "false", "no"),
            extra_modules=extra,
            timeout_override_s=float(timeout) if timeout else None,
            trace=env.get("DSPARK_TRACE", "") not in ("", "0", "false", "no"),
            **limits,
        )


def _whole_number(env: dict[str, str], var: str) -> int:
    text = env[var].strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {var}={text!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"environment variable {var}={text!r} must be at least 1")
    return value
