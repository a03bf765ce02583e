"""The precision draft's graph piece: the full model's decode graph with its weights at a
cheaper precision, and, with VocabTrim (`draft_vocab`), a head that scores only the frequent
token ids. VocabTrim is a feature of this source, not a source: it has no propose/verify of its
own and no engine, only a smaller head on this one (the head rows: span_graph.draft_head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive_export.graphs.plan import FULL_CONFIG
from adaptive_export.graphs.span_graph import GraphSpec

if TYPE_CHECKING:  # the plan applies this piece
    from adaptive_export.graphs.plan import BuildPlan

PRECISION_DRAFTS = ("int8", "int4", "native4")
NAME = "precision"  # the registered source (runtimes/draft_registry.py); its plan's key
ROLE = "precision_draft"  # the full configuration's engine role of the draft graph


def precision_draft_graph(num_layers: int, precision: str, draft_vocab: int = 0) -> GraphSpec:
    """The full model's decode graph with its weights at `precision`: drafts token ids T=1,
    writing every layer's KV rows, which the verifier's pass then overwrites. With
    `draft_vocab`, its head scores only that many frequent tokens (VocabTrim)."""
    if precision not in PRECISION_DRAFTS:
        raise ValueError(f"draft precision {precision!r} is not one of {PRECISION_DRAFTS}")
    return GraphSpec(
        f"pdraft_{FULL_CONFIG}_{precision}",
        "decode",
        tuple(range(num_layers)),
        config=FULL_CONFIG,
        precision=precision,
        draft_vocab=draft_vocab,
    )


def add_graphs(plan: BuildPlan, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """The precision draft graph, when the plan names a precision for it (the full configuration only)."""
    precision = plan.draft(NAME, str)
    if precision is None:
        return graphs
    return [*graphs, precision_draft_graph(plan.num_layers, precision, plan.draft_vocab)]


def engine_role(graph: GraphSpec) -> str | None:
    """A graph at a precision of its own (cheaper than the bundle's) is the precision draft."""
    return ROLE if graph.precision is not None else None
