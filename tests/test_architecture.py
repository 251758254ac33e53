"""The house as drawn in docs/ARCHITECTURE.md: the import graph of funcpar and its models, and the function size rule.

The imports are read from the source (every ``import`` statement, function-level ones included; those under
``if TYPE_CHECKING:`` are not run and do not count). An import must not point to a higher layer, the graph must
have no cycle, models import only the public ``funcpar`` package, and the library never imports a model.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# lowest first; a module may import its own layer or a lower one (docs/ARCHITECTURE.md, "Layers")
LAYERS = [
    ("core", ["funcpar.tree", "funcpar.spec", "funcpar.state", "funcpar.model", "funcpar.mesh",
              "funcpar.lifeline", "funcpar.hostmem", "funcpar._safetensors", "funcpar.optim", "funcpar.optim.*", "funcpar.pipeline",
              "funcpar.stagecut", "funcpar.splitgrad", "funcpar.remat", "funcpar.documents"]),
    ("communication", ["funcpar.transport", "funcpar.collectives", "funcpar.p2p"]),
    ("blocks", ["funcpar.pointwise", "funcpar.attention", "funcpar.sharding", "funcpar.pipe", "funcpar.batching", "funcpar.step_config", "funcpar.step_options", "funcpar.layers", "funcpar.headloss", "funcpar.decoder", "funcpar.atomic", "funcpar.data", "funcpar.tokencache",
                "funcpar._ckpt_source", "funcpar._hf_folder", "funcpar.layout", "funcpar.buffers", "funcpar.zero3"]),
    ("io", ["funcpar.hf", "funcpar.checkpoint", "funcpar.lora"]),
    ("step", ["funcpar.step", "funcpar.step_gradients", "funcpar.verify"]),
    ("api", ["funcpar"]),
    ("apps", ["funcpar.options", "funcpar.cli", "funcpar.launch", "funcpar.preflight", "funcpar.progress", "funcpar.__main__", "funcpar.generate", "funcpar.plot", "funcpar.planning",
              "funcpar.assets", "funcpar.trackers"]),
    ("models", ["funcpar.models", "funcpar.models.*"]),
]


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


def layer_of(module: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if module == m or (m.endswith(".*") and module.startswith(m[:-1])):
                return i
    raise AssertionError(f"module {module} is in no layer of docs/ARCHITECTURE.md: add it to LAYERS and the doc")


def public_modules() -> set[str]:
    """``funcpar`` and the submodules its ``__init__`` re-exports (``from . import hf as hf``): the public API."""
    tree = ast.parse((ROOT / "funcpar" / "__init__.py").read_text())
    return {"funcpar"} | {f"funcpar.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1
                          and not n.module for a in n.names}


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import against the documented direction, every cycle, every forbidden edge."""
    bad, public = [], public_modules()
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if lb > la:
                bad.append(f"{a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]}), a higher layer")
            if a.startswith("funcpar.models") and b not in public and not b.startswith("funcpar.models"):
                bad.append(f"{a} imports {b}: models use the public API (`import funcpar`) only")
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


def test_the_import_graph_follows_the_layers():
    graph = import_graph()
    assert "funcpar.step" in graph and "funcpar.checkpoint" in graph["funcpar.step"]  # the parser sees imports
    assert violations(graph) == []


def test_a_back_edge_or_a_cycle_fails_the_layering_check():
    graph = import_graph()
    back = {**graph, "funcpar.tree": graph["funcpar.tree"] | {"funcpar.step"}}
    assert "funcpar.tree (core) imports funcpar.step (step), a higher layer" in violations(back)
    cyc = {**graph, "funcpar.mesh": graph["funcpar.mesh"] | {"funcpar.spec"},
           "funcpar.spec": graph["funcpar.spec"] | {"funcpar.mesh"}}
    assert any(v.startswith("import cycle:") and "funcpar.mesh" in v and "funcpar.spec" in v for v in violations(cyc))
    private = {**graph, "funcpar.models.llama": graph["funcpar.models.llama"] | {"funcpar.step"}}
    assert any("models use the public API" in v for v in violations(private))


def test_the_parser_resolves_relative_and_lazy_imports(tmp_path):
    src = "from . import collectives as C\nfrom .optim import chain\ndef f():\n    from . import hf\n" \
          "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .mesh import Mesh\n"
    known = {"funcpar.collectives", "funcpar.optim", "funcpar.hf", "funcpar.mesh"}
    assert _imports(ast.parse(src), "funcpar.x", False, known) == {"funcpar.collectives", "funcpar.optim", "funcpar.hf"}


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
