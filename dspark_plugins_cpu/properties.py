"""Reading OpenVINO device properties as JSON-able values."""

from __future__ import annotations

from typing import Any

# Properties never worth showing: the property list itself, per-model
# knobs that echo defaults, and ones whose getter fails on some versions.
_SKIP = {
    "SUPPORTED_PROPERTIES", "SUPPORTED_METRICS", "SUPPORTED_CONFIG_KEYS", "AVAILABLE_DEVICES",
    "CACHING_PROPERTIES", "COMPATIBILITY_CHECK", "WEIGHTS_PATH", "CACHE_DIR", "CACHE_MODE",
    "CACHE_ENCRYPTION_CALLBACKS", "LOG_LEVEL", "DEVICE_UUID", "DEVICE_LUID",
}


def jsonable(value: Any) -> Any:
    """Convert an OpenVINO property value to str/int/float/bool/list/dict."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if hasattr(value, "get_type_name"):  # ov.Type: 'f32', 'bf16'
        return str(value.get_type_name())
    name = getattr(value, "name", None)  # pybind11 enums: PerformanceMode.LATENCY -> 'LATENCY'
    if isinstance(name, str):
        return name
    return str(value)


def read_properties(core: Any, ov_name: str) -> dict[str, Any]:
    """Every supported property of ``ov_name`` that reads cheaply, JSON-able."""
    try:
        supported = core.get_property(ov_name, "SUPPORTED_PROPERTIES")
    except RuntimeError:
        return {}
    out: dict[str, Any] = {}
    for name in supported:
        if name in _SKIP:
            continue
        try:
            out[str(name)] = jsonable(core.get_property(ov_name, name))
        except Exception:  # some getters are not bound in Python; skip them
            continue
    return out
