"""Drafts of a smaller bundle (`run --draft-bundle DIR`), verified with the bonus row by the
target's decode engine. The draft bundle's engines and arena are a run-time resource
(runtimes/draft_model.py `DraftModel`, the chain's `SourceEnv.draft_model`); a chain puts
`sure_lookup` before it, so a round a long match can fill copies instead of running the draft."""

from __future__ import annotations

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.drafting.base import (
    DraftSource,
    ModelDrafter,
    Proposal,
    SourceEnv,
    decode_engine_verify,
    register_source,
)
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler


@register_source
class DraftModelSource(DraftSource):
    """Rounds of a draft model's tokens (up to k a round, fewer where it doubts its own)."""

    name = "draft_model"
    bonus = True

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int, draft: ModelDrafter) -> None:
        super().__init__(backend, config, model, k)
        self.draft = draft

    @classmethod
    def create(cls, env: SourceEnv, k: int) -> DraftSource:
        if env.draft_model is None:
            raise UsageError("draft source 'draft_model' needs a draft bundle", "pass --draft-bundle DIR")
        return cls(env.backend, env.config, env.model, k, env.draft_model)

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        return self.draft.draft(context, k, sampler)

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


SOURCE = DraftModelSource
