"""The architecture holds: import-linter's contracts (pyproject.toml), no import cycles, small modules and folders.

The contracts (layers, no plugin imports from the core, independent plugins
that import only the public plugin API, no cycles between siblings) run
through ``lint-imports`` exactly as .ci/run runs it. The cycle check here is
finer than import-linter's sibling check: it looks at single modules, so it
also catches a package's ``__init__`` and one of its own modules importing
each other, and names every import of the cycle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_SRC = [REPO / "plugins" / "dspark-numpy" / "src", REPO / "plugins" / "dspark-example-drafter" / "src",
               REPO / "plugins" / "dspark-llamacpp" / "src"]
MAX_MODULE_LINES = 500
MAX_FOLDER_MODULES = 12  # besides __init__.py and __main__.py
SOURCE_ROOTS = [REPO / "core" / "dspark", REPO / "dspark_plugins_cpu", REPO / "dspark_plugins_cuda",
                REPO / "dspark_plugins_npu", *EXAMPLE_SRC]


def _with_examples_on_path() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, EXAMPLE_SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def import_cycles(*packages: str) -> list[list[str]]:
    """Each import circle among the modules of ``packages`` (a set of modules each reachable from every
    other), as its imports: 'importer -> imported (line: code)', sorted.

    Imports under ``if TYPE_CHECKING:`` count too: a cycle held together by
    them only means a type lives in the wrong module (shared types belong in
    leaf modules, as :mod:`dspark.llm.runner.types`). Imports inside functions
    count as well: deferring an import hides a cycle from Python, not from the
    design.
    """
    graph = grimp.build_graph(*packages, include_external_packages=False, exclude_type_checking_imports=False,
                              cache_dir=None)
    g = nx.DiGraph()
    for m in graph.modules:
        g.add_node(m)
        g.add_edges_from((m, i) for i in graph.find_modules_directly_imported_by(m))
    cycles = []
    for component in nx.strongly_connected_components(g):
        if len(component) < 2 and not any(g.has_edge(m, m) for m in component):
            continue
        steps = []
        for a, b in sorted(g.subgraph(component).edges):
            details = graph.get_import_details(importer=a, imported=b)
            where = f" (line {details[0]['line_number']}: {details[0]['line_contents']})" if details else ""
            steps.append(f"{a} -> {b}{where}")
        cycles.append(steps)
    return sorted(cycles)


def _describe(cycles: list[list[str]]) -> str:
    return "\n\n".join("import cycle:\n  " + "\n  ".join(c) for c in cycles)


def test_import_linter_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.fail(f"{lint} is missing: install the dev extra (pip install -e '.[dev]'), which brings import-linter")
    out = subprocess.run([str(lint), "--no-cache"], cwd=REPO, env=_with_examples_on_path(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"lint-imports failed:\n{out.stdout}\n{out.stderr}"
    assert "0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize("package", ["dspark", "dspark_plugins_cpu", "dspark_plugins_cuda", "dspark_plugins_npu",
                                     "dspark_numpy", "dspark_example_drafter", "dspark_llamacpp"])
def test_no_import_cycles(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for src in EXAMPLE_SRC:
        monkeypatch.syspath_prepend(str(src))
    cycles = import_cycles(package)
    assert not cycles, _describe(cycles)


def test_the_cycle_check_names_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic_pkg import b\n")
    (pkg / "b.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from cyclic_pkg import c  # annotation-only, and still a cycle: the type is in the wrong module

        def late() -> None:
            from cyclic_pkg import a  # a function-level import closes a cycle too
        """))
    (pkg / "c.py").write_text("from cyclic_pkg import b\n")
    (pkg / "d.py").write_text("from cyclic_pkg import b\n")  # imports into the cycle, not part of it
    monkeypatch.syspath_prepend(str(tmp_path))
    cycles = import_cycles("cyclic_pkg")
    assert len(cycles) == 1
    assert [step.split(" (")[0] for step in cycles[0]] == [
        "cyclic_pkg.a -> cyclic_pkg.b", "cyclic_pkg.b -> cyclic_pkg.a", "cyclic_pkg.b -> cyclic_pkg.c",
        "cyclic_pkg.c -> cyclic_pkg.b"]
    text = _describe(cycles)
    assert "cyclic_pkg.d" not in text
    assert "line 4: from cyclic_pkg import c" in text and "line 7: from cyclic_pkg import a" in text


