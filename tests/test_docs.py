"""Every hook is documented (docstring and plugin guide) and exercised by a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from dspark import hookspecs

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "plugins.md").read_text()


def _signature(name: str) -> str:
    sig = inspect.signature(getattr(hookspecs, name))
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{name}({params}) -> {sig.return_annotation}"


def test_hook_list_matches_module() -> None:
    declared = {n for n, f in vars(hookspecs).items() if n.startswith("dspark_") and callable(f)}
    assert declared == set(hookspecs.HOOK_NAMES)


@pytest.mark.parametrize("name", hookspecs.HOOK_NAMES)
def test_hook_docstring_says_when_args_return_combining(name: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert "When:" in doc
    assert "Combining:" in doc
    assert "Return" in doc
    for param in inspect.signature(getattr(hookspecs, name)).parameters:
        assert f":param {param}:" in doc, f"{name} does not document {param}"


@pytest.mark.parametrize("name", hookspecs.HOOK_NAMES)
def test_hook_has_a_guide_section_with_its_exact_signature(name: str) -> None:
    assert f"### `{_signature(name)}`" in GUIDE


@pytest.mark.parametrize("name", hookspecs.HOOK_NAMES)
def test_hook_is_exercised_by_a_test(name: str) -> None:
    this = Path(__file__).name
    users = [p.name for p in (ROOT / "tests").rglob("test_*.py")
             if p.name != this and re.search(rf'["\']{name}["\']', p.read_text())]
    assert users, f"no test calls {name}"


def test_api_version_documented() -> None:
    assert f"(now **{hookspecs.API_VERSION}**)" in GUIDE
    assert f"- **{hookspecs.API_VERSION}**" in GUIDE
