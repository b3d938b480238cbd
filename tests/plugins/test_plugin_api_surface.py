"""The hardware plugins and the example plugins use only the public plugin API, and are shaped alike.

Public API (docs/plugins.md, "What a plugin imports"): ``dspark`` (its top-level names),
``dspark.hookspecs``, ``dspark.types``, ``dspark.graph``, ``dspark.sdk`` and ``dspark.testing``.
The sources are read with ``ast``, so a function-level or ``TYPE_CHECKING`` import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dspark
import dspark.graph
import dspark.sdk

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ("dspark_plugins_cpu", "dspark_plugins_cuda", "dspark_plugins_npu")
PUBLIC = frozenset({"dspark", "dspark.hookspecs", "dspark.types", "dspark.graph", "dspark.sdk", "dspark.sdk.decoder",
                    "dspark.sdk.family", "dspark.testing"})
ROLES = ("probe.py", "support.py", "bidding.py", "executable.py", "quantize.py")


def _package_dirs() -> list[Path]:
    examples = [init.parent for init in sorted((ROOT / "plugins").glob("*/src/*/__init__.py"))]
    return [ROOT / name for name in HARDWARE] + examples


def _sources() -> list[Path]:
    return [path for pkg in _package_dirs() for path in sorted(pkg.rglob("*.py"))]


def _exported(module: str) -> set[str] | None:
    """The names ``from module import ...`` may take; None: any public (non-underscore) name."""
    if module == "dspark":
        return set(dspark.__all__)
    if module == "dspark.sdk":
        return set(dspark.sdk.__all__)
    if module == "dspark.graph":
        return set(dspark.graph.__all__)
    return None


def violations(source: str, filename: str, own_package: str) -> list[str]:
    """``file:line: import`` for every import of a non-public dspark name or of another plugin."""
    found: list[str] = []

    def bad(node: ast.stmt, why: str) -> None:
        found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}  ({why})")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == "dspark" and alias.name not in PUBLIC:
                    bad(node, f"{alias.name} is not part of the public plugin API")
                elif top.startswith("dspark_plugins_") and top != own_package:
                    bad(node, "a hardware plugin imports no other plugin")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            top = module.split(".")[0]
            if top.startswith("dspark_plugins_") and top != own_package:
                bad(node, "a hardware plugin imports no other plugin")
            if top != "dspark":
                continue
            if module not in PUBLIC:
                bad(node, f"{module} is not part of the public plugin API")
                continue
            allowed = _exported(module)
            for alias in node.names:
                if alias.name.startswith("_") or (allowed is not None and alias.name not in allowed):
                    bad(node, f"{alias.name} is not a public name of {module}")
    return found


def test_the_checker_names_file_line_and_import() -> None:
    source = ("from dspark.sdk import time_call\n"
              "def f():\n"
              "    from dspark.builtin.torch_ref import TorchExecutable\n"
              "    from dspark.sdk import _NAMES\n"
              "    import dspark.host.log\n"
              "    from dspark_plugins_npu import session\n")
    found = violations(source, "x.py", "dspark_plugins_cuda")
    assert found == [
        ("x.py:3: from dspark.builtin.torch_ref import TorchExecutable  "
         "(dspark.builtin.torch_ref is not part of the public plugin API)"),
        "x.py:4: from dspark.sdk import _NAMES  (_NAMES is not a public name of dspark.sdk)",
        "x.py:5: import dspark.host.log  (dspark.host.log is not part of the public plugin API)",
        "x.py:6: from dspark_plugins_npu import session  (a hardware plugin imports no other plugin)",
    ]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_imports_only_the_public_api(path: Path) -> None:
    package = path.relative_to(ROOT).parts[0]
    found = violations(path.read_text(), str(path.relative_to(ROOT)), package)
    assert not found, "imports outside the public plugin API:\n" + "\n".join(found)


def _internal_imports(pkg: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (anywhere in the file)."""
    name = pkg.name
    modules = {p.stem for p in pkg.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in pkg.glob("*.py"):
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] != name:
                    continue
                if len(parts) > 1:
                    edges.add(parts[1])
                else:  # from pkg import x: the submodule x, else the package itself
                    edges |= {a.name if a.name in modules else "__init__" for a in node.names}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == name:
                        edges.add(parts[1] if len(parts) > 1 else "__init__")
        graph[path.stem] = edges - {path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", HARDWARE)
def test_no_import_cycle_inside_a_hardware_plugin(name: str) -> None:
    cycle = _cycle(_internal_imports(ROOT / name))
    assert cycle is None, f"{name}: import cycle " + " -> ".join(cycle or [])


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_plugins_have_the_same_file_roles(name: str) -> None:
    missing = [role for role in ROLES if not (ROOT / name / role).is_file()]
    assert not missing, f"{name} lacks {', '.join(missing)} (every hardware plugin has {', '.join(ROLES)})"
