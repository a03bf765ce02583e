"""Draft sources' graph pieces: `graphs/drafts/<name>.py`, named as the source
(runtimes/drafting/registry.py), holds what the source adds to a bundle's graphs, as
`add_graphs(plan, graphs) -> graphs`. graphs/ imports no other project package, so it cannot
read the registry: the pieces are the modules of this package, applied in name order, and
tests/test_draft_registry.py checks they are exactly the registered sources that run engines
of their own."""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import GraphSpec

GraphPiece = Callable[["BuildPlan", list["GraphSpec"]], list["GraphSpec"]]


def _pieces() -> dict[str, GraphPiece]:
    names = sorted(info.name for info in pkgutil.iter_modules(__path__))
    return {name: import_module(f"{__name__}.{name}").add_graphs for name in names}


GRAPH_PIECES: dict[str, GraphPiece] = _pieces()
