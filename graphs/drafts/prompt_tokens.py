"""The prompt-token source's graph piece: no engine of its own; the full configuration's decode
graph embeds ids vocab..vocab+m-1 as the m trained prompt tokens (graph field `prompt_tokens`,
the table `ModelParts.draft_tables["prompt_tokens"]`), so its verify pass also guesses the next
round's drafts, and serves as the configuration's `prompt_tokens` engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive_export.graphs.plan import decode_field_role, with_full_decode_field

if TYPE_CHECKING:  # the plan applies this piece
    import torch

    from adaptive_export.graphs.plan import BuildPlan
    from adaptive_export.graphs.span_graph import GraphSpec, ModelParts

# the decode graph's field and plan key (how many it embeds), its engine role and its table's key
# in ModelParts.draft_tables: all the source's name
FIELD = ROLE = TABLE = "prompt_tokens"


def add_graphs(plan: BuildPlan, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """The full decode graph, now embedding the plan's prompt tokens (none: unchanged)."""
    return with_full_decode_field(plan, graphs, FIELD)


def engine_role(graph: GraphSpec) -> str | None:
    """A decode graph at the bundle's precision that embeds prompt tokens is the prompt-token engine."""
    return decode_field_role(graph, FIELD, ROLE)


def appended_ids(graph: GraphSpec) -> int:
    return graph.draft_field(FIELD)


def embedding_rows(parts: ModelParts, graph: GraphSpec) -> torch.Tensor | None:
    """The prompt-token table a graph embeds (its `prompt_tokens` rows), or a clear error if missing."""
    count = graph.draft_field(FIELD)
    if not count:
        return None
    table = parts.draft_tables.get(TABLE)
    if table is None or table.shape[0] != count:
        raise ValueError(
            f"graph {graph.name!r} embeds {count} prompt tokens, but the model parts hold "
            f"{0 if table is None else table.shape[0]}"
        )
    return table.detach()
