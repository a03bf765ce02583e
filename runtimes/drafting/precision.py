"""Precision drafts (QSpec, ML-SpecQD): the same model with its weights at a cheaper precision
drafts for the bundle's own. The draft engine (an int8/int4 round-to-nearest copy of a float
bundle's weights, or a GGUF-exact bundle's own blocks at accuracy 4) runs T=1 per token over
ids and writes every layer's KV rows at L..L+k-1; the decode engine then verifies
[pending, d1, .., dk] at T=k+1 and overwrites those rows with its own, so the arena again
holds only the verifier's KV. Its last row is the bonus token. Draft logits are kept, so
sampling stays lossless (the rejection rule with q = the draft's distribution)."""

from __future__ import annotations

from adaptive_export.runtimes.backends import StepOutputs
from adaptive_export.runtimes.draft_contracts import PRECISION_ROLE, PrecisionContract
from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, decode_engine_verify, engine_drafts
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler


class PrecisionDraft(PrecisionContract, DraftSource):
    """Drafts from the precision_draft engine, verified (with the bonus row) by the decode engine."""

    name = "precision"
    engines = (PRECISION_ROLE,)
    bonus = gateable = True

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        return engine_drafts(self.backend, self.config.engines[PRECISION_ROLE], pending, k, start, arena, sampler)

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


SOURCE = PrecisionDraft
