"""The plan of which graphs a bundle holds: prefill, one decode per configuration, draft/verify.

Pure data (no torch) so the runtime and `inspect` can read it back from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaptive_export.graphs.span_graph import GraphSpec

FULL_CONFIG = "full"


@dataclass(frozen=True)
class SkipConfig:
    """A sorted tuple of kept layer ids, fixed for a whole sequence."""

    id: str
    kept: tuple[int, ...]


@dataclass(frozen=True)
class ExitPlan:
    """Early-exit speculation at layer E with an optional fitted exit adapter."""

    exit_layer: int
    draft_len: int
    adapter: bool = False
    # A trained draft head (`build --draft-head`): the draft graph's head scores only this many
    # token ids (the bundle's draft_vocab); 0: the full vocabulary.
    draft_vocab: int = 0


@dataclass
class BuildPlan:
    num_layers: int
    configs: list[SkipConfig] = field(default_factory=list)
    routers: bool = False
    exit: ExitPlan | None = None
    # A draft engine over the same layers and arena at a cheaper weight precision
    # (runtimes/speculative.py, source "precision"); built for the full configuration only.
    precision_draft: str | None = None
    # PPD: the full model's decode graph also embeds this many trained prompt tokens
    # (runtimes/drafting/prompt_decoding.py); 0: none.
    prompt_tokens: int = 0
    # VocabTrim: the precision draft's head scores only this many token ids (0: all).
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        if not any(c.id == FULL_CONFIG for c in self.configs):
            self.configs.insert(0, SkipConfig(FULL_CONFIG, tuple(range(self.num_layers))))

    def graphs(self) -> list[GraphSpec]:
        every = tuple(range(self.num_layers))
        out = [GraphSpec("prefill", "prefill", every, logits="last", router_scores=self.routers)]
        for config in self.configs:
            out.append(
                GraphSpec(
                    f"decode_{config.id}",
                    "decode",
                    config.kept,
                    config=config.id,
                    prompt_tokens=self.prompt_tokens if config.id == FULL_CONFIG else 0,
                )
            )
        if self.exit is not None:
            for config in self.configs:
                out.extend(exit_graphs(config, self.exit))
        if self.precision_draft is not None:
            out.append(precision_draft_graph(self.num_layers, self.precision_draft, self.draft_vocab))
        return out


PRECISION_DRAFTS = ("int8", "int4", "native4")


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


def exit_graphs(config: SkipConfig, plan: ExitPlan) -> list[GraphSpec]:
    """draft(S,E): kept layers below E then the exit head; verify(S,E): the rest from h_E."""
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
        ),
        GraphSpec(
            f"verify_{config.id}_e{plan.exit_layer}",
            "verify",
            above,
            source="hidden",
            config=config.id,
            exit_layer=plan.exit_layer,
        ),
    ]
