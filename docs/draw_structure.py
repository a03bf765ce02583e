"""Draw docs/structure.svg: the six packages and who imports whom, under their `adaptive_export.` names.

Run from the repository root: `python docs/draw_structure.py`. It reads every module's imports
with `ast` (lazy and TYPE_CHECKING ones included, as tests/test_layering.py does), draws one
box per package on its layer (docs/architecture.md section 1) and one arrow per importing pair,
labelled with how many import statements make it, and prints any circle between packages.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAME = "adaptive_export"
# package -> (x, y) of its box's centre: commands on top, graphs and runtimes on the ground
PLACES = {
    "commands": (400, 50),
    "calibration": (130, 170),
    "loading": (400, 170),
    "exporter": (670, 170),
    "graphs": (200, 300),
    "runtimes": (600, 300),
}
BOX_W, BOX_H = 200, 44


def imports_by_pair() -> Counter[tuple[str, str]]:
    """(importer, imported) package -> number of import statements, across packages only."""
    pairs: Counter[tuple[str, str]] = Counter()
    for package in PLACES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    modules = [node.module or ""]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == IMPORT_NAME and len(parts) > 1 and parts[1] != package and parts[1] in PLACES:
                        pairs[(package, parts[1])] += 1
    return pairs


def circles(pairs: Counter[tuple[str, str]]) -> list[list[str]]:
    """Every package path that leads back to where it started (each circle once, from its first package)."""
    found: list[list[str]] = []

    def visit(path: list[str]) -> None:
        for (source, target), _ in sorted(pairs.items()):
            if source != path[-1]:
                continue
            if target == path[0]:
                found.append(path)
            elif target not in path and target > path[0]:
                visit([*path, target])

    for start in PLACES:
        visit([start])
    return found


def _ends(source: tuple[int, int], target: tuple[int, int]) -> tuple[tuple[float, float], tuple[float, float]]:
    """Where an arrow leaves and meets the boxes: side to side on one row, else bottom to top,
    leaning toward the other box so that no arrow crosses a third box."""
    (x1, y1), (x2, y2) = source, target
    if y1 == y2:
        side = BOX_W / 2 if x2 > x1 else -BOX_W / 2
        return (x1 + side, y1), (x2 - side, y2)
    reach = BOX_W / 2 - 10
    start = x1 + max(-reach, min(reach, (x2 - x1) * 0.5))
    end = x2 - max(-reach, min(reach, (x2 - x1) * 0.25))
    return (start, y1 + BOX_H / 2), (end, y2 - BOX_H / 2)


def svg(pairs: Counter[tuple[str, str]]) -> str:
    lines = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="800" height="350" font-family="sans-serif" font-size="13">',
        '<defs><marker id="head" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#445"/></marker></defs>',
        '<rect width="800" height="350" fill="white"/>',
    ]
    for (source, target), count in sorted(pairs.items()):
        (x1, y1), (x2, y2) = _ends(PLACES[source], PLACES[target])
        lines.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#445" marker-end="url(#head)"/>')
        lx, ly = x1 + (x2 - x1) * 0.3, y1 + (y2 - y1) * 0.3
        lx += 4 if x2 >= x1 else -16  # beside the line, on the side it leans to
        lines.append(f'<text x="{lx:.0f}" y="{ly - 3:.0f}" fill="#667">{count}</text>')
    for package, (x, y) in PLACES.items():
        lines.append(
            f'<rect x="{x - BOX_W / 2}" y="{y - BOX_H / 2}" width="{BOX_W}" height="{BOX_H}" rx="6" '
            'fill="#eef2f8" stroke="#334"/>'
        )
        lines.append(f'<text x="{x}" y="{y + 5}" text-anchor="middle">{IMPORT_NAME}.{package}</text>')
    lines.append('<text x="10" y="342" fill="#667" font-size="11">arrow: A imports B (number: import statements); '
                 "drawn by docs/draw_structure.py</text>")  # fmt: skip
    return "\n".join([*lines, "</svg>\n"])


def main() -> None:
    pairs = imports_by_pair()
    (ROOT / "docs" / "structure.svg").write_text(svg(pairs))
    found = circles(pairs)
    print("circles between packages:", " ; ".join(" -> ".join([*c, c[0]]) for c in found) if found else "none")


if __name__ == "__main__":
    main()
