"""The plan of which graphs a bundle holds: prefill, one decode per configuration, and what
each draft source's graph piece adds (graphs/drafts/<name>.py: draft/verify, precision draft,
a source's trained embeddings).

Pure data so the runtime and `inspect` can read it back from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from adaptive_export.graphs.span_graph import GraphSpec

if TYPE_CHECKING:  # the graph pieces import this module
    from adaptive_export.graphs.drafts.early_exit import ExitPlan

FULL_CONFIG = "full"


@dataclass(frozen=True)
class SkipConfig:
    """A sorted tuple of kept layer ids, fixed for a whole sequence."""

    id: str
    kept: tuple[int, ...]


@dataclass
class BuildPlan:
    num_layers: int
    configs: list[SkipConfig] = field(default_factory=list)
    routers: bool = False
    exit: ExitPlan | None = None
    # A draft engine over the same layers and arena at a cheaper weight precision
    # (runtimes/speculative.py, source "precision"); built for the full configuration only.
    precision_draft: str | None = None
    # What a draft source's build step decided for its graph piece (graphs/drafts/<name>.py), as
    # the graph fields the piece sets, by key; unset: the source adds nothing.
    draft_fields: dict[str, int] = field(default_factory=dict)
    # VocabTrim: the precision draft's head scores only this many token ids (0: all).
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        if not any(c.id == FULL_CONFIG for c in self.configs):
            self.configs.insert(0, SkipConfig(FULL_CONFIG, tuple(range(self.num_layers))))

    def graphs(self) -> list[GraphSpec]:
        """prefill, one decode graph per configuration, then each draft source's graph piece
        in turn (graphs/drafts/: it adds its engines or changes a graph it drafts with)."""
        from adaptive_export.graphs.drafts import GRAPH_PIECES

        every = tuple(range(self.num_layers))
        out = [GraphSpec("prefill", "prefill", every, logits="last", router_scores=self.routers)]
        out += [GraphSpec(f"decode_{config.id}", "decode", config.kept, config=config.id) for config in self.configs]
        for piece in GRAPH_PIECES.values():
            out = piece.add_graphs(self, out)
        return out
