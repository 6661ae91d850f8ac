"""The package's layers (docs/architecture.md), read from the source's own imports with ``ast``: every module of
``mshard/`` sits on one layer, imports only from its own layer or those below, and no import forms a circle;
package imports sit at the top of the module, never inside a function (the way a circle used to be hidden).

A new module must be given a layer here (the test names it); moving a module up or down is a change to this map
and to docs/architecture.md together.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from helpers import ROOT

# layer -> the folder under mshard/_src that holds it; everything outside mshard/_src is the public face (layer 8)
LAYERS: dict[int, str] = {
    1: "values",      # errors, context, layouts and check_strategy, the plan value, the HLO parser: no tracing
    2: "jaxpr",       # marks, jaxpr walking, iteration-space rules, the operator graph, the user's-trace bridge
    3: "planning",    # axis assignment, the searched plan, XLA guards, flax metadata
    4: "runtime",     # emitting the program, regions, the fast path, dry runs, datasets, fusion
    5: "frontend",    # shard, primitives, Cells, layers, losses, AutoParallel
    6: "training",    # train cells, gradients, ZeRO, pipeline
    7: "edges",       # checkpoints, reports, pictures, the launcher
}
FACE = 8


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name: its folder's under mshard._src, 8 outside it, None for an unknown folder."""
    parts = module.split(".")
    if parts[:2] != ["mshard", "_src"]:
        return FACE
    if len(parts) == 2:
        return 1                                 # mshard/_src/__init__.py: a docstring
    return {f: k for k, f in LAYERS.items()}.get(parts[2])


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """dotted name -> file, for every module of ``root``/mshard."""
    out = {}
    for path in sorted((root / "mshard").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules(ROOT)
LAYER = {m: layer_of(m) for m in MODULES}


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, pathlib.Path]) -> list[str]:
    """The package modules an import statement reads (``from . import x`` is module ``x`` where x is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "mshard"]
    if node.level:
        here = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "mshard":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _imports(root: pathlib.Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """module -> the package modules it imports at its top; and every package import inside a function."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    inside: list[str] = []
    for m, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(m, node, modules):
                    if id(node) in nested:
                        inside.append(f"{path.relative_to(root).as_posix()}:{node.lineno} imports {t} inside a function")
                    elif t != m:
                        graph[m].add(t)
    return graph, inside


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    assert sorted(m for m, k in LAYER.items() if k is None) == [], \
        "a folder of mshard/_src that is no layer: add it to LAYERS (and docs/architecture.md)"


def test_the_public_face_is_thin():
    """A module outside mshard/_src only re-exports: a docstring, imports, ``__all__``, the not-offered
    ``__getattr__`` (and ``__main__``'s guard);
    every name it imports is in its ``__all__``, and ``__all__`` names nothing it does not import."""
    bad = []
    for m, path in MODULES.items():
        if LAYER[m] != FACE:
            continue
        tree = ast.parse(path.read_text())
        body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
        imported, listed = set(), None
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {a.asname or a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.Assign) and [getattr(x, "id", None) for x in node.targets] == ["__all__"]:
                listed = set(ast.literal_eval(node.value))
            elif isinstance(node, ast.Assign) and [getattr(x, "id", None) for x in node.targets] == ["__getattr__"]:
                imported.discard("missing_names")        # the not-offered hint (values/names.py), not a public name
            elif m == "mshard.__main__" and isinstance(node, ast.If):
                continue
            else:
                bad.append(f"{m}:{node.lineno} is more than a re-export ({type(node).__name__})")
        if m == "mshard.__main__":
            continue
        if listed is None:
            bad.append(f"{m} has no __all__")
        else:
            bad += [f"{m}: __all__ lacks {n}" for n in sorted(imported - listed - {"annotations"})]
            bad += [f"{m}: __all__ names {n}, which it does not import" for n in sorted(listed - imported)]
    assert bad == []


def test_no_package_import_inside_a_function():
    assert _imports()[1] == []


def test_no_import_runs_up_a_layer():
    graph, _ = _imports()
    up = [f"{m} (layer {LAYER[m]}) imports {t} (layer {LAYER[t]})" for m, ts in sorted(graph.items()) for t in sorted(ts)
          if LAYER[t] > LAYER[m]]
    assert up == []


def test_no_import_circle():
    assert _circles(_imports()[0]) == []


@pytest.mark.parametrize("source, found", [
    # a planted circle through a function-level import (as annotate -> shard once was) and an upward one
    ({"a": "from . import b\n", "b": "def f():\n    from . import a\n"}, "inside"),
    ({"a": "from . import b\n", "b": "from . import a\n"}, "circle"),
])
def test_the_checks_see_a_planted_circle(tmp_path, source, found):
    pkg = tmp_path / "mshard"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in source.items():
        (pkg / f"{name}.py").write_text(text)
    graph, inside = _imports(tmp_path)
    if found == "inside":
        assert inside == ["mshard/b.py:2 imports mshard.a inside a function"]
    else:
        assert _circles(graph) == [["mshard.a", "mshard.b"]]
