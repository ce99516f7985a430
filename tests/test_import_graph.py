"""The package's modules form no import cycle (issue 22): every `import` and `from ... import` of a
megatron_ucp module, at module level or inside a function (an import deferred to call time is still a
dependency), is an edge; a cycle between two modules means neither can be understood, tested or moved
without the other. The graph is read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_ucp"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the megatron_ucp modules it imports}; `from pkg import name` counts as an import of
    `pkg.name` when that is a module, else of `pkg`."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target.startswith("megatron_ucp") and target != name:
                    edges.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~80)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    assert len(graph) > 50 and "megatron_ucp.universal.reader" in graph  # the whole package was read
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_check_sees_a_cycle(tmp_path):
    """Negative control: a two-module cycle, one side deferred inside a function, is reported."""
    pkg = tmp_path / "megatron_ucp"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("")
    (pkg / "io" / "a.py").write_text("from megatron_ucp.io import b\n")
    (pkg / "io" / "b.py").write_text("def f():\n    from megatron_ucp.io.a import g\n")
    (pkg / "c.py").write_text("import megatron_ucp.io.a\n")
    assert cycles(import_graph(pkg)) == [["megatron_ucp.io.a", "megatron_ucp.io.b"]]
