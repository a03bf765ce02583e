"""The packages import only downwards (docs/architecture.md section 1): commands may import
everything; exporter and calibration import graphs, loading and runtimes but never each
other (only commands joins them); loading imports graphs and runtimes; graphs nothing of
the project; runtimes only itself. Checked on the source with `ast`, so lazy imports inside
functions count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAME = "adaptive_export"
PROJECT = ("graphs", "loading", "exporter", "calibration", "runtimes", "commands")
FORBIDDEN = {
    "runtimes": {"graphs", "loading", "exporter", "calibration", "commands"},
    "graphs": {"loading", "exporter", "calibration", "runtimes", "commands"},
    "loading": {"exporter", "calibration", "commands"},
    "exporter": {"calibration", "commands"},
    "calibration": {"exporter", "commands"},
    "commands": set(),
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import in the file, relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{IMPORT_NAME}.{path.relative_to(ROOT).parts[0]}"] if node.level else [node.module or ""]
        else:
            continue
        found |= {(top, node.lineno) for top in map(project_package, names) if top in PROJECT}
    return found


def project_package(module: str) -> str:
    """'adaptive_export.runtimes.x' -> 'runtimes'; a bare 'runtimes.x' stays 'bare:runtimes'."""
    parts = module.split(".")
    if parts[0] == IMPORT_NAME and len(parts) > 1:
        return parts[1]
    return f"bare:{parts[0]}" if parts[0] in PROJECT else parts[0]


def project_modules() -> list[Path]:
    return sorted(p for package in PROJECT for p in (ROOT / package).rglob("*.py"))


def test_every_package_is_checked() -> None:
    assert set(FORBIDDEN) == set(PROJECT)
    assert len(project_modules()) > 40


@pytest.mark.parametrize("path", project_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_only(path: Path) -> None:
    package = path.relative_to(ROOT).parts[0]
    bad = sorted((line, name) for name, line in imported_packages(path) if name in FORBIDDEN[package])
    assert not bad, f"{path.relative_to(ROOT)} imports " + ", ".join(f"{name} (line {line})" for line, name in bad)


@pytest.mark.parametrize(
    "path",
    project_modules() + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_imports_use_the_one_import_name(path: Path) -> None:
    """Installed, the packages live under `adaptive_export`; a bare `runtimes` would import a second copy."""
    tree = ast.parse(path.read_text(), str(path))
    bare = []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        )
        bare += [(node.lineno, n) for n in names if n.split(".")[0] in PROJECT]
    assert not bare, f"{path.relative_to(ROOT)} imports bare project names: {bare}"


def test_no_module_shadows_the_standard_library() -> None:
    """A project module named like a standard one (runtimes/inspect.py was) reads as the other."""
    shadows = [str(p.relative_to(ROOT)) for p in project_modules() if p.stem in sys.stdlib_module_names]
    assert not shadows, f"modules named like the standard library's: {shadows}"


@pytest.mark.parametrize(
    "path",
    project_modules() + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_generator_names_one_thing(path: Path) -> None:
    """`Generator` is the runtime's public class; the standard one is spelled qualified
    (`collections.abc.Generator`) or under another name, never bound as a bare `Generator`."""
    bare = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        and node.module in ("typing", "collections.abc", "typing_extensions")
        and any(alias.name == "Generator" and alias.asname in (None, "Generator") for alias in node.names)
    ]
    assert not bare, f"{path.relative_to(ROOT)} binds the standard Generator unqualified (line {bare})"


def load_time_imports(path: Path, modules: set[str]) -> set[str]:
    """The runtimes modules this file imports when it is loaded: module-level imports, including
    those under `if TYPE_CHECKING` (a circle held open by a guard is still a circle); imports
    inside functions run later and do not count."""
    found = set()
    scopes: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while scopes:
        for node in ast.iter_child_nodes(scopes.pop()):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            else:
                scopes.append(node)
    return found & modules


def runtimes_import_graph() -> dict[str, set[str]]:
    paths = {}
    for path in (ROOT / "runtimes").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        paths[".".join((IMPORT_NAME, *parts))] = path
    modules = set(paths)
    return {name: load_time_imports(path, modules) - {name} for name, path in paths.items()}


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph (empty when there is none), by depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return []


def test_runtimes_has_no_import_circle() -> None:
    """Issue #39: the manifest types once imported the drafting sources, which import the backends,
    which import the bundle, which imports the manifest. The drawn graph must have no circle."""
    graph = runtimes_import_graph()
    assert len(graph) > 30 and graph[f"{IMPORT_NAME}.runtimes.generate"]  # the graph was drawn
    assert import_circle(graph) == []
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
