"""No import circle among the runtimes/ modules (docs/architecture.md section 1).

The graph is drawn from the source with `ast`: every import counts, those under
`if TYPE_CHECKING:` and those inside functions too, so a circle cannot hide behind a guard or
a lazy import. A package's `__init__` counts as a module of its own; `from pkg import name`
is an edge to `pkg.name` where that is a module, else to `pkg`; importing `pkg.mod` runs
`pkg/__init__.py` first, so it is an edge to `pkg` as well (unless `pkg` holds the importing
module, whose own import already ran it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIMES = ROOT / "runtimes"
PREFIX = "adaptive_export.runtimes"


def module_name(path: Path, root: Path = RUNTIMES) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


def runtime_modules(root: Path = RUNTIMES) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The runtimes modules `path` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = {name.rsplit(".", n)[0] for n in range(name.count(".") + 1)}  # the module and its packages
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            while target.startswith(PREFIX + ".") and target not in own:
                found.add(target)  # the module and every package above it that is run to import it
                target = target.rpartition(".")[0]
    return found


def import_graph(root: Path = RUNTIMES) -> dict[str, set[str]]:
    modules = runtime_modules(root)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return component


def test_the_graph_sees_the_runtimes() -> None:
    graph = import_graph()
    assert len(graph) > 30
    assert f"{PREFIX}.manifest" in graph[f"{PREFIX}.bundle"]


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert one_circle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_guarded_lazy_and_package_imports_count(tmp_path: Path) -> None:
    """A circle closed only under TYPE_CHECKING, only inside a function, or only by the package
    __init__ that importing a submodule runs, is still a circle."""
    (tmp_path / "pkg").mkdir()
    files = {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adaptive_export.runtimes.b import B\n",
        "b.py": "def f():\n    from . import c\n",
        "c.py": "from adaptive_export.runtimes.pkg.leaf import x\n",
        "pkg/__init__.py": "from adaptive_export.runtimes import a\n",
        "pkg/leaf.py": "from . import sibling\n",
        "pkg/sibling.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph[f"{PREFIX}.c"] == {f"{PREFIX}.pkg", f"{PREFIX}.pkg.leaf"}
    assert graph[f"{PREFIX}.pkg.leaf"] == {f"{PREFIX}.pkg.sibling"}  # its own package already ran
    assert find_cycles(graph) == [[f"{PREFIX}.{m}" for m in ("a", "b", "c", "pkg")]]


def test_no_import_circle_in_runtimes() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    short = len(PREFIX) + 1
    message = "\n".join(
        f"{len(c)} modules: {' -> '.join(m[short:] or '(runtimes)' for m in one_circle(graph, c))}" for c in cycles
    )
    assert not cycles, "import circle(s) among runtimes/ modules (TYPE_CHECKING and lazy imports count):\n" + message
