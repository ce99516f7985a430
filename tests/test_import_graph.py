"""The package's modules form no import cycle (issue 22): every `import` and `from ... import` of a
megatron_ucp module, at module level or inside a function (an import deferred to call time is still a
dependency; not one under `if TYPE_CHECKING:`, which never runs), is an edge, and so is each package (`__init__`) the import runs on the way, outside the
importer's own packages; a cycle between two modules means neither can be understood, tested or moved
without the other. The graph is read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_ucp"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the megatron_ucp modules it imports}; `from pkg import name` counts as an import of
    `pkg.name` when that is a module, else of `pkg`. Importing `a.b.c` also runs `a/__init__` and
    `a/b/__init__`: an edge to each, except the importer's own packages (already running)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                     for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in type_only:  # `if TYPE_CHECKING:` imports never run
                continue
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
            own = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)}
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if not target.startswith("megatron_ucp"):
                    continue
                parts = target.split(".")
                edges.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                             if p in modules and p not in own and p != name)
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
    # a package facade that imports a module importing back into the facade's package from outside
    (pkg / "io" / "b.py").write_text("")
    (pkg / "fmt").mkdir()
    (pkg / "fmt" / "__init__.py").write_text("from megatron_ucp.fmt.reader import R\n")
    (pkg / "fmt" / "reader.py").write_text("from megatron_ucp.c import x\n")
    (pkg / "c.py").write_text("from megatron_ucp.fmt.names import y\n")
    (pkg / "fmt" / "names.py").write_text("")
    assert cycles(import_graph(pkg)) == [["megatron_ucp.c", "megatron_ucp.fmt", "megatron_ucp.fmt.reader"]]


SERIALIZATION = PACKAGE / "serialization"


def megatron_knowledge(root: Path = PACKAGE) -> list[str]:
    """Where the generic serialization package (serialization/) depends on Megatron: an import of a project module
    outside serialization/, core/ and io/, or a string naming a Megatron package (`megatron.`, as Megatron's class
    paths begin; the project's own `megatron_ucp` excluded)."""
    found = []
    allowed = ("megatron_ucp.serialization", "megatron_ucp.core", "megatron_ucp.io")
    graph = import_graph(root)
    for module in sorted(m for m in graph if m.startswith("megatron_ucp.serialization")):
        found += [f"{module} imports {t}" for t in sorted(graph[module])
                  if not t.startswith(allowed) and t != "megatron_ucp"]
    for path in sorted((root / "serialization").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{path.name}:{n.lineno} names {n.value[:60]!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("megatron.")]
    return found


def test_serialization_knows_no_megatron():
    """serialization/ (the allow-list unpickler, torch.save's format, tensor records) is generic torch serialization:
    it imports only core/ and io/ of the project and names no Megatron class (formats/pickles.py gives Megatron's
    to it as a PickleFamily)."""
    assert {p.name for p in SERIALIZATION.glob("*.py")} >= {"safe_pickle.py", "torch_save.py", "records.py"}
    assert megatron_knowledge() == []


def test_the_megatron_check_sees_knowledge(tmp_path):
    """Negative control: a Megatron enum named in serialization/, and an import of formats/, are both reported."""
    pkg = tmp_path / "megatron_ucp"
    for sub in ("serialization", "formats", "core"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "dtypes.py").write_text("")
    (pkg / "serialization" / "a.py").write_text("from megatron_ucp.core import dtypes\nX = 'megatron.core.enums.ModelType'\n")
    (pkg / "serialization" / "b.py").write_text("def f():\n    from megatron_ucp.formats import pickles\n")
    (pkg / "formats" / "pickles.py").write_text("")
    assert megatron_knowledge(pkg) == ["megatron_ucp.serialization.b imports megatron_ucp.formats",
                                       "megatron_ucp.serialization.b imports megatron_ucp.formats.pickles",
                                       "a.py:2 names 'megatron.core.enums.ModelType'"]
