"""Early exit's graph piece (LayerSkip): per configuration, a draft graph (the kept layers
below E, then the exit adapter and head, also returning the exit hidden state) and a verify
graph (the kept layers from E on, over the draft's saved hidden states)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from adaptive_export.graphs.span_graph import GraphSpec

if TYPE_CHECKING:  # the plan applies this piece
    from adaptive_export.graphs.plan import BuildPlan, SkipConfig


@dataclass(frozen=True)
class ExitPlan:
    """Early-exit speculation at layer E with an optional fitted exit adapter."""

    exit_layer: int
    draft_len: int
    adapter: bool = False
    # A trained draft head (`build --draft-head`): the draft graph's head scores only this many
    # token ids (the bundle's draft_vocab); 0: the full vocabulary.
    draft_vocab: int = 0


def exit_graphs(config: SkipConfig, plan: ExitPlan) -> list[GraphSpec]:
    """draft(S,E): kept layers below E then the exit head; verify(S,E): the rest from h_E. Both
    adapt their layers where the configuration's decode does, so draft + verify is that decode."""
    below = tuple(i for i in config.kept if i < plan.exit_layer)
    above = tuple(i for i in config.kept if i >= plan.exit_layer)
    if not below or not above:
        return []
    return [
        GraphSpec(
            f"draft_{config.id}_e{plan.exit_layer}",
            "draft",
            below,
            exit_hidden=True,
            exit_adapter=plan.adapter,
            config=config.id,
            exit_layer=plan.exit_layer,
            draft_vocab=plan.draft_vocab,
            skip_adapters=config.adapters,
        ),
        GraphSpec(
            f"verify_{config.id}_e{plan.exit_layer}",
            "verify",
            above,
            source="hidden",
            config=config.id,
            exit_layer=plan.exit_layer,
            skip_adapters=config.adapters,
        ),
    ]


NAME = "early_exit"  # the registered source (runtimes/draft_registry.py); its plan's key
EXIT_KINDS = ("draft", "verify")  # the graph kinds this piece plans, each its configuration's engine role


def add_graphs(plan: BuildPlan, graphs: list[GraphSpec]) -> list[GraphSpec]:
    """Every configuration's draft and verify graphs, when the plan speculates with an exit."""
    exit_plan = plan.draft(NAME, ExitPlan)
    if exit_plan is None:
        return graphs
    return graphs + [graph for config in plan.configs for graph in exit_graphs(config, exit_plan)]


def engine_role(graph: GraphSpec) -> str | None:
    """An exit's draft graph is its configuration's `draft` engine, its verify graph the `verify` one."""
    return graph.kind if graph.kind in EXIT_KINDS else None
