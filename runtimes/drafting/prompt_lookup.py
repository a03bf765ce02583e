"""Prompt-lookup drafts: an n-gram continuation copied from the context; no engine of its own.
The decode engine verifies [pending, d1, .., dk] with T=k+1 over token ids and writes all
layers' rows; its last row gives the bonus token when every draft is accepted, so a round
always emits accepted + 1 tokens."""

from __future__ import annotations

from adaptive_export.runtimes.backends import StepOutputs
from adaptive_export.runtimes.drafting.base import DraftSource, Proposal, decode_engine_verify
from adaptive_export.runtimes.kv_arena import KVArena
from adaptive_export.runtimes.sampling import Sampler

MAX_NGRAM = 3


def lookup_ngram(context: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the context's last n-gram (the longest
    n from max_ngram down to min_ngram that occurred before)."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []


class PromptLookup(DraftSource):
    name = "prompt_lookup"
    bonus = gateable = True
    free_proposals = True

    def propose(
        self, pending: int, context: list[int], k: int, start: int, arena: KVArena, sampler: Sampler
    ) -> Proposal:
        return Proposal(lookup_ngram(context, k))

    def verify(self, pending: int, proposal: Proposal, start: int, arena: KVArena) -> StepOutputs:
        return decode_engine_verify(self.backend, self.config, pending, proposal.tokens, start, arena)


SOURCE = PromptLookup
