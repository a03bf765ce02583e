"""A chain of draft sources: asked in order each round, the first with drafts drafts the round.

"Prompt lookup first, then the head" is a list of names here, not code in the loop: each
round asks the chain's sources in turn (`DraftChain.propose`) and verifies the first proposal
that has drafts with that source's own verify pass; a round no source drafts for is a plain
decode step. A floor source (a two-row bundle's free guess, `DraftSource.floor`) ends the
chain of such a bundle and is asked also where the others are not (a round the gate made plain,
a budget with no room for drafts). Every source hears every round's outcome (`accept`), so
a source that did not draft still sees the tokens and the in-graph guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptive_export.runtimes.backends import StepOutputs
from adaptive_export.runtimes.drafting.base import (
    PLAIN,
    DraftSource,
    Proposal,
    RoundOutcome,
    SourceEnv,
    decode_engine_verify,
)
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler


class DraftChain:
    """Draft sources in the order they are asked, and the floor (if any) asked last."""

    def __init__(self, env: SourceEnv, sources: Sequence[DraftSource], name: str | None = None) -> None:
        """`name`: what stats call the chain (default: its drafting sources' names joined by commas)."""
        if not sources:
            raise ValueError("a draft chain needs at least one source")
        self.env = env
        self.sources = tuple(sources)
        self.drafting = tuple(source for source in self.sources if not source.floor)
        named = self.drafting or self.sources
        self.name = name or ",".join(source.name for source in named)  # stats' draft_source
        self.k = max(source.k for source in named)  # stats' draft_len: the longest round's drafts

    @property
    def gateable(self) -> bool:
        """Every drafting source can skip a round cheaply, so `--mode auto` may gate the chain."""
        return all(source.gateable for source in self.drafting)

    @property
    def free_proposals(self) -> bool:
        """No drafting source runs an engine to propose: a gated plain round can score their drafts."""
        return all(source.free_proposals for source in self.drafting)

    def begin(self, context: list[int]) -> None:
        for source in self.sources:
            source.begin(context)

    def max_drafts(self, budget: int) -> int:
        """The most drafts a round that may emit `budget` more tokens can verify."""
        return max((source.max_drafts(budget) for source in self.drafting), default=0)

    def propose(
        self,
        pending: int,
        context: list[int],
        budget: int,
        start: int,
        arena: KVArena,
        sampler: Sampler,
        drafting: bool = True,
        floor: bool = True,
    ) -> tuple[DraftSource | None, Proposal]:
        """The first proposal with drafts and its source, asking the drafting sources (when
        `drafting`) then the floor (when `floor`); (None, PLAIN) where none has drafts."""
        for source in self.sources:
            if source.floor:
                k = 1 if floor else 0
            else:
                k = source.max_drafts(budget) if drafting else 0
            if k >= 1:
                proposal = source.propose(pending, context, k, start, arena, sampler)
                if not proposal.plain:
                    return source, proposal
        return None, PLAIN

    def verify(
        self, source: DraftSource | None, pending: int, proposal: Proposal, start: int, arena: KVArena
    ) -> StepOutputs:
        """The proposing source's verify pass; without one, a plain T=1 decode step."""
        if source is not None:
            return source.verify(pending, proposal, start, arena)
        env = self.env
        return decode_engine_verify(env.backend, env.config, pending, [], start, arena)

    def accept(self, outcome: RoundOutcome) -> None:
        for source in self.sources:
            source.accept(outcome)
