"""Draft sources' graph pieces: `graphs/drafts/<name>.py`, named as the source
(runtimes/draft_registry.py), holds what the source adds to a bundle's graphs, as
`add_graphs(plan, graphs) -> graphs`, and optionally the hooks below. graphs/ imports no other
project package, so it cannot read the registry: the pieces are the modules of this package,
applied in name order, and tests/test_draft_registry.py checks they are exactly the registered
sources that run engines of their own.

Optional hooks of a piece (module-level functions of these names):
- `engine_role(graph) -> str | None`: the configuration's engine role a graph also serves
  (the exporter assigns it; the source's runtime class checks it in the manifest);
- `appended_ids(graph) -> int`: how many ids vocab.. the graph embeds as trained rows;
- `embedding_rows(parts, graph) -> Tensor | None`: those rows, from `ModelParts.draft_tables`;
- `guess_head(parts, graph) -> nn.Module | None`: a head the graph runs on its rows to guess the
  token after each row's choice (output `guesses`, int64 [1, R]; the source's runtime class names
  the field that turns it on as its contract's `guess_field`).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor, nn

    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import GraphSpec, ModelParts


@dataclass(frozen=True)
class GraphPiece:
    """One source's graph piece: what it adds to the plan's graphs, and its optional hooks."""

    add_graphs: Callable[[BuildPlan, list[GraphSpec]], list[GraphSpec]]
    engine_role: Callable[[GraphSpec], str | None] | None = None
    appended_ids: Callable[[GraphSpec], int] | None = None
    embedding_rows: Callable[[ModelParts, GraphSpec], Tensor | None] | None = None
    guess_head: Callable[[ModelParts, GraphSpec], nn.Module | None] | None = None


def _pieces() -> dict[str, GraphPiece]:
    names = sorted(info.name for info in pkgutil.iter_modules(__path__))
    modules = {name: import_module(f"{__name__}.{name}") for name in names}
    hooks = ("engine_role", "appended_ids", "embedding_rows", "guess_head")
    return {
        name: GraphPiece(module.add_graphs, **{hook: getattr(module, hook, None) for hook in hooks})
        for name, module in modules.items()
    }


GRAPH_PIECES: dict[str, GraphPiece] = _pieces()


def engine_roles(graph: GraphSpec) -> list[str]:
    """The draft-source engine roles a graph serves besides its own kind's."""
    roles = (piece.engine_role(graph) for piece in GRAPH_PIECES.values() if piece.engine_role is not None)
    return [role for role in roles if role]


def appended_ids(graph: GraphSpec) -> int:
    """How many ids after the vocabulary the graph embeds (0: none)."""
    return sum(piece.appended_ids(graph) for piece in GRAPH_PIECES.values() if piece.appended_ids is not None)


def appended_embeddings(parts: ModelParts, graph: GraphSpec) -> Tensor | None:
    """The rows ids vocab.. embed as: one piece's table at most (two would claim the same ids)."""
    hooks = [piece.embedding_rows for piece in GRAPH_PIECES.values() if piece.embedding_rows is not None]
    tables = [table for table in (rows(parts, graph) for rows in hooks) if table is not None]
    if len(tables) > 1:
        raise ValueError(
            f"graph {graph.name!r} embeds the trained rows of {len(tables)} draft sources after the vocabulary"
        )
    return tables[0] if tables else None


def guess_head(parts: ModelParts, graph: GraphSpec) -> nn.Module | None:
    """The head that guesses after each row of the graph: one piece's at most."""
    hooks = [piece.guess_head for piece in GRAPH_PIECES.values() if piece.guess_head is not None]
    heads = [head for head in (hook(parts, graph) for hook in hooks) if head is not None]
    if len(heads) > 1:
        raise ValueError(f"graph {graph.name!r} guesses with the heads of {len(heads)} draft sources")
    return heads[0] if heads else None
