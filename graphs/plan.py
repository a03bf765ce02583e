"""The plan of which graphs a bundle holds: prefill, one decode per configuration, and what
each draft source's graph piece adds (graphs/drafts/<name>.py: draft/verify, precision draft,
a source's trained embeddings).

Pure data so the runtime and `inspect` can read it back from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from adaptive_export.graphs.span_graph import GraphSpec

FULL_CONFIG = "full"
Plan = TypeVar("Plan")


@dataclass(frozen=True)
class SkipConfig:
    """A sorted tuple of kept layer ids, fixed for a whole sequence; `adapters`: its decode adapts
    every kept layer's output with the bundle's skip adapters (FiRST's LoRA compensation)."""

    id: str
    kept: tuple[int, ...]
    adapters: bool = False


@dataclass
class BuildPlan:
    num_layers: int
    configs: list[SkipConfig] = field(default_factory=list)
    routers: bool = False
    # What each draft source with engines decided for its graph piece (graphs/drafts/<name>.py),
    # under the source's registered name, in the piece's own type (early exit: its ExitPlan; the
    # precision draft: its precision); absent: the source adds no engine.
    drafts: dict[str, object] = field(default_factory=dict)
    # What a draft source's build step decided for its graph piece, as the graph fields the piece
    # sets, by key; unset: the source adds nothing.
    draft_fields: dict[str, int] = field(default_factory=dict)
    # A reduced draft vocabulary (VocabTrim, or a trained draft head's): the head of a source's
    # draft graph scores only this many token ids (0: all); the bundle's draft_vocab.bin.
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        if not any(c.id == FULL_CONFIG for c in self.configs):
            self.configs.insert(0, SkipConfig(FULL_CONFIG, tuple(range(self.num_layers))))

    def draft(self, name: str, kind: type[Plan]) -> Plan | None:
        """The named source's plan, of the type its piece reads (None: the source adds nothing)."""
        plan = self.drafts.get(name)
        if plan is not None and not isinstance(plan, kind):
            raise TypeError(f"the {name} draft's plan is a {type(plan).__name__}, not a {kind.__name__}")
        return plan

    def graphs(self) -> list[GraphSpec]:
        """prefill, one decode graph per configuration, then each draft source's graph piece
        in turn (graphs/drafts/: it adds its engines or changes a graph it drafts with)."""
        from adaptive_export.graphs.drafts import GRAPH_PIECES

        every = tuple(range(self.num_layers))
        out = [GraphSpec("prefill", "prefill", every, logits="last", router_scores=self.routers)]
        out += [
            GraphSpec(f"decode_{config.id}", "decode", config.kept, config=config.id, skip_adapters=config.adapters)
            for config in self.configs
        ]
        for piece in GRAPH_PIECES.values():
            out = piece.add_graphs(self, out)
        return out


def with_full_decode_field(plan: BuildPlan, graphs: list[GraphSpec], key: str) -> list[GraphSpec]:
    """The graphs, the full decode graph's draft field `key` set to the plan's value (unset:
    unchanged): for a source whose engine is that graph itself (prompt tokens, the EAGLE head)."""
    value = plan.draft_fields.get(key, 0)
    if not value:
        return graphs
    return [graph.with_draft_field(key, value) if graph.name == f"decode_{FULL_CONFIG}" else graph for graph in graphs]


def decode_field_role(graph: GraphSpec, key: str, role: str) -> str | None:
    """`role` for a decode graph at the bundle's precision whose draft field `key` is set."""
    return role if graph.kind == "decode" and graph.draft_field(key) and graph.precision is None else None
