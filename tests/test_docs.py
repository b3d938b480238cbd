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


def _section(title: str) -> str:
    start = GUIDE.index(f"\n## {title}\n")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end != -1 else None]


def test_every_sdk_name_is_documented() -> None:
    import dspark.sdk

    section = _section("The SDK")
    undocumented = [name for name in dspark.sdk.__all__
                    if not re.search(rf"^- `{re.escape(name)}\b", section, re.MULTILINE)]
    assert not undocumented, f"docs/plugins.md, 'The SDK': no '- `name`' entry for {undocumented}"
    # And nothing documented there that the SDK does not have.
    listed = set(re.findall(r"^- `([A-Za-z_][A-Za-z0-9_]*)", section, re.MULTILINE))
    assert listed <= set(dspark.sdk.__all__), f"documented but not in dspark.sdk: {listed - set(dspark.sdk.__all__)}"


def test_the_public_plugin_api_is_documented() -> None:
    section = _section("What a plugin imports")
    for module in ("dspark.hookspecs", "dspark.types", "dspark.graph", "dspark.sdk", "dspark.testing"):
        assert f"`{module}`" in section, module


def test_api_version_changes_listed_newest_first() -> None:
    changes = _section("Changes to the plugin API")
    versions = re.findall(r"^- \*\*(\d+)\.(\d+)\*\*", changes, re.MULTILINE)
    assert versions[0] == tuple(hookspecs.API_VERSION.split("."))
    assert versions == sorted(versions, key=lambda v: (int(v[0]), int(v[1])), reverse=True)
