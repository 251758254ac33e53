"""The house as the folders draw it: the import graph of funcpar and its models, and the function size rule.

The imports are read from the source (every ``import`` statement, function-level ones included; those under
``if TYPE_CHECKING:`` are not run and do not count). The packages (funcpar's folders, each entry module its own
unit) import each other without a cycle, and so do the modules; models import only the public ``funcpar`` package,
and the library never imports a model. No table to keep in step: the folders are the map. In tests/ (and
benchmarks/), no module imports a test module: what tests share lives in helper modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the public entry modules funcpar/ holds beside its packages (docs/ARCHITECTURE.md, "The tree")
ENTRY_MODULES = {"__init__", "__main__", "tree", "spec", "state", "model"}


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted((ROOT / "funcpar").rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    for f in sorted((ROOT / "models").glob("*.py")):
        out["funcpar.models" + ("" if f.stem == "__init__" else f".{f.stem}")] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Internal modules imported by ``module`` (resolved: relative imports, ``from pkg import submodule``)."""
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            out |= subs if len(subs) == len(node.names) else subs | {base}  # `from pkg import sub` is sub
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: _imports(ast.parse(f.read_text()), m, f.name == "__init__.py", known) for m, f in files.items()}


def unit_of(module: str) -> str:
    """The package a module belongs to (``funcpar.nn.layers`` -> ``nn``; the models are one), or the entry module
    itself (``funcpar.tree`` -> ``tree``; ``funcpar`` -> ``api``): the units the folders draw."""
    parts = module.split(".")
    return "api" if len(parts) == 1 else parts[1]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between units (:func:`unit_of`), from the modules' imports: the folders are the map."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(unit_of(a), set()).update(unit_of(b) for b in targets if unit_of(b) != unit_of(a))
    return out


def public_modules() -> set[str]:
    """``funcpar`` and the submodules its ``__init__`` re-exports (``from funcpar.io import hf as hf``): the public
    API."""
    tree = ast.parse((ROOT / "funcpar" / "__init__.py").read_text())
    known, out = set(module_files()), {"funcpar"}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("funcpar"):
            out |= {f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in known}
            out |= {n.module for a in n.names if n.module in known and a.name == n.module.rpartition(".")[2]}
    return out


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle between packages or between modules, and every forbidden edge."""
    bad, public = [], public_modules()
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if a.startswith("funcpar.models") and b not in public and not b.startswith("funcpar.models"):
                bad.append(f"{a} imports {b}: models use the public API (`import funcpar`) only")
    bad += [f"package cycle: {' -> '.join(c)}" for c in cycles(package_graph(graph))]
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_the_packages_import_each_other_without_a_cycle():
    graph = import_graph()
    assert "funcpar.train.step" in graph and "funcpar.io.checkpoint" in graph["funcpar.train.step"]  # imports seen
    assert violations(graph) == []
    units = package_graph(graph)
    assert {"parallel", "nn", "pipeline", "train", "io", "data", "cli", "optim"} <= set(units)
    assert "train" not in units["parallel"] and "cli" not in units["train"]  # (what the folders say: a direction)


def test_funcpar_top_level_holds_entry_modules_and_packages_only():
    top = {p.stem for p in (ROOT / "funcpar").glob("*.py")}
    assert top <= ENTRY_MODULES, top - ENTRY_MODULES
    assert all((p / "__init__.py").exists() for p in (ROOT / "funcpar").iterdir()
               if p.is_dir() and not p.name.startswith((".", "_")) and not p.is_symlink())


def test_a_cycle_between_packages_or_modules_and_a_private_import_fail_the_check():
    graph = import_graph()
    back = {**graph, "funcpar.parallel.mesh": graph["funcpar.parallel.mesh"] | {"funcpar.train.step"}}
    assert any(v.startswith("package cycle:") and "parallel" in v and "train" in v for v in violations(back))
    cyc = {**graph, "funcpar.parallel.mesh": graph["funcpar.parallel.mesh"] | {"funcpar.parallel.p2p"},
           "funcpar.parallel.p2p": graph["funcpar.parallel.p2p"] | {"funcpar.parallel.mesh"}}
    assert any(v.startswith("import cycle:") and "funcpar.parallel.mesh" in v for v in violations(cyc))
    private = {**graph, "funcpar.models.llama": graph["funcpar.models.llama"] | {"funcpar.train.step"}}
    assert any("models use the public API" in v for v in violations(private))


def test_the_parser_resolves_relative_and_lazy_imports(tmp_path):
    src = "from . import collectives as C\nfrom ..optim import chain\ndef f():\n    from ..io import hf\n" \
          "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .mesh import Mesh\n"
    known = {"funcpar.parallel.collectives", "funcpar.optim", "funcpar.io.hf", "funcpar.parallel.mesh"}
    assert _imports(ast.parse(src), "funcpar.parallel.x", False, known) == {
        "funcpar.parallel.collectives", "funcpar.optim", "funcpar.io.hf"}


def test_the_library_never_imports_a_model():
    graph = import_graph()
    assert [a for a, t in graph.items() if not a.startswith("funcpar.models") and any(
        b.startswith("funcpar.models") for b in t)] == []


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines less its docstring's: the rule bounds code, and an Args section documents, it adds none."""
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def test_the_function_size_rule_counts_code_not_docstrings():
    tree = ast.parse('def f(x):\n    """Doc.\n\n    Args:\n        x: a number.\n    """\n    y = x\n    return y\n')
    assert code_lines(tree.body[0]) == 3


@pytest.mark.parametrize("folder", ["funcpar", "models"])
def test_no_function_over_60_lines(folder):
    # (a module's size follows its concern: no line count for modules; lines <= 120 characters is ruff's E501)
    too_long = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        src = f.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(node)
                if n > 60:
                    too_long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert too_long == []


@pytest.mark.parametrize("folder", ["funcpar", "models"])
def test_no_module_imports_another_modules_underscore_name(folder):
    # a name another module needs is public in its own: `from .pointwise import _x` hides a coupling
    found = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [f"{f.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []



def imported_test_modules(tree: ast.AST) -> list[str]:
    """The test modules (``test_*``) a source imports, function-level imports included: ``import test_x``,
    ``from test_x import y``, ``from . import test_x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0].startswith("test_")]
        elif isinstance(node, ast.ImportFrom):
            if node.module and node.module.split(".")[0].startswith("test_"):
                found.append(node.module)
            elif not node.module:
                found += [a.name for a in node.names if a.name.startswith("test_")]
    return found


def test_no_test_module_imports_another():
    # what tests share lives in helper modules (tests/fixtures.py, hf_fixtures.py, jobs.py, harness.py), not in a
    # test module: importing one runs its module-level code and ties its tests' edits to others'
    src = "import test_a\nfrom test_b import c\ndef f():\n    from test_c.d import e\n    from . import test_f\n" \
          "import harness\nfrom hf_fixtures import test_names\n"
    assert imported_test_modules(ast.parse(src)) == ["test_a", "test_b", "test_c.d", "test_f"]
    files = [f for folder in ("tests", "benchmarks") for f in sorted((ROOT / folder).glob("*.py"))]
    found = [f"{f.relative_to(ROOT)}: {m}" for f in files for m in imported_test_modules(ast.parse(f.read_text()))]
    assert found == []