def _generated(text: str) -> bool:
    """Code a compiler wrote (protoc's *_pb2.py, grpcio-tools' *_pb2_grpc.py): regenerated, never edited."""
    head = text[:200]
    return "Generated by the " in head and "DO NOT EDIT!" in head


def test_modules_are_small() -> None:
    big = {str(f.relative_to(REPO)): n for root in SOURCE_ROOTS for f in sorted(root.rglob("*.py"))
           if (n := len((text := f.read_text(encoding="utf-8")).splitlines())) > MAX_MODULE_LINES
           and not _generated(text)}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {big}"


def test_folders_hold_about_a_dozen_modules() -> None:
    crowded = {}
    for root in SOURCE_ROOTS:
        for folder in [root, *(d for d in sorted(root.rglob("*")) if d.is_dir() and d.name != "__pycache__")]:
            modules = [f.name for f in folder.glob("*.py") if f.name not in ("__init__.py", "__main__.py")]
            if len(modules) > MAX_FOLDER_MODULES:
                crowded[str(folder.relative_to(REPO))] = len(modules)
    assert not crowded, f"folders with more than {MAX_FOLDER_MODULES} modules (group them in subpackages): {crowded}"


def test_every_package_folder_ships() -> None:
    """setuptools lists the packages by name: a new subpackage left out of the list is missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(REPO / "core").parts) for init in (REPO / "core").rglob("__init__.py")}
    on_disk |= {".".join(init.parent.relative_to(REPO).parts) for root in SOURCE_ROOTS[1:4]
                for init in root.rglob("__init__.py")}
    assert not on_disk - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"listed in pyproject.toml but not on disk: {sorted(listed - on_disk)}"


TESTS = REPO / "tests"
# Folders under tests/ that do not mirror a package of core/dspark, and why. tests/ itself holds the
# whole-repo checks (this module, the docs, the demo) and the suite's shared helpers.
TESTS_OFF_THE_SOURCE_TREE = {
    "plugins": "the plugins outside core/dspark: dspark_plugins_{cpu,cuda,npu}, plugins/*, the API they may use",
    "fixtures": "plugin distributions that tests install with pip (not collected: they have suites of their own)",
    "models": "tiny models that the importer and CLI tests load by path (tests/models/zoo.py:tiny_cnn)",
    "profiles": "device profiles (YAML) the planning tests and the docs plan against",
}


def _test_modules() -> list[Path]:
    return sorted(f for f in TESTS.rglob("*.py") if "__pycache__" not in f.parts)


def test_test_modules_are_small() -> None:
    big = {str(f.relative_to(REPO)): n for f in _test_modules()
           if (n := len((text := f.read_text(encoding="utf-8")).splitlines())) > MAX_MODULE_LINES
           and not _generated(text)}
    assert not big, f"test modules over {MAX_MODULE_LINES} lines (split them by concern): {big}"


def test_test_folders_mirror_the_source_tree() -> None:
    """tests/X/Y holds the tests of core/dspark/X/Y: a package's tests are found where the package is."""
    source = REPO / "core" / "dspark"
    stray = sorted({str(f.parent.relative_to(REPO)) for f in _test_modules()
                    if (rel := f.parent.relative_to(TESTS).parts)
                    and rel[0] not in TESTS_OFF_THE_SOURCE_TREE
                    and not (source.joinpath(*rel) / "__init__.py").is_file()})
    assert not stray, (f"test folders that mirror no package of core/dspark (move the tests to the folder of "
                       f"the package they test, or list the folder, with its reason, in "
                       f"TESTS_OFF_THE_SOURCE_TREE): {stray}")


def test_test_module_names_are_unique() -> None:
    """Pytest's default import mode imports test modules and their helpers by their bare names (tests/ has
    no __init__.py files): two modules of the same name, in different folders, cannot both be imported."""
    names: dict[str, list[str]] = {}
    for f in _test_modules():
        if f.name != "conftest.py" and f.relative_to(TESTS).parts[0] != "fixtures":
            names.setdefault(f.stem, []).append(str(f.relative_to(REPO)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, f"test modules or helpers sharing a name (rename one): {clashes}"
