"""The prompt-token source's graph piece: no engine of its own; the full configuration's decode
graph embeds ids vocab..vocab+m-1 as the m trained prompt tokens (graph field `prompt_tokens`;
the table: span_graph.prompt_table), so its verify pass also guesses the next round's drafts."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from adaptive_export.graphs.plan import FULL_CONFIG

if TYPE_CHECKING:  # the plan applies this piece
    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import GraphSpec


def add_graphs(plan: BuildPlan, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """The full decode graph, now embedding the plan's prompt tokens (none: unchanged)."""
    if not plan.prompt_tokens:
        return graphs
    return [
        dataclasses.replace(graph, prompt_tokens=plan.prompt_tokens) if graph.name == f"decode_{FULL_CONFIG}" else graph
        for graph in graphs
    ]
