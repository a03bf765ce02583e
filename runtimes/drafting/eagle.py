"""EAGLE-head drafts (k = 1) on the decode engine: the bundle's full decode graph also outputs,
per row, its head's guess at the token after the row's own choice (graphs/drafts/eagle.py).
After a round, the guess of the row that chose the last emitted token is the next round's draft,
so proposing runs no engine; the verify pass is the decode engine over [pending, draft], whose
last row emits the bonus token and guesses again. A round without a guess (the first after
prefill) is a plain step, or a floor round on two rows, whose pass guesses too.

The guess is conditioned on the row's argmax: exact for greedy decoding; under sampling a
sampled token other than the argmax makes it a worse guess, never a wrong output (the rejection
rule for a point-mass draft, as prompt lookup's)."""

from __future__ import annotations

from adaptive_export.runtimes.backends import Backend, StepOutputs
from adaptive_export.runtimes.draft_contracts import EAGLE_FIELD, EAGLE_ROLE, EagleContract
from adaptive_export.runtimes.drafting.base import PLAIN, DraftSource, Proposal, decode_engine_verify
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.manifest import ConfigEntry, ModelDims
from adaptive_export.runtimes.sampling import Sampler

FIELD, ROLE = EAGLE_FIELD, EAGLE_ROLE
__all__ = ["FIELD", "ROLE", "Eagle"]


class Eagle(EagleContract, DraftSource):
    name = "eagle"
    engines = (ROLE,)
    bonus = gateable = free_proposals = True

    def __init__(self, backend: Backend, config: ConfigEntry, model: ModelDims, k: int) -> None:
        super().__init__(backend, config, model, min(k, 1))  # one guess per pass: k > 1 would chain the head

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        guess = self.guess_for(start)
        return Proposal([guess]) if k >= 1 and guess is not None else PLAIN

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


SOURCE = Eagle
