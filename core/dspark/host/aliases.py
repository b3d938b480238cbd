"""Deprecated module names: a module that stands for another, warning once when it is imported.

The plugin API 1.3 names (``dspark.cost``, ``dspark.quant``, ``dspark.cache``, ``dspark.calibration``,
``dspark.hostinfo``, ``dspark.log``) moved under :mod:`dspark.sdk` in 1.4. Each old module stays a
module of its own (nothing is swapped in ``sys.modules``), warns with a ``DeprecationWarning`` that
names the new module and the release that removes the old name, as pluggy and pytest deprecate,
and hands every attribute read and write to the new module, so a knob set through the old name
still reaches the code that reads it.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType
from typing import Any

REMOVED_IN = "plugin API 2.0"


class _Alias(ModuleType):
    _dspark_target: ModuleType

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dspark_target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") or name == "_dspark_target":
            super().__setattr__(name, value)
        else:
            setattr(self._dspark_target, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._dspark_target, name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._dspark_target)))

    @property  # type: ignore[misc]  # ModuleType's __dict__ is read-only; this reads the target's
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        # What tools that look a name up in ``__dict__`` see: pytest's monkeypatch records the old value
        # from there, and finding none there it would delete the name from the target on undo.
        return self._dspark_target.__dict__


def deprecated_alias(name: str, target: ModuleType, instead: str | None = None) -> None:
    """Make module ``name`` (being imported) a deprecated alias of ``target``; ``instead``: what the
    warning tells plugins to use (the public name, when ``target`` is internal)."""
    warnings.warn(f"{name} is deprecated and will be removed in {REMOVED_IN}: use {instead or target.__name__} "
                  "instead (docs/plugins.md, 'What a plugin imports')", DeprecationWarning, stacklevel=3)
    mod = sys.modules[name]
    mod.__class__ = _Alias
    mod._dspark_target = target
